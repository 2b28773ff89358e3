"""What a correct speculative engine accepts (contract/speculative.py), given drafts the suite chooses.

The suite knows the oracle's greedy continuation of each prompt, so it decides per generated position q whether the
draft there is the target's own choice. A `DraftRow` proposes the oracle's token at every position except those in
its `rejects`, where it proposes the token the oracle ranks last there (never a near tie). A verify step that starts
after m generated tokens and drafts d must then keep exactly the drafts before the first rejected position
(`DraftRow.expected`); `judge` walks an engine's reported steps and names the first that kept another number.

- A schedule (`schedule_rejects`) turns acceptance lengths per step into rejected positions: step r, starting after m
  tokens, keeps lengths[r % len(lengths)] drafts (k: all of them) and takes the bonus token, so the next step starts
  after m + length + 1.
- A prompt *lookup* (n-gram drafting from the sequence itself) is forced through the prompt (`lookup_prompt`): its last
  tokens occur once before, followed by a continuation that agrees with the target's own for exactly j tokens.
- A draft *model* with two rows of the target's output head swapped (models/drafts.py: `head_swapped`) proposes the
  target's own choice except where that is one of the two tokens: its rejects are where the oracle's continuation
  holds one of them (`swap_rejects`, `choose_swap`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.verdicts.rows import Speculation


class UnknownContext(ValueError):
    """A drafter was asked to continue a context that starts with none of the call's prompts."""


@dataclass(frozen=True)
class DraftRow:
    """One prompt's drafts: the oracle's continuation `tokens`, per step the token it ranks last (`wrong`), and the
    generated positions whose draft is wrong (`rejects`)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    wrong: tuple[int, ...]
    rejects: frozenset[int]

    @classmethod
    def of(cls, reference: Reference, rejects: Iterable[int], vocab_size: int) -> DraftRow:
        if reference.logits is not None:
            wrong = tuple(int(i) for i in reference.logits.argmin(-1).tolist())
        else:  # an engine oracle without score(): its tokens must be equal anyway
            wrong = tuple((t + 1) % vocab_size for t in reference.tokens)
        return cls(tuple(reference.prompt), tuple(reference.tokens), wrong, frozenset(rejects))

    def draft(self, q: int) -> int:
        """The draft for generated position q (past the oracle's continuation: the last step's wrong token)."""
        if q >= len(self.tokens):
            return self.wrong[-1]
        return self.wrong[q] if q in self.rejects else self.tokens[q]

    def expected(self, m: int, drafted: int) -> int:
        """Drafts a correct engine keeps in a step starting after m generated tokens that drafted `drafted`."""
        return next((i for i in range(drafted) if m + i in self.rejects), drafted)


@dataclass(frozen=True)
class ScheduledDrafter:
    """A `Drafter` (contract/speculative.py) over `rows`, one per prompt of a call. Stateless and picklable, so it works
    in an isolated engine's process too: the row is the longest prompt the context starts with, the position the
    number of tokens after it."""

    rows: tuple[DraftRow, ...]

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        context = tuple(int(t) for t in context)
        found = [r for r in self.rows if context[:len(r.prompt)] == r.prompt]
        if not found:
            raise UnknownContext(f"the drafter was asked to continue a context of {len(context)} tokens starting "
                                 f"{list(context[:8])}, which starts with none of this call's {len(self.rows)} "
                                 "prompt(s): propose(context, k) takes the prompt followed by the tokens generated "
                                 "for it")
        row = max(found, key=lambda r: len(r.prompt))
        m = len(context) - len(row.prompt)
        return [row.draft(m + i) for i in range(k)]


def schedule_rejects(lengths: Sequence[int], k: int, n: int) -> frozenset[int]:
    """Rejected positions that make steps keep lengths[r % len(lengths)] drafts in turn (k: all), the first step
    starting after the prefill's token, over n generated tokens."""
    rejects, m, step = set(), 1, 0
    while m < n:
        length = lengths[step % len(lengths)]
        if length < k:
            rejects.add(m + length)
        m, step = m + length + 1, step + 1
    return frozenset(rejects)


