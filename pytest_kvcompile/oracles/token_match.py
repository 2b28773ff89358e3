"""Compare an engine's greedy tokens with the oracle: every step of every sequence is verified.

Rule: the oracle judges the engine's OWN continuation. For each step i, the oracle's logits given
``prompt + engine tokens[:i]`` (teacher forcing on the engine's tokens, `Reference.given`) decide:
the engine's token at step i is right if it is the oracle's best there, a *near tie* if the
oracle's best beats it by at most the tie tolerance (numerics, not a bug), else a *mismatch* (a bug).
Where the engine's tokens equal the oracle's greedy tokens, these logits are the greedy run's own,
so an identical sequence costs nothing more; after a near tie the oracle follows the engine's branch,
so nothing after it goes unverified.

Near ties are budgeted: more than ``max_near_ties`` in one sequence is *numerics drift*, a failure
listing every flip (a correct engine flips rarely; one that flips at every close call is not
computing what the model computes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pytest_kvcompile.oracles.hf import Reference
from pytest_kvcompile.oracles.tolerances import (
    DEFAULT_MAX_NEAR_TIES,
    DEFAULT_TIE_TOLERANCE,
)


@dataclass(frozen=True)
class Divergence:
    """A step where the engine's token is not the oracle's best given the engine's own prefix."""

    step: int
    expected: int  # the oracle's best at this step, given the engine's tokens before it
    got: int
    gap: float
    near_tie: bool
    allowed: float = 0.0  # the largest gap that was a near tie here (the tolerance, or the 16-bit local noise rule)


@dataclass
class Verdict:
    """Outcome of one comparison: every step verified, every divergence classified."""

    steps: int
    divergences: list[Divergence] = field(default_factory=list)
    max_near_ties: int | None = None

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
    """The engine's tokens differ from the oracle's by more than near ties allow. `diff` (when set) is the
    comparison as plain data for the reports' token diff: oracle and engine tokens, the step, gap, tolerance,
    the oracle's top-3 there, the hint."""

    diff: dict | None = None


def compare(reference: Reference, got: Sequence[int], tie_tolerance: float,
            max_near_ties: int | None = None) -> Verdict:
    """Classify every step of `got` against the oracle given the engine's own prefix (the module rule)."""
    verdict = Verdict(steps=len(reference.tokens), max_near_ties=max_near_ties)
    first = next((i for i, (e, g) in enumerate(zip(reference.tokens, got)) if e != g), None)
    if first is None:
        return verdict
    if not reference.scored:  # an oracle without logits: nothing tells a near tie from a bug
        verdict.divergences.append(Divergence(first, reference.tokens[first], int(got[first]), math.inf, False))
        return verdict
    rows = reference.given(got, tie_tolerance)
    for step in range(first, verdict.steps):
        row, token = rows[step], int(got[step])
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if token != best and gap >= 0:
            allowed = allowed_gap(reference, got, step, best, token, gap, tie_tolerance)
            verdict.divergences.append(Divergence(step, best, token, gap, gap <= allowed, allowed))
            if verdict.mismatch:
                break
    return verdict


def allowed_gap(reference: Reference, got: Sequence[int], step: int, best: int, token: int, gap: float,
                tie_tolerance: float) -> float:
    """The largest logit gap between `best` and `token` at `step` (the oracle's row along `got`) that is a near tie:
    the tie tolerance, or in 16-bit, where larger, the noise of equivalent computations at this very position
    (`Reference.noise`, oracles/precision.py), looked up only for a gap past the tolerance."""
    if gap <= tie_tolerance or reference.noise is None:
        return tie_tolerance
    row = reference.given(got, tie_tolerance)[step]
    return max(tie_tolerance, reference.noise(got).allowed(step, best, token, row))


