"""Typed verdicts: what failed (a `Kind`), its facts (a `Failure` of one test, a `Problem` of the run), where it
happened (a `Where`: which call, which row), and the hint, chosen from the kind and the fields.

Rule: verdict logic passes facts as fields, never as English. A hint reads the failure's kind, step, prompt length,
window and where (batched? after earlier calls on the engine object?); a run rule names its engine in a field; the
reports read the same fields (results JSON schema 2, reports/json_file.py). Messages for people are rendered from
them; nothing parses a message back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn

from pytest_kvcompile.errors import Failed


class Kind(str, Enum):
    """What a failure is. Test failures first, then the run rules (`Problem`)."""

    MISMATCH = "mismatch"  # a token the oracle does not accept given the engine's own prefix
    DRIFT = "drift"  # more near ties in one sequence than --kv-max-near-ties
    LENGTH = "length"  # the engine returned another number of tokens than asked
    SCORE = "score"  # a declared score() is not the oracle's logits, or not generate()'s own path
    INCONSISTENT = "inconsistent"  # one prompt, two calls of one engine object: different beyond a near tie
    RECOMPILE = "recompile"  # dynamo compiled after warmup, or broke the graph, where that was not allowed
    MEMORY = "memory"  # a memory marker's limit
    LATENCY = "latency"  # a latency budget
    CRASH = "crash"  # the engine's process, or the xdist worker running it, died
    SPECULATION = "speculation"  # a speculative engine kept another number of drafts than a correct one would
    OTHER = "other"  # any other failing test: its message says what
    # run rules: they fail the run, not one test
    VACUOUS = "vacuous"  # token checks ran on an engine x model but verified no token
    NO_EVICTION = "no_eviction"  # an evicting strategy evicted nothing on any verified sequence
    RUN_DRIFT = "run_drift"  # near ties per verified token over the run beyond the rate a correct engine reaches
    LOGIT_DRIFT = "logit_drift"  # score() rows beyond the dtype's typical noise more often than its computations are

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Where:
    """Which call of the engine a token check verified: the row of a batch (`index`, `lengths` of the call's
    prompts), the `number` of the call on one engine object out of `calls`, the prompts it served `before`, and a
    `note` for people; `speculation`: a speculative engine's ``acceptance()`` for the call, per row its (drafted,
    accepted) verify steps. A plain string given where a Where is expected becomes its note (no facts, no facts'
    hints)."""

    index: int | None = None
    lengths: tuple[int, ...] = ()
    number: int | None = None
    calls: int | None = None
    before: tuple[str, ...] = ()
    note: str = ""
    speculation: tuple[tuple[tuple[int, int], ...], ...] = ()

    @classmethod
    def of(cls, where: Where | str | None) -> Where:
        return where if isinstance(where, Where) else cls(note=where or "")

    @property
    def batched(self) -> bool:
        """The prompt was one row of a call with several."""
        return len(self.lengths) > 1

    def describe(self) -> str:
        """'index 1 of a batch of lengths [3, 9], call 2 of 6 on one engine object, after prompts [...]: note'."""
        parts = []
        if self.batched:
            parts.append(f"index {self.index} of a batch of lengths {list(self.lengths)}")
        elif self.number is None and not self.note:
            parts.append("alone")
        if self.number is not None:
            parts.append(f"call {self.number}{f' of {self.calls}' if self.calls else ''} on one engine object")
        if self.before:
            parts.append(f"after prompts [{', '.join(self.before)}]")
        text = ", ".join(parts)
        return f"{text}: {self.note}" if text and self.note else text or self.note

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "lengths": list(self.lengths), "before": list(self.before),
                "speculation": [[list(step) for step in row] for row in self.speculation]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Where:
        speculation = tuple(tuple(tuple(step) for step in row) for row in data.get("speculation", ()))
        return cls(**{**data, "lengths": tuple(data.get("lengths", ())), "before": tuple(data.get("before", ())),
                      "speculation": speculation})


@dataclass(frozen=True)
class Failure:
    """One failed token verdict, as data: the reports' token diff (HTML) and the JSON read these fields.

    `step` is the first divergence (None for a drift or a length failure), `expected` the oracle's best there,
    `gap` its logit lead (None without oracle logits), `allowed` the largest gap that was a near tie there.
    `near_ties`: (step, oracle, engine, gap) of every accepted flip; `excluded`: ids out of the oracle's choice
    (Declaration.never_emits)."""

    kind: Kind
    engine: str
    model: str
    prompt: str
    prompt_length: int
    where: Where = field(default_factory=Where)
    step: int | None = None
    expected: int | None = None
    got: int | None = None
    gap: float | None = None
    allowed: float | None = None
    tolerance: float | None = None
    window: int | None = None
    scored: bool = True  # the oracle has logits (an engine oracle without score() has none: equality is the rule)
    oracle: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()  # the engine's
    prompt_tail: tuple[int, ...] = ()
    top3: tuple[tuple[int, float], ...] = ()
    near_ties: tuple[tuple[int, int, int, float], ...] = ()
    max_near_ties: int | None = None
    excluded: tuple[int, ...] = ()  # ids out of the oracle's choice: the engine declares it never emits them
    states: str = ""  # the model's recurrent layers (models/layers.py: states_of), for the hint

    @property
    def hint(self) -> str:
        return HINTS[self.kind](self)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(kind=self.kind.value, where=self.where.to_dict(), hint=self.hint)
        for name in ("oracle", "tokens", "prompt_tail", "excluded"):
            data[name] = list(data[name])
        data["top3"] = [list(t) for t in self.top3]
        data["near_ties"] = [list(t) for t in self.near_ties]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failure:
        names = {f.name for f in dataclasses.fields(cls)}
        found = {k: v for k, v in data.items() if k in names}
        found.update(kind=Kind(data["kind"]), where=Where.from_dict(data.get("where") or {}))
        for name in ("oracle", "tokens", "prompt_tail", "excluded"):
            found[name] = tuple(data.get(name, ()))
        found["top3"] = tuple(tuple(t) for t in data.get("top3", ()))
        found["near_ties"] = tuple(tuple(t) for t in data.get("near_ties", ()))
        return cls(**found)


def _token_hint(failure: Failure) -> str:
    """Where to look for a token that is not the model's: prefill or decode by the step, the window by the
    positions, the call's history and batch by its fields."""
    step, position = failure.step or 0, failure.prompt_length + (failure.step or 0)
    if failure.got is not None and failure.got in failure.excluded:
        return (f"the engine returned {failure.got}, which its Declaration.never_emits rules out: if the runtime can "
                "emit it, take it out of never_emits (the oracle then chooses it again); else check the runtime's mask")
    if step == 0:
        hint = "step 0 is decided by prefill alone: check the prefill forward (masking, positions, RoPE)"
    else:
        hint = (f"prefill was right; decode step {step} reads {position} cached positions: check the cache "
                "update/read path, cache positions and state left over from earlier calls")
    window = failure.window
    if window and failure.prompt_length <= window < position + 1:
        hint += f"; the sequence crossed the sliding window ({window} keys) before this step: check window eviction"
    if failure.where.before or (failure.where.number or 0) > 1:
        hint += "; earlier calls ran on this engine object: check that caches and positions are reset per call"
    if failure.where.batched:
        hint += _speculation_hint(failure) or "; it happens inside a batch: check padding, attention masks and " \
            "per-row positions"
    hint += _state_hint(failure)
    if not failure.scored:
        hint += ("; if this is a near tie, give the oracle engine score() (Declaration(scoring=True)) so near ties "
                 "can be judged")
    return hint