def swap_rejects(tokens: Sequence[int], swapped: Iterable[int]) -> frozenset[int]:
    """Where a draft with these output rows swapped disagrees with the target along its continuation `tokens`."""
    swapped = set(swapped)
    return frozenset(q for q, t in enumerate(tokens) if t in swapped)


def simulate(rejects: frozenset[int], k: int, n: int) -> list[tuple[int, int]]:
    """(drafted, accepted) per step of an engine drafting min(k, tokens still to come - 1) after the prefill's token."""
    steps, m = [], 1
    while m < n:
        drafted = min(k, n - m - 1)
        accepted = next((i for i in range(drafted) if m + i in rejects), drafted)
        steps.append((drafted, accepted))
        m += accepted + 1
    return steps


def choose_swap(continuations: Sequence[Sequence[int]], k: int, vocab_size: int) -> tuple[int, int]:
    """Two tokens to swap in the target's output head for a draft model: the first one of the continuations whose
    rejects give the most different acceptance lengths (a full step counts as one), the second a token none holds."""
    def lengths(token: int) -> int:
        return len({a if a < d else k for c in continuations
                    for d, a in simulate(swap_rejects(c, [token]), k, len(c)) if d})

    candidates = sorted({t for c in continuations for t in c})
    best = max(candidates, key=lambda t: (lengths(t), -t))
    return best, next(t for t in range(vocab_size) if all(t not in c for c in continuations))


def near_ties(reference: Reference, tolerance: float) -> Callable[[int], bool]:
    """Whether the oracle's best token at generated position q leads its runner-up by at most `tolerance` (False
    everywhere for an oracle without logits)."""
    top = reference.logits.topk(2, dim=-1).values if reference.logits is not None else None
    return lambda q: top is not None and q < len(top) and float(top[q, 0] - top[q, 1]) <= tolerance


@dataclass(frozen=True)
class Judged:
    """An engine's reported steps for one row against the drafts: steps `checked`, steps `unjudged` (after its tokens
    left the oracle's at a near tie, or an excused near tie of a draft model), and the first `wrong` one, described."""

    checked: int
    unjudged: int
    wrong: str | None = None


def unaccounted(steps: Sequence[tuple[int, int]], generated: int) -> str | None:
    """Why reported `steps` cannot have produced `generated` tokens, or None: each step gives its kept drafts and a
    bonus token, the first token comes from prefill or from the first step."""
    produced = sum(a + 1 for _, a in steps)
    if generated - produced in (0, 1):
        return None
    return (f"its {len(steps)} verify step(s) produce {produced} token(s) (accepted + 1 each) but generate() returned "
            f"{generated}: the first token comes from prefill or from the first verify step, every other from a verify "
            "step (a step drafting nothing reports (0, 0))")


@dataclass
class Convention:
    """Where an engine's first verify step starts, decided once per engine from all its sequences (issue 59): 0 (its
    first step is the prompt's own, as transformers' prompt lookup) or 1 (the prefill gives the first token). Per
    sequence the reported steps must account for every generated token exactly once, the convention's first token
    plus each step's accepted + 1; read per sequence alone, a step reporting one kept draft too many on a rejection
    would pass as the other convention."""

    start: int | None = None
    first: str = ""  # the sequence that decided it, for messages

    def check(self, steps: Sequence[tuple[int, int]], generated: int, what: str) -> str | None:
        """Why this sequence's `steps` break the engine's convention (None: they keep it, or decide it)."""
        start = generated - sum(a + 1 for _, a in steps)
        if start not in (0, 1) or not steps:
            return None  # (unaccounted names a count no convention explains)
        if self.start is None:
            self.start, self.first = start, what
            return None
        if start == self.start:
            return None
        return (f"one engine, one convention: its steps give {self._said(start)}, but for {self.first} "
                f"{self._said(self.start)}: a step reports another number of kept drafts than it kept (a bonus token "
                "counted as accepted), or a step is missing\n")

    @staticmethod
    def _said(start: int) -> str:
        return "the first token from the prefill (start 1)" if start == 1 else "every token from a step (start 0)"


