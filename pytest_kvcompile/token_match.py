"""Compare an engine's greedy tokens with the oracle, token by token.

Rule: at the first step where the engine's token differs from the oracle's, look at the
oracle's logits at that step. If the oracle's own token beats the engine's token by at
most the tie tolerance, the flip is a *near tie* (numerics, not a bug); otherwise it is a
*mismatch* (a bug). After a near tie the two continuations are conditioned on different
tokens, so later steps can only be checked if the engine can score a given continuation
(teacher forcing): then the engine is fed the oracle's tokens and every later step is
classified the same way. Without scoring, the steps after a near tie are reported as
unverified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .oracle import Reference

#: Default tie tolerance (max logit gap that counts as a near tie) per dtype.
DEFAULT_TIE_TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 1.5e-1}

Scorer = Callable[[list[int], list[int]], torch.Tensor]


@dataclass(frozen=True)
class Divergence:
    step: int
    expected: int
    got: int
    gap: float
    near_tie: bool
    teacher_forced: bool = False


@dataclass
class Verdict:
    """Outcome of one comparison: every divergence seen and how far it was verified."""

    steps: int
    divergences: list[Divergence] = field(default_factory=list)
    unverified_from: int | None = None  # first step left unchecked after a near tie

    @property
    def mismatch(self) -> Divergence | None:
        return next((d for d in self.divergences if not d.near_tie), None)

    @property
    def near_ties(self) -> list[Divergence]:
        return [d for d in self.divergences if d.near_tie]


class TokenMismatch(AssertionError):
    """The engine's tokens differ from the oracle's by more than a near tie."""


def compare(reference: Reference, got: Sequence[int], tie_tolerance: float, score: Scorer | None = None) -> Verdict:
    """Classify every divergence of `got` from `reference` (see the module rule)."""
    verdict = Verdict(steps=len(reference.tokens))
    first = next((i for i, (e, g) in enumerate(zip(reference.tokens, got)) if e != g), None)
    if first is None:
        return verdict
    verdict.divergences.append(_divergence(reference, first, got[first], tie_tolerance))
    if verdict.mismatch or first + 1 == verdict.steps:
        return verdict
    if score is None:
        verdict.unverified_from = first + 1
        return verdict
    logits = score(list(reference.prompt), list(reference.tokens))
    for step in range(first + 1, verdict.steps):
        token = int(logits[step].argmax())
        if token != reference.tokens[step]:
            verdict.divergences.append(_divergence(reference, step, token, tie_tolerance, teacher_forced=True))
            if verdict.mismatch:
                break
    return verdict


def _divergence(ref: Reference, step: int, token: int, tol: float, teacher_forced: bool = False) -> Divergence:
    gap = ref.gap(step, token)
    return Divergence(step, ref.tokens[step], int(token), gap, gap <= tol, teacher_forced)


def assert_tokens_match(
    reference: Reference,
    got: Sequence[int],
    *,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE["float32"],
    score: Scorer | None = None,
    engine: str = "engine",
    model: str = "model",
    prompt: str = "prompt",
    where: str = "",
    window: int | None = None,
) -> Verdict:
    """Fail with a full explanation unless `got` equals the oracle up to near ties.

    Returns the verdict (near ties, unverified steps) when it passes. `where` describes
    the call (e.g. "alone" or "index 2 of a batch of lengths [7, 1, 48]"); `window` is
    the model's sliding window, used for hints.
    """
    __tracebackhide__ = True
    got = [int(t) for t in got]
    if len(got) != len(reference.tokens):
        raise TokenMismatch(
            f"engine '{engine}' returned {len(got)} tokens for {prompt} on model '{model}', "
            f"expected {len(reference.tokens)}"
        )
    verdict = compare(reference, got, tie_tolerance, score)
    bad = verdict.mismatch
    if bad is not None:
        raise TokenMismatch(_explain(reference, got, bad, verdict, tie_tolerance, engine, model, prompt, where, window))
    return verdict


def _explain(ref, got, bad: Divergence, verdict: Verdict, tol, engine, model, prompt, where, window) -> str:
    n, plen = len(ref.tokens), len(ref.prompt)
    how = " (teacher-forced on the oracle's tokens after an earlier near tie)" if bad.teacher_forced else ""
    shown = got if not bad.teacher_forced else list(ref.tokens[: bad.step]) + [bad.got]
    lines = [
        f"engine '{engine}' diverges from the oracle on model '{model}', {prompt} "
        f"(length {plen}){', ' + where if where else ''}: step {bad.step} of {n}{how}",
        f"  expected token {bad.expected}, got {bad.got}: the oracle prefers {bad.expected} by a logit gap of "
        f"{bad.gap:.4g} > tie tolerance {tol:g}, so this is a real mismatch, not numerics",
        "  oracle top-3 at this step: " + ", ".join(f"{t} ({v:.4g})" for t, v in ref.top(bad.step)),
        f"  context: prompt ...{list(ref.prompt[-4:])} | generated {list(ref.tokens[max(0, bad.step - 6):bad.step])}"
        f" -> expected {bad.expected}, got {bad.got}",
        f"  oracle: {list(ref.tokens)}",
        f"  engine: {shown}",
    ]
    for tie in verdict.near_ties:
        lines.append(f"  earlier near tie at step {tie.step}: {tie.expected} vs {tie.got}, gap {tie.gap:.3g}")
    lines.append(f"  reference: {ref.source}")
    lines.append("  hint: " + _hint(bad.step, plen, window, where))
    return "\n".join(lines)


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
