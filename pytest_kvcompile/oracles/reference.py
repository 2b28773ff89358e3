"""`Reference`: what every oracle's ``reference(prompt, max_new_tokens)`` returns (hf.py, eviction.py, engine.py)
and every verdict (token_match.py) reads. It imports no other oracle module, so each of them can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Reference:
    """The oracle's continuation of one prompt, with its logits per step ([steps, vocab], fp32, CPU); logits None:
    an engine oracle without score() (oracles/engine.py), whose tokens alone are the reference (exact equality)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logits: torch.Tensor | None
    source: str
    #: (tokens, tie_tolerance) -> the oracle's logits along `tokens` (its teacher_forced, bound to this prompt)
    forced: Callable[[Sequence[int], float], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    #: cache entries the strategy evicted along the greedy run (None: the strategy evicts nothing)
    evicted: int | None = None
    #: tokens -> precision.LocalNoise along prompt + tokens: the noise of equivalent 16-bit computations at each
    #: step (the local term of the 16-bit rule, oracles/precision.py); None: the tolerance alone decides
    noise: Callable[[Sequence[int]], Any] | None = field(default=None, compare=False, repr=False)
    #: (tokens, tie_tolerance) -> per step the rows [k, vocab] of every alternative the oracle follows (an eviction
    #: oracle after near-tied evictions); None: `given` is the only one
    alternatives: Callable[[Sequence[int], float], list] | None = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        return f"Reference(prompt of length {len(self.prompt)}, tokens={list(self.tokens)})"

    @property
    def scored(self) -> bool:
        """Whether the oracle gives logits, so a divergence can be judged a near tie (else tokens must be equal)."""
        return self.logits is not None

    def given(self, tokens: Sequence[int], tie_tolerance: float) -> torch.Tensor:
        """The oracle's logits [steps, vocab] at each step given this prompt + `tokens` before it."""
        if self.logits is None:
            raise ValueError(f"{self!r} has no logits (its oracle, {self.source}, declares no score()): only equal "
                             "tokens can be verified")
        if tuple(int(t) for t in tokens) == self.tokens:
            return self.logits
        if self.forced is None:
            raise ValueError(f"{self!r} was built without its oracle (forced=None), so tokens off the oracle's "
                             "path cannot be verified: get references from an oracle's reference()")
        return self.forced(tokens, tie_tolerance)