def judge(row: DraftRow, steps: Sequence[tuple[int, int]], got: Sequence[int],
          tie: Callable[[int], bool] | None = None) -> Judged:
    """The engine's (drafted, accepted) `steps` for `row`, whose tokens were `got`, against what a correct engine
    keeps. `tie(q)`: the oracle's choice at generated position q is a near tie, so a draft model may propose the
    runner-up there: a step keeping fewer drafts, up to q, is not judged."""
    wrong = unaccounted(steps, len(got))
    if wrong:
        return Judged(0, 0, wrong)
    start = len(got) - sum(a + 1 for _, a in steps)
    diverged = next((i for i, (a, b) in enumerate(zip(got, row.tokens)) if a != b), len(got))
    checked = unjudged = 0
    m = start
    for i, (drafted, accepted) in enumerate(steps):
        expected = row.expected(m, drafted)
        if m + min(expected, max(drafted - 1, 0)) >= diverged or (accepted < expected and tie and tie(m + accepted)):
            unjudged += 1
        elif accepted != expected:
            why = (f"a draft the target must reject (the token the oracle ranks last, or the swapped one) at generated "
                   f"position {m + expected}" if expected < drafted else "every draft being the target's own choice")
            return Judged(checked, unjudged, f"verify step {i + 1} of {len(steps)}, after {m} generated token(s), "
                                             f"drafted {drafted} and kept {accepted}, but a correct engine keeps "
                                             f"{expected}: {why}")
        else:
            checked += 1
        m += accepted + 1
    return Judged(checked, unjudged)


def exercised(steps: Iterable[tuple[int, int]], k: int) -> Speculation:
    """The reports' record of verify steps (verdicts/rows.py: Speculation): per "accepted/drafted", the count."""
    steps = list(steps)
    return Speculation(k, len(steps), sum(d for d, _ in steps), sum(a for _, a in steps),
                       dict(Counter(f"{a}/{d}" for d, a in steps)))


MARKER = 4  # tokens a lookup prompt repeats: longer than the n-grams prompt lookups match (2-3), so every one matches
FILL = 6  # tokens before the first marker, and after the planted continuation (twice that every other layout)
TRIES, ROUNDS = 60, 8  # random layouts tried per acceptance length, fixed-point rounds per layout


@dataclass(frozen=True)
class LookupPrompt:
    """A prompt ``fill + marker + proposal + fill + marker``: an n-gram lookup of its last tokens (any n up to
    MARKER) finds their one earlier occurrence and proposes `proposal`, whose first `accepts` tokens are the target's
    greedy continuation and whose next is not (the token the oracle ranks last there, or, without logits, another).
    An engine whose first verify step starts after `start` generated tokens (0: the prompt's own lookup; 1: after the
    prefill's token, which is the proposal's first when accepts >= 1) must keep min(accepts - start, drafted)."""

    ids: tuple[int, ...]
    proposal: tuple[int, ...]
    accepts: int

    def expected(self, start: int, drafted: int) -> int | None:
        """Drafts the first verify step keeps, or None: not forced (a rejected first token changes the lookup)."""
        if start > self.accepts:
            return None
        return min(self.accepts - start, drafted)