def _state_hint(failure: Failure) -> str:
    """For a model with recurrent layers: their state, and what to check of it ("" without)."""
    if not failure.states:
        return ""
    where, first = failure.where, ""
    if where.speculation:
        first = ("left where the row's kept tokens end after each verify step (the rejected drafts must not advance "
                 "it: keep the state after each drafted token, or recompute), ")
    elif where.before or (where.number or 0) > 1:
        first = ("resumed on a prefix hit only from a snapshot taken at the hit point (else from the last snapshot "
                 "before it, running the tokens between through the state), ")
    return (f"; model '{failure.model}' has recurrent layers ({failure.states}), whose state is carried, never cropped "
            f"or sliced: check that it is {first}carried across prefill chunks (the conv window's last inputs too), "
            "zeroed for each new request, kept in float32 as the truth keeps it, and that every forward gets its "
            "positions (position_ids)")


def _verify_step(steps: tuple[tuple[int, int], ...], generated: int, token: int) -> int | None:
    """The verify step (0-based) of a row's `steps` that produced its generated token `token` (None: the prefill's
    token, or steps that do not account for the row's tokens). Each step yields its accepted drafts and a bonus; the
    tokens not covered by the steps come first (from the prefill)."""
    start = generated - sum(a + 1 for _, a in steps)
    if start not in (0, 1) or token < start:
        return None
    end = start
    for number, (_, accepted) in enumerate(steps):
        end += accepted + 1
        if token < end:
            return number
    return None