def assert_tokens_match(
    reference: Reference,
    got: Sequence[int],
    *,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE["float32"],
    max_near_ties: int | None = DEFAULT_MAX_NEAR_TIES["float32"],
    engine: str = "engine",
    model: str = "model",
    prompt: str = "prompt",
    where: str = "",
    window: int | None = None,
    context: str = "",
) -> Verdict:
    """Fail with a full explanation unless every step of `got` is the oracle's choice or a near tie,
    and near ties stay within `max_near_ties` (None: unlimited).

    Returns the verdict when it passes. `where` describes the call (e.g. "alone" or "index 2 of a batch of
    lengths [7, 1, 48]"); `window` is the model's sliding window, used for hints; `context` is appended
    to a failure (e.g. the calls the engine object served before).
    """
    __tracebackhide__ = True
    got = [int(t) for t in got]
    if len(got) != len(reference.tokens):
        raise TokenMismatch(
            f"engine '{engine}' returned {len(got)} tokens for {prompt} on model '{model}', "
            f"expected {len(reference.tokens)}"
        )
    verdict = compare(reference, got, tie_tolerance, max_near_ties)
    at = f"on model '{model}', {prompt} (length {len(reference.prompt)}){', ' + where if where else ''}"
    if verdict.mismatch is not None:
        lines = _mismatch(reference, got, verdict, tie_tolerance, engine, at, where, window)
    elif verdict.drift:
        lines = _drift(reference, got, verdict, tie_tolerance, engine, at)
    else:
        return verdict
    error = TokenMismatch("\n".join(lines + ([context] if context else [])))
    error.diff = _diff(reference, got, verdict, tie_tolerance, prompt, where, lines[-1].removeprefix("  hint: "))
    raise error


def _diff(ref: Reference, got: list[int], verdict: Verdict, tol: float, prompt: str, where: str, hint: str) -> dict:
    bad = verdict.mismatch
    top = []
    if bad is not None and ref.scored:
        row = ref.given(got, tol)[bad.step].float()
        values, ids = row.topk(min(3, row.numel()))
        top = [[int(i), round(float(v), 4)] for v, i in zip(values, ids)]
    return {"prompt": prompt, "where": where, "prompt_tail": [int(t) for t in ref.prompt[-8:]],
            "prompt_length": len(ref.prompt), "oracle": [int(t) for t in ref.tokens], "engine": got,
            "step": bad.step if bad else None, "gap": round(bad.gap, 6) if bad and ref.scored else None, "tolerance": tol,
            "top3": top, "near_ties": [[t.step, t.expected, t.got, round(t.gap, 6)] for t in verdict.near_ties],
            "kind": "mismatch" if bad else "drift", "hint": hint}


def _mismatch(ref: Reference, got, verdict: Verdict, tol, engine, at, where, window) -> list[str]:
    bad = verdict.mismatch
    n, plen = len(ref.tokens), len(ref.prompt)
    if not ref.scored:
        return [
            f"engine '{engine}' diverges from the oracle {at}: step {bad.step} of {n}",
            f"  expected token {bad.expected}, got {bad.got}: the oracle has no logits (it declares no score()), so "
            "every token must be equal: a near tie cannot be told from a bug here",
            f"  context: prompt ...{list(ref.prompt[-4:])} | generated {got[max(0, bad.step - 6):bad.step]}"
            f" -> expected {bad.expected}, got {bad.got}",
            f"  oracle: {list(ref.tokens)}",
            f"  engine: {got}",
            f"  reference: {ref.source}",
            "  hint: " + _hint(bad.step, plen, window, where) + "; if this is a near tie, give the oracle engine "
            "score() (Declaration(scoring=True)) so near ties can be judged",
        ]
    given = " (given the engine's own tokens before it, which left the oracle's path at an earlier near tie)" \
        if verdict.near_ties else ""
    rows = ref.given(got, tol)
    top = rows[bad.step].topk(min(3, rows.size(-1)))
    lines = [
        f"engine '{engine}' diverges from the oracle {at}: step {bad.step} of {n}{given}",
        f"  expected token {bad.expected}, got {bad.got}: the oracle prefers {bad.expected} by a logit gap of "
        f"{bad.gap:.4g} > {_allowed(bad, tol)}, so this is a real mismatch, not numerics",
        "  oracle top-3 at this step: " + ", ".join(f"{int(t)} ({float(v):.4g})" for v, t in zip(*top)),
        f"  context: prompt ...{list(ref.prompt[-4:])} | generated {got[max(0, bad.step - 6):bad.step]}"
        f" -> expected {bad.expected}, got {bad.got}",
        f"  oracle: {list(ref.tokens)}",
        f"  engine: {got}",
    ]
    lines += [f"  earlier near tie at step {t.step}: {t.expected} vs {t.got}, gap {t.gap:.3g}" for t in verdict.near_ties]
    lines.append(f"  reference: {ref.source}")
    lines.append("  hint: " + _hint(bad.step, plen, window, where))
    return lines


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
        *(f"  near tie at step {t.step}: oracle {t.expected} vs engine {t.got}, gap {t.gap:.3g} <= {max(t.allowed, tol):.3g}"
          for t in ties),
        f"  oracle: {list(ref.tokens)}",
        f"  engine: {got}",
        f"  reference: {ref.source}",
        "  hint: each flip is within the tie tolerance, but a correct engine flips rarely; this many means its "
        "numerics are not the model's (lower precision in attention or the cache, a wrong scale, accumulated "
        "error); if the dtype really is this noisy, raise --kv-max-near-ties",
    ]


