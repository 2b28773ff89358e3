"""Compare an engine's greedy tokens with the oracle: every step of every sequence is verified.

Rule: the oracle judges the engine's OWN continuation. For each step i, the oracle's logits given
``prompt + engine tokens[:i]`` (teacher forcing on the engine's tokens, `Reference.given`) decide:
the engine's token at step i is right if it is the oracle's best there, a *near tie* if the
oracle's best beats it by at most the tie tolerance (numerics, not a bug), else a *mismatch* (a bug).
Where the engine's tokens equal the oracle's greedy tokens, these logits are the greedy run's own,
so an identical sequence costs nothing more; after a near tie the oracle follows the engine's branch,
so nothing after it goes unverified.

Ids the engine declares it never emits (``Declaration.never_emits``: its runtime masks them) are out of the oracle's
choice too: at each step its best is taken among the other ids (the steps where an excluded id was the oracle's best
are counted, `Verdict.excluded_steps`, and reported); an engine returning one of them fails at once. An oracle without
logits (an engine oracle without score()) cannot exclude anything: equality stays the rule.

Near ties are budgeted: more than ``max_near_ties`` in one sequence is *numerics drift*, a failure
listing every flip (a correct engine flips rarely; one that flips at every close call is not
computing what the model computes).

The engine's own top-k (servers: engines/server.py, which give log-probabilities, not logits) narrows the rule, never
widens it: where the engine gave its top-k log-probabilities at a step (two or more entries), a flip the oracle calls a
near tie is one only if the engine's top-k holds both the oracle's choice and its own token, no further apart than the
same allowance (log-probabilities of one step differ by the logits' difference). A step without them is judged by the
oracle alone, as for any engine.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pytest_kvcompile.config.tolerances import (
    DEFAULT_MAX_NEAR_TIES,
    DEFAULT_TIE_TOLERANCE,
)
from pytest_kvcompile.errors import OracleUnreliable
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.verdicts.failures import Failure, Kind, Where


@dataclass(frozen=True)
class Divergence:
    """A step where the engine's token is not the oracle's best given the engine's own prefix."""

    step: int
    expected: int  # the oracle's best at this step, given the engine's tokens before it
    got: int
    gap: float
    near_tie: bool
    allowed: float = 0.0  # the largest gap that was a near tie here (the tolerance, or the 16-bit local noise rule)
    engine_gap: float | None = None  # |log p(got) - log p(expected)| in the engine's own top-k (inf: one is missing)
    via: str | None = None  # the near-tied routing decisions (one, or a chain of two) that explain it (`routed`)


@dataclass
class Verdict:
    """Outcome of one comparison: every step verified, every divergence classified."""

    steps: int
    divergences: list[Divergence] = field(default_factory=list)
    max_near_ties: int | None = None
    excluded_steps: list[int] = field(default_factory=list)  # steps where the oracle's best was an excluded id

    @property
    def mismatch(self) -> Divergence | None:
        return next((d for d in self.divergences if not d.near_tie), None)

    @property
    def near_ties(self) -> list[Divergence]:
        return [d for d in self.divergences if d.near_tie]

    @property
    def drift(self) -> bool:
        """More near ties in this sequence than the budget allows."""
        return self.max_near_ties is not None and len(self.near_ties) > self.max_near_ties