def _speculation_hint(failure: Failure) -> str:
    """For a row of a batched speculative call (`Where.speculation`): how many drafts each row kept at the verify
    step that produced the wrong token and at the one before it, naming per-row rollback when rows kept different
    numbers ("" without the engine's acceptance() or where the steps do not place the token)."""
    where, rows = failure.where, failure.where.speculation
    if where.index is None or where.index >= len(rows) or failure.step is None:
        return ""
    number = _verify_step(rows[where.index], len(failure.tokens), failure.step)
    if number is None:
        return ""
    shown, differ = [], False
    for n in (number - 1, number):
        if n < 0:
            continue
        kept = [row[n] if n < len(row) else None for row in rows]
        differ |= len({step[1] for step in kept if step is not None}) > 1
        shown.append(f"verify step {n + 1}: " + ", ".join(
            f"row {r} {'-' if step is None else f'{step[1]} of {step[0]}'}" for r, step in enumerate(kept)))
    said = (f"; it happens inside a batch of a speculative engine, its token {failure.step} from row {where.index}'s "
            f"verify step {number + 1}; drafts kept per row (acceptance()): {'; '.join(shown)}")
    if differ:
        return said + ("; the rows kept different numbers of drafts: roll each row's K/V (and positions) back by "
                       "its own acceptance, not by one row's or the batch's longest/shortest")
    return said + "; every row kept as many drafts: check padding, attention masks and per-row positions"


HINTS: dict[Kind, Callable[[Failure], str]] = {  # one table: kind of a token verdict -> what to try
    Kind.MISMATCH: _token_hint,
    Kind.DRIFT: lambda f: (
        "each flip is within the tie tolerance, but a correct engine flips rarely; this many means its numerics are "
        "not the model's (lower precision in attention or the cache, a wrong scale, accumulated error); if the dtype "
        "really is this noisy, raise --kv-max-near-ties" + _state_hint(f)),
    Kind.LENGTH: lambda f: ("generate() must return exactly max_new_tokens tokens per prompt (greedy, no stop at "
                            "EOS): check the stop condition and the returned slice"),
    Kind.SCORE: lambda f: (
        "score(prompt, continuation) must return the logits of the same cache/decode path as generate() (row i "
        "predicts continuation[i]); raw logits, not log-probabilities or processed scores"),
}


@dataclass(frozen=True)
class Problem:
    """A run rule that failed (it fails the run, not one test): `engine` is the engine it names; `model`, `device`,
    `dtype` narrow it (None: over all its models)."""

    kind: Kind
    engine: str
    device: str
    dtype: str
    message: str
    model: str | None = None

    @property
    def line(self) -> str:
        on = f" on model '{self.model}'" if self.model else ""
        return f"engine '{self.engine}'{on} ({self.device}, {self.dtype}): {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        return cls(**{**data, "kind": Kind(data["kind"])})


def kind_of(error: BaseException | None) -> Kind:
    """The kind a test's exception declares (a ``kind`` attribute: TokenMismatch, RecompileError, EngineProcessDied),
    else OTHER."""
    try:
        return Kind(getattr(error, "kind", None))
    except ValueError:
        return Kind.OTHER


def fail(kind: Kind, message: str) -> NoReturn:
    """``pytest.fail(message, pytrace=False)`` that tells the reports its kind (a suite's own check: two calls that
    differ, a memory or compile finding)."""
    __tracebackhide__ = True
    error = Failed(message, pytrace=False)
    error.kind = kind.value
    raise error