def _hint(step: int, plen: int, window: int | None, where: str) -> str:
    position = plen + step  # index of the token being predicted
    if step == 0:
        hint = "step 0 is decided by prefill alone: check the prefill forward (masking, positions, RoPE)"
    else:
        hint = (
            f"prefill was right; decode step {step} reads {position} cached positions: check the cache "
            "update/read path, cache positions and state left over from earlier calls"
        )
    if window and plen <= window < position + 1:
        hint += f"; the sequence crossed the sliding window ({window} keys) before this step: check window eviction"
    if "after prompts [" in where:
        hint += "; earlier calls ran on this engine object: check that caches and positions are reset per call"
    if "batch" in where:
        hint += "; it happens inside a batch: check padding, attention masks and per-row positions"
    return hint


def assert_score_matches(reference: Reference, got: Sequence[int], scored: torch.Tensor, *, tie_tolerance: float,
                         score_tolerance: float, engine: str = "engine", model: str = "model",
                         prompt: str = "prompt") -> float:
    """A declared ``score(prompt, got)`` is checked twice: its rows against the oracle's logits given the same
    tokens (max abs difference <= `score_tolerance`), and its argmax against `got`, the tokens ``generate()``
    produced (the same path must pick the same tokens, up to near ties in its own logits). Returns the max
    difference."""
    __tracebackhide__ = True
    got = [int(t) for t in got]
    if not reference.scored:  # an oracle without logits: only score() against generate() can be checked
        oracle = scored.float()
    else:
        oracle = reference.given(got, tie_tolerance)
    diff = (scored.float() - oracle).abs()
    if reference.alternatives is not None and diff.numel():  # after an eviction near tie: the closest alternative
        rows = reference.alternatives(got, tie_tolerance)
        closest = [int((scored[i].float() - alt).abs().amax(-1).argmin()) for i, alt in enumerate(rows)]
        oracle = torch.stack([alt[k] for alt, k in zip(rows, closest)])
        diff = (scored.float() - oracle).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    problems = []
    if worst > score_tolerance:
        step = int(diff.amax(-1).argmax())
        problems.append(f"  its logits differ from the oracle's by up to {worst:.4g} > score tolerance {score_tolerance:g} "
                        f"(worst at step {step}: oracle top-3 {_top(oracle[step])}, score() top-3 {_top(scored[step])})")
    for step, token in enumerate(got):
        best = int(scored[step].argmax())
        gap = float(scored[step][best] - scored[step][token])
        if best != token and gap > tie_tolerance:
            problems.append(f"  at step {step} generate() produced {token} but score() prefers {best} by {gap:.4g} "
                            f"> tie tolerance {tie_tolerance:g}: score() and generate() do not run the same computation")
            break
    if problems:
        raise TokenMismatch("\n".join([
            f"engine '{engine}': score() is not the oracle's logits on model '{model}', {prompt}, teacher-forced on "
            "the tokens generate() produced", *problems,
            "  hint: score(prompt, continuation) must return the logits of the same cache/decode path as generate() "
            "(row i predicts continuation[i]); raw logits, not log-probabilities or processed scores",
        ]))
    return worst


def _top(row: torch.Tensor) -> str:
    values, ids = row.float().topk(min(3, row.numel()))
    return ", ".join(f"{int(i)} ({float(v):.4g})" for v, i in zip(values, ids))