class TokenMismatch(AssertionError):
    """The engine's tokens differ from the oracle's by more than near ties allow. `failure` (when set) is the
    verdict as data (verdicts/failures.py: its kind, step, gap, tolerance, the oracle's top-3 there, the tokens):
    the reports' token diff and the JSON read it, the hint is chosen from it."""

    def __init__(self, message: str, failure: Failure | None = None, kind: Kind | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.kind = failure.kind if failure is not None else kind or Kind.MISMATCH


def token_verdict(reference: Reference, got: Sequence[int], tie_tolerance: float,
                  max_near_ties: int | None = None, excluded: Collection[int] = (),
                  engine_top: Sequence[Mapping[int, float] | None] | None = None) -> Verdict:
    """Classify every step of `got` against the oracle given the engine's own prefix (the module rule); the oracle
    chooses among ids not in `excluded` (the engine's declared never_emits), and an excluded id in `got` is a
    mismatch. `engine_top`: per step the engine's own top-k log-probabilities (id -> log p), which narrow a near tie
    (module docstring)."""
    verdict = Verdict(steps=reference.steps, max_near_ties=max_near_ties)
    excluded = sorted(set(int(i) for i in excluded))
    known = reference.known if reference.scored else reference.tokens
    # where the oracle's greedy tokens are at hand, steps equal to them need no look; else (a reference not decoded,
    # oracles/reference.py: LazyReference) every step is judged on the oracle's logits along the engine's tokens
    first = 0 if known is None else next(
        (i for i, (e, g) in enumerate(zip(known, got)) if e != g or g in excluded), None)
    if first is None:
        return verdict
    if not reference.scored:  # an oracle without logits: nothing tells a near tie from a bug
        verdict.divergences.append(Divergence(first, reference.tokens[first], int(got[first]), math.inf, False))
        return verdict
    rows = reference.given(got, tie_tolerance)
    for step in range(first, min(verdict.steps, len(got))):
        row, token = rows[step], int(got[step])
        if excluded:
            if int(row.argmax()) in excluded:
                verdict.excluded_steps.append(step)
            row = _without(row, excluded)
        best = int(row.argmax())
        if token in excluded:  # declared impossible, yet returned: the declaration (or the runtime) is wrong
            verdict.divergences.append(Divergence(step, best, token, math.inf, False))
            break
        gap = float(row[best] - row[token])
        if token != best and gap >= 0:
            allowed = allowed_gap(reference, got, step, best, token, gap, tie_tolerance)
            near, engine_gap = gap <= allowed, None
            via = None if near else routed(reference, got, step, token, tie_tolerance)
            near = near or via is not None
            if near and engine_top is not None:
                engine_gap = top_k_gap(engine_top, step, best, token)
                near = engine_gap is None or engine_gap <= allowed or via is not None
            verdict.divergences.append(Divergence(step, best, token, gap, near, allowed, engine_gap, via))
            if verdict.mismatch:
                break
    return verdict


def top_k_gap(engine_top: Sequence[Mapping[int, float] | None], step: int, best: int, token: int) -> float | None:
    """How far apart the engine's own top-k log-probabilities put the oracle's choice `best` and its token at `step`:
    inf when either is missing from them, None when it gave fewer than two there (nothing to narrow with)."""
    row = engine_top[step] if step < len(engine_top) else None
    if not row or len(row) < 2:
        return None
    if best not in row or token not in row:
        return math.inf
    return abs(float(row[token]) - float(row[best]))


def _without(row: torch.Tensor, excluded: Sequence[int]) -> torch.Tensor:
    """`row` with the `excluded` ids out of the choice (-inf)."""
    row = row.clone()
    row[list(excluded)] = -math.inf
    return row


def allowed_gap(reference: Reference, got: Sequence[int], step: int, best: int, token: int, gap: float,
                tie_tolerance: float) -> float:
    """The largest logit gap between `best` and `token` at `step` (on the oracle's row along `got`, or on a routing
    alternative's row: `routed`) that is a near tie: the tie tolerance, or in 16-bit, where larger, the noise of
    equivalent computations at this very position against the oracle's row (`Reference.noise`,
    oracles/precision.py), looked up only for a gap past the tolerance."""
    if gap <= tie_tolerance or reference.noise is None:
        return tie_tolerance
    row = reference.given(got, tie_tolerance)[step]
    return max(tie_tolerance, reference.noise(got).allowed(step, best, token, row))


def routed(reference: Reference, got: Sequence[int], step: int, token: int, tie_tolerance: float) -> str | None:
    """The near-tied routing decisions (oracles/routing.py: one, or a chain of two) whose other side makes `token` a
    near tie at `step` of `got` (by the same rule: the tolerance or the local noise, on the alternative's own row),
    described; None: no routing alternative (a dense model, a float32 run of an engine computing nothing lower) or
    none explains it."""
    routes = getattr(reference, "routes", None)
    if routes is None:
        return None
    for route, row in routes(got, step):
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if best == token or gap <= allowed_gap(reference, got, step, best, token, gap, tie_tolerance):
            return route.describe()
    return None


def check_tokens(
    reference: Reference,
    got: Sequence[int],
    *,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE["float32"],
    max_near_ties: int | None = DEFAULT_MAX_NEAR_TIES["float32"],
    engine: str = "engine",
    model: str = "model",
    prompt: str = "prompt",
    where: Where | str = "",
    window: int | None = None,
    states: str = "",
    context: str = "",
    excluded: Collection[int] = (),
    engine_top: Sequence[Mapping[int, float] | None] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> Verdict:
    """Fail with a full explanation unless every step of `got` is the oracle's choice or a near tie,
    and near ties stay within `max_near_ties` (None: unlimited).

    Returns the verdict when it passes. `where` says which call (verdicts/failures.py: `Where`, e.g. the row of a
    batch and the prompts served before; the hint reads its fields; a plain string is shown, not read); `window` is
    the model's sliding window and `states` its recurrent layers (models/layers.py: states_of), used for hints;
    `context` is appended to a failure (e.g. the calls the engine object served before); `excluded`: ids the engine
    declares it never emits (out of the oracle's choice, module rule); `engine_top`: the engine's own top-k
    log-probabilities per step, which narrow a near tie (module rule); `decode`: ids as the model's tokenizer reads
    them (a mismatch then shows its tokens as text too).
    """
    __tracebackhide__ = True
    got = [int(t) for t in got]
    where = Where.of(where)
    described = where.describe()
    at = f"on model '{model}', {prompt} (length {len(reference.prompt)}){', ' + described if described else ''}"
    if len(got) == reference.steps:
        verdict = token_verdict(reference, got, tie_tolerance, max_near_ties, excluded, engine_top)
        if verdict.mismatch is None and not verdict.drift:
            return verdict
    # a failure: its facts name the oracle's own greedy tokens (decoded now where they were not needed before)
    facts = dict(engine=engine, model=model, prompt=prompt, prompt_length=len(reference.prompt), where=where,
                 window=window, states=states, tolerance=tie_tolerance, scored=reference.scored,
                 max_near_ties=max_near_ties,
                 oracle=_oracle_tokens(reference), tokens=tuple(got),
                 prompt_tail=tuple(int(t) for t in reference.prompt[-8:]), excluded=tuple(sorted(excluded)))
    if len(got) != reference.steps:
        failure = Failure(Kind.LENGTH, **facts)
        lines = [f"engine '{engine}' returned {len(got)} tokens {at}, expected {reference.steps}"]
    else:
        ties = tuple((t.step, t.expected, t.got, round(t.gap, 6)) for t in verdict.near_ties)
        if verdict.mismatch is not None:
            bad = verdict.mismatch
            failure = Failure(Kind.MISMATCH, **facts, step=bad.step, expected=bad.expected, got=bad.got,
                              gap=round(bad.gap, 6) if reference.scored and math.isfinite(bad.gap) else None,
                              allowed=bad.allowed,
                              top3=_top3(reference, got, bad.step, tie_tolerance), near_ties=ties)
            lines = _mismatch(reference, got, verdict, failure, at)
            if decode is not None:
                lines.insert(2, _as_text(decode, reference, got, bad))
        elif verdict.drift:
            failure = Failure(Kind.DRIFT, **facts, near_ties=ties)
            lines = _drift(reference, got, verdict, tie_tolerance, engine, at)
        else:
            return verdict
    lines.append("  hint: " + failure.hint)
    raise TokenMismatch("\n".join(lines + ([context] if context else [])), failure)


def assert_tokens_match(*args, **kwargs) -> Verdict:
    """Deprecated spelling of `check_tokens` (the one name of the token check)."""
    __tracebackhide__ = True
    warnings.warn("pytest_kvcompile.assert_tokens_match is deprecated: call check_tokens (same arguments)",
                  DeprecationWarning, stacklevel=2)
    return check_tokens(*args, **kwargs)


def _as_text(decode: Callable[[Sequence[int]], str], ref: Reference, got: list[int], bad: Divergence) -> str:
    """A mismatch's tokens as the model's tokenizer reads them: expected, got, and the text before them."""
    before = (list(ref.prompt) + got[:bad.step])[-12:]
    return (f"  as text: expected {decode([bad.expected])}, got {decode([bad.got])}, after ...{decode(before)} "
            "(the model's tokenizer)")


def _oracle_tokens(ref: Reference) -> tuple[int, ...]:
    """The oracle's own greedy tokens for a failure's facts (decoded now for a reference not decoded before); () where
    that greedy decode failed the oracle's self-check (the verdict, read along the engine's tokens, stands)."""
    try:
        return tuple(int(t) for t in ref.tokens)
    except OracleUnreliable:
        return ()


#: a failure's message shows at most this many steps each side of the step it names; the whole sequences are in the
#: reports (--kv-report-json, --kv-report-html: the failure's `oracle` and `tokens`)
SHOWN_STEPS = 8


def _sequences(ref: Reference, got: Sequence[int], step: int) -> list[str]:
    """The oracle's and the engine's tokens for a failure's message: whole when short, else a window of SHOWN_STEPS
    each side of `step`, with its step numbers (a long generation's 505 tokens would bury the line that matters)."""
    try:
        oracle: list[int] | None = [int(t) for t in ref.tokens]
    except OracleUnreliable as exc:
        oracle, why = None, f"(its own greedy decode is not shown: {exc})"
    got = [int(t) for t in got]
    longest = max(len(got), len(oracle or ()))
    if longest <= 4 * SHOWN_STEPS:
        return [f"  oracle: {oracle if oracle is not None else why}", f"  engine: {got}"]
    lo, hi = max(0, step - SHOWN_STEPS), min(longest, step + SHOWN_STEPS + 1)

    def window(tokens: list[int]) -> str:
        return f"{'[... ' if lo else '['}{', '.join(map(str, tokens[lo:hi]))}{' ...]' if hi < len(tokens) else ']'}"

    where = f"steps {lo}-{hi - 1} of {longest}"
    return [f"  oracle, {where}: {window(oracle) if oracle is not None else why}", f"  engine, {where}: {window(got)}",
            "  (the whole sequences: the reports, --kv-report-json or --kv-report-html)"]


def _top3(ref: Reference, got: list[int], step: int, tol: float) -> tuple[tuple[int, float], ...]:
    if not ref.scored:
        return ()
    row = ref.given(got, tol)[step].float()
    values, ids = row.topk(min(3, row.numel()))
    return tuple((int(i), round(float(v), 4)) for v, i in zip(values, ids))


def _mismatch(ref: Reference, got, verdict: Verdict, failure: Failure, at: str) -> list[str]:
    bad, engine, tol = verdict.mismatch, failure.engine, failure.tolerance
    n = ref.steps
    context = (f"  context: prompt ...{list(ref.prompt[-4:])} | generated {got[max(0, bad.step - 6):bad.step]}"
               f" -> expected {bad.expected}, got {bad.got}")
    if bad.got in failure.excluded:
        return [
            f"engine '{engine}' returned token {bad.got} {at}: step {bad.step} of {n}, an id it declares it never "
            f"emits (Declaration.never_emits: ids {list(failure.excluded)} on this model)",
            "  the oracle's choice excluded it on that declaration, so this step cannot be judged: the declaration "
            "is wrong, or the runtime does not mask what it says it masks",
            context, *_sequences(ref, got, bad.step), f"  reference: {ref.source}"]
    if not ref.scored:
        return [
            f"engine '{engine}' diverges from the oracle {at}: step {bad.step} of {n}",
            f"  expected token {bad.expected}, got {bad.got}: the oracle has no logits (it declares no score()), so "
            "every token must be equal: a near tie cannot be told from a bug here",
            context, *_sequences(ref, got, bad.step), f"  reference: {ref.source}",
        ]
    given = " (given the engine's own tokens before it, which left the oracle's path at an earlier near tie)" \
        if verdict.near_ties else ""
    if bad.engine_gap is not None and bad.gap <= max(bad.allowed, tol):  # the oracle's near tie, not the engine's
        own = ("its own top-k log-probabilities there lack one of the two" if bad.engine_gap == math.inf else
               f"its own top-k log-probabilities put them {bad.engine_gap:.4g} apart")
        why = (f"the oracle prefers {bad.expected} by a logit gap of {bad.gap:.4g}, within {_allowed(bad, tol)}, but "
               f"{own}: a near tie needs both sides to see one (the top-k rule, docs/servers.md), so this is a "
               "mismatch")
    else:
        why = (f"the oracle prefers {bad.expected} by a logit gap of {bad.gap:.4g} > {_allowed(bad, tol)}, so this is "
               "a real mismatch, not numerics")
    lines = [
        f"engine '{engine}' diverges from the oracle {at}: step {bad.step} of {n}{given}",
        f"  expected token {bad.expected}, got {bad.got}: {why}",
        *_against_float64(ref, got, bad, tol),
        "  oracle top-3 at this step: " + ", ".join(f"{t} ({v:.4g})" for t, v in failure.top3),
        context, *_sequences(ref, got, bad.step),
    ]
    routes = getattr(ref, "routes", None)
    if routes is not None:  # a mixture-of-experts model judged in 16-bit or with a KV cache stored lower: asked too
        tried = routes(got, bad.step)
        chains = sum(len(route.swaps) > 1 for route, _ in tried)
        lines.append(f"  nor is {bad.got} the truth's token with one near-tied routing decision taken the other way, "
                     f"or two in a chain ({len(tried) - chains} + {chains} tried, within the measured router "
                     "tolerance: oracles/routing.py)" if tried else
                     "  no routing decision along these tokens is near-tied (oracles/routing.py): the experts chosen "
                     "are the truth's")
    lines += [f"  earlier near tie at step {t.step}: {t.expected} vs {t.got}, gap {t.gap:.3g}{_via(t)}"
              for t in verdict.near_ties]
    if failure.excluded:
        lines.append(f"  ids {list(failure.excluded)} are out of the oracle's choice (the engine declares it never "
                     f"emits them); the oracle's best was one of them at step(s) {verdict.excluded_steps or 'none'}")
    lines.append(f"  reference: {ref.source}")
    return lines


def _against_float64(ref: Reference, got: Sequence[int], bad: Divergence, tol: float) -> list[str]:
    """A 16-bit mismatch beside torch's own accuracy anchor (issue 71): the engine's error on the truth's difference
    between the two tokens is at least the gap (it ranked its token first), set against the error each equivalent
    computation makes on it at this very position, so the line tells "as close to float64 as eager, by another
    rounding" from "far beyond it"."""
    if ref.noise is None or not math.isfinite(bad.gap) or bad.gap <= 0:
        return []
    local, row = ref.noise(got), ref.given(got, tol)[bad.step]
    errors = local.errors(bad.step, bad.expected, bad.got, row)
    worst, least = float(errors.max()), float(errors.min())
    if not worst > 0:
        return []
    spread = local.spread(bad.step, row)
    reach = (f"; their spread here (the largest RMS error over the truth's top differences) is {spread:.3g}: the "
             f"engine's error is at least {bad.gap / spread:.3g}x it, where one computation's error on one difference "
             f"reached {local.reach:.3g}x another attention family's in calibration") if local.reach and spread else ""
    return [f"  against float64 here: the engine's error on the logit difference {bad.expected} - {bad.got} is at "
            f"least {bad.gap:.4g} (it ranked {bad.got} first), {bad.gap / worst:.3g}x the largest of the {len(errors)} "
            f"equivalent computations' errors on it ({least:.3g} to {worst:.3g}){reach}; this rule allows "
            f"{bad.allowed / worst:.3g}x the largest, torch's own accuracy check (torch._dynamo.utils.same with "
            "fp64_ref) a 16-bit result 3x eager's RMSE to float64"]


def _via(divergence: Divergence) -> str:
    return f", the truth's own token with near-tied routing taken the other way ({divergence.via})" \
        if divergence.via else ""


def _allowed(divergence: Divergence, tol: float) -> str:
    if divergence.allowed > tol:
        return (f"{divergence.allowed:.4g} allowed here (the noise of equivalent computations at this position; "
                f"tie tolerance {tol:.4g})")
    return f"tie tolerance {tol:.4g}"


def _drift(ref: Reference, got, verdict: Verdict, tol, engine, at) -> list[str]:
    ties = verdict.near_ties
    return [
        f"engine '{engine}' drifts from the oracle {at}: {len(ties)} near ties in one sequence of "
        f"{verdict.steps} steps, more than the {verdict.max_near_ties} allowed (--kv-max-near-ties)",
        *(f"  near tie at step {t.step}: oracle {t.expected} vs engine {t.got}, "
          + (f"gap {t.gap:.3g}{_via(t)}" if t.via else f"gap {t.gap:.3g} <= {max(t.allowed, tol):.3g}")
          for t in ties),
        *_sequences(ref, got, ties[0].step if ties else 0),
        f"  reference: {ref.source}",
    ]


def _distance(a: torch.Tensor, b: torch.Tensor, excluded: Collection[int]) -> torch.Tensor:
    found = (a.float() - b).abs()
    if excluded:  # the engine may mask the ids it declares it never emits: their columns are not compared
        found[..., sorted(excluded)] = 0
    return found


def compared_rows(reference: Reference, got: Sequence[int], scored: torch.Tensor, tie_tolerance: float,
                  excluded: Collection[int] = ()) -> torch.Tensor:
    """The oracle's logits a score() of `got` is compared with (a scored reference): along the engine's tokens, and
    after an eviction near tie the closest alternative (the one nearest `scored`)."""
    oracle = reference.given(got, tie_tolerance)
    if reference.alternatives is not None and len(got):
        rows = reference.alternatives(got, tie_tolerance)
        closest = [int(_distance(scored[i], alt, excluded).amax(-1).argmin()) for i, alt in enumerate(rows)]
        oracle = torch.stack([alt[k] for alt, k in zip(rows, closest)])
    return oracle


def check_score(reference: Reference, got: Sequence[int], scored: torch.Tensor, *, tie_tolerance: float,
                score_tolerance: float, engine: str = "engine", model: str = "model", prompt: str = "prompt",
                excluded: Collection[int] = (), spread: float | None = None) -> float:
    """A declared ``score(prompt, got)`` is checked twice: its rows against the oracle's logits given the same
    tokens (max abs difference <= `score_tolerance`; in 16-bit, where the reference gives its local noise, or
    `spread` x the equivalent computations' own error at that step if larger: oracles/precision.py), and its argmax
    against `got`, the tokens ``generate()`` produced (the same path must pick the same tokens, up to near ties in its
    own logits). Ids in `excluded`, which the engine declares it never emits, are out of both (it may mask them).
    Returns the max difference."""
    __tracebackhide__ = True
    got = [int(t) for t in got]
    oracle = scored.float() if not reference.scored else compared_rows(reference, got, scored, tie_tolerance, excluded)
    diff = _distance(scored, oracle, excluded)
    worst = float(diff.max()) if diff.numel() else 0.0
    problems = []
    if worst > score_tolerance:
        per_step = diff.amax(-1).double()
        allowed = torch.full_like(per_step, score_tolerance)
        local = reference.noise(got) if reference.noise is not None else None  # 16-bit: the local term
        if local is not None:
            for step in (per_step > score_tolerance).nonzero().flatten().tolist():
                allowed[step] = max(score_tolerance, local.score_allowed(
                    step, oracle[step], sorted(excluded), **({} if spread is None else {"spread": spread})))
        routed = _routed_rows(reference, got, scored, per_step > allowed, allowed, excluded)
        per_step[routed] = 0.0  # rows that the truth with near-tied routing taken the other way explains
        if bool((per_step > allowed).any()):
            step = int((per_step / allowed).argmax())
            where = (f"score tolerance {score_tolerance:g}" if float(allowed[step]) == score_tolerance else
                     f"{float(allowed[step]):.4g}, the equivalent 16-bit computations' own error at this step x "
                     f"their measured spread (score tolerance {score_tolerance:g})")
            problems.append(f"  its logits differ from the oracle's by up to {float(per_step[step]):.4g} > {where} "
                            f"(at step {step}: oracle top-3 {_top(oracle[step])}, "
                            f"score() top-3 {_top(scored[step])})" + (
                                ", nor are they within that of the truth with one near-tied routing decision (or two "
                                "in a chain) taken the other way" if getattr(reference, "routes", None) else ""))
    for step, token in enumerate(got):
        row = _without(scored[step].float(), sorted(excluded)) if excluded else scored[step]
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if best != token and gap > tie_tolerance:
            problems.append(f"  at step {step} generate() produced {token} but score() prefers {best} by {gap:.4g} "
                            f"> tie tolerance {tie_tolerance:g}: "
                            f"score() and generate() do not run the same computation")
            break
    if problems:
        failure = Failure(Kind.SCORE, engine, model, prompt, len(reference.prompt), tolerance=score_tolerance,
                          gap=round(worst, 6), tokens=tuple(got), oracle=_oracle_tokens(reference))
        raise TokenMismatch("\n".join([
            f"engine '{engine}': score() is not the oracle's logits on model '{model}', {prompt}, teacher-forced on "
            "the tokens generate() produced", *problems, "  hint: " + failure.hint]), failure)
    return worst


def _routed_rows(reference: Reference, got: Sequence[int], scored: torch.Tensor, beyond: torch.Tensor,
                 allowed: torch.Tensor, excluded: Collection[int]) -> list[int]:
    """The steps among `beyond` whose score() row is within `allowed` of the truth with one near-tied routing decision
    (or a chain of two) taken the other way (`routed`'s alternatives): a correct engine whose router took a near tie
    the other way scores every later row that way."""
    routes = getattr(reference, "routes", None)
    if routes is None:
        return []
    return [step for step in beyond.nonzero().flatten().tolist()
            if any(float(_distance(scored[step], row, excluded).max()) <= float(allowed[step])
                   for _, row in routes(got, step))]


def _top(row: torch.Tensor) -> str:
    values, ids = row.float().topk(min(3, row.numel()))
    return ", ".join(f"{int(i)} ({float(v):.4g})" for v, i in zip(values, ids))


def check_logprobs(reference: Reference, got: Sequence[int], rows: Sequence[Mapping[int, float]], *,
                   tie_tolerance: float, score_tolerance: float, engine: str = "engine", model: str = "model",
                   prompt: str = "prompt", excluded: Collection[int] = ()) -> float:
    """A server's teacher-forced top-k log-probabilities along `got` (engines/server.py: teacher_forced), the check of
    ``score()`` for engines that give log-probabilities, not logits: each given entry against the oracle's
    log-softmax at the same step (max abs difference <= `score_tolerance`), and each step's best entry against `got`
    (the same path must pick the same tokens, up to a near tie). Returns the max difference."""
    __tracebackhide__ = True
    got = [int(t) for t in got]
    oracle = reference.given(got, tie_tolerance).float().log_softmax(-1) if reference.scored else None
    worst, worst_at, problems = 0.0, None, []
    for step, row in enumerate(rows):
        entries = {int(t): float(v) for t, v in row.items() if int(t) not in excluded}
        if oracle is not None:
            for token, logprob in entries.items():
                diff = abs(logprob - float(oracle[step, token])) if 0 <= token < oracle.shape[-1] else math.inf
                if diff > worst:
                    worst, worst_at = diff, (step, token, logprob)
        best = max(entries, key=entries.get, default=None)
        own = entries.get(got[step], -math.inf)
        if best is not None and best != got[step] and entries[best] - own > tie_tolerance and not problems:
            problems.append(f"  at step {step} generate() produced {got[step]} but its teacher-forced "
                            f"log-probabilities prefer {best} by {entries[best] - own:.4g} > tie tolerance "
                            f"{tie_tolerance:g}: the server's prompt path and its generation path do not compute the "
                            "same thing")
    if worst > score_tolerance:
        step, token, logprob = worst_at
        problems.insert(0, f"  its log-probabilities differ from the oracle's log-softmax by up to {worst:.4g} > score "
                           f"tolerance {score_tolerance:g} (worst at step {step}, token {token}: server {logprob:.4g}, "
                           f"oracle {float(oracle[step, token]):.4g})")
    if problems:
        failure = Failure(Kind.SCORE, engine, model, prompt, len(reference.prompt), tolerance=score_tolerance,
                          gap=round(worst, 6), tokens=tuple(got), oracle=_oracle_tokens(reference))
        raise TokenMismatch("\n".join([
            f"engine '{engine}': its teacher-forced log-probabilities are not the oracle's on model '{model}', "
            f"{prompt}, along the tokens generate() produced", *problems, "  hint: " + failure.hint]), failure)
    return worst