def lookup_prompt(reference: Callable[[tuple[int, ...]], Reference], accepts: int, k: int, vocab_size: int,
                  tolerance: float, seed: int = 0) -> LookupPrompt | None:
    """A `LookupPrompt` whose proposal (k + 1 tokens, so a lookup after the prefill's token still has k) the target
    accepts for exactly `accepts` tokens, or None if none was found. The proposal sits inside the prompt, so it changes
    the continuation it must predict: a fixed point is searched, the proposal set to the oracle's continuation of the
    prompt holding the previous one (the rejected token: the one it ranks last), until the continuation agrees. The
    marker's tokens are distinct and nowhere else, so each n-gram ending the prompt (or, after the prefill's token,
    ending in the proposal's first) has one earlier occurrence; the rejected token is more than `tolerance` below the
    target's choice (never a near tie)."""
    length = k + 1
    for attempt in range(TRIES):
        rng = random.Random(f"lookup {seed} {accepts} {attempt}")
        marker = rng.sample(range(vocab_size), MARKER)
        rest = [t for t in range(vocab_size) if t not in marker]
        fill = FILL * (1 + attempt % 2)  # a longer fill between proposal and end: the proposal moves the end less
        before, after = [rng.choice(rest) for _ in range(FILL)], [rng.choice(rest) for _ in range(fill)]
        proposal = rng.sample(rest, length)
        for _ in range(ROUNDS):
            ids = tuple(before + marker + proposal + after + marker)
            found = reference(ids)
            tokens = list(found.tokens)
            if len(tokens) < min(accepts + 1, length):
                return None
            wrong = (int(found.logits[accepts].argmin()) if found.logits is not None and accepts < len(tokens)
                     else None)
            if _planted(proposal, tokens, accepts, found, tolerance, set(marker)):
                return LookupPrompt(ids, tuple(proposal), accepts)
            planted = tokens[:min(accepts, length)]
            if accepts < length:
                planted.append(wrong if wrong is not None else (tokens[accepts] + 1) % vocab_size)
            proposal = planted + rng.sample(rest, length - len(planted))
    return None


def _planted(proposal: list[int], tokens: list[int], accepts: int, found: Reference, tolerance: float,
             elsewhere: set[int]) -> bool:
    """Whether the target keeps exactly `accepts` tokens of `proposal` along its continuation `tokens`, the rejected
    one not a near tie, no proposal token one of the marker's (`elsewhere`)."""
    if elsewhere & set(proposal):
        return False
    if proposal[:accepts] != tokens[:accepts]:
        return False
    if accepts == len(proposal):
        return True
    if proposal[accepts] == tokens[accepts]:
        return False
    if found.logits is None:
        return True
    row = found.logits[accepts]
    return float(row[tokens[accepts]] - row[proposal[accepts]]) > tolerance


def judge_lookup(lookup: LookupPrompt, steps: Sequence[tuple[int, int]], got: Sequence[int], oracle: Sequence[int],
                 tie: Callable[[int], bool] | None = None) -> Judged:
    """The first verify step an engine reports on a `LookupPrompt`, against the drafts it must keep; later steps (its
    own lookups of the text generated since) only have to account for its tokens (`unaccounted`). Not judged: a
    first token that rejected the proposal (start 1, accepts 0), tokens that left the oracle's (`oracle`) at a near
    tie before the kept drafts end, fewer kept at a near tie (`tie(q)`)."""
    wrong = unaccounted(steps, len(got))
    if wrong:
        return Judged(0, 0, wrong)
    start = len(got) - sum(a + 1 for _, a in steps)
    if not steps:
        return Judged(0, 1)
    drafted, accepted = steps[0]
    expected = lookup.expected(start, drafted)
    diverged = next((i for i, (a, b) in enumerate(zip(got, oracle)) if a != b), len(got))
    if expected is None or start + expected > diverged or (accepted < expected and tie and tie(start + accepted)):
        return Judged(0, 1)
    if drafted == 0:
        return Judged(0, 0, f"its first verify step, after {start} generated token(s), drafted nothing, but the "
                            f"sequence's last {MARKER} tokens occur once before, followed by {list(lookup.proposal)}: "
                            "a prompt lookup proposes them")
    if accepted != expected:
        return Judged(0, 0, f"its first verify step, after {start} generated token(s), drafted {drafted} and kept "
                            f"{accepted}, but the lookup proposes {list(lookup.proposal[start:start + drafted])} "
                            f"(what followed the prompt's earlier occurrence of its last {MARKER} tokens), of which "
                            f"the target's own greedy choices are the first {expected}")
    return Judged(1, 0)
