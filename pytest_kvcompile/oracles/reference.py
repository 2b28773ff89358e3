"""`Reference`: what every oracle's ``reference(prompt, max_new_tokens)`` returns (hf.py, eviction.py, engine.py)
and every verdict (token_match.py) reads. It imports no other oracle module, so each of them can import it.

`LazyReference`: the same, as the run's store gives it for an oracle that teacher-forces in one forward
(oracles/store.py): a verdict reads the oracle's logits along the engine's own tokens (`given`), and the oracle's own
greedy continuation (`tokens`, `logits`) is decoded only when something reads it (a failure message, a check that
needs the oracle's path), then memoized like any reference.
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
    #: (tokens, step) -> [(routing.Decision, row [vocab])]: the truth at `step` along `tokens` with one near-tied
    #: routing decision taken the other way (a 16-bit run on a mixture-of-experts model, oracles/routing.py); None: none
    routes: Callable[[Sequence[int], int], list] | None = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        return f"Reference(prompt of length {len(self.prompt)}, tokens={list(self.tokens)})"

    @property
    def scored(self) -> bool:
        """Whether the oracle gives logits, so a divergence can be judged a near tie (else tokens must be equal)."""
        return self.logits is not None

    @property
    def steps(self) -> int:
        """The number of new tokens this reference is for (the engine must return as many)."""
        return len(self.tokens)

    @property
    def known(self) -> tuple[int, ...] | None:
        """The oracle's greedy tokens where they are at hand without decoding (here always; None: not decoded)."""
        return self.tokens

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


class LazyReference:
    """A `Reference` whose greedy continuation is decoded on first use (module docstring). `given(tokens)` is the
    oracle's teacher-forced logits along `tokens` (`forced`); `greedy()` gives the eager Reference (memoized, and
    self-checked by the store that made it). `scored` is known without decoding: the oracle gives logits."""

    def __init__(self, prompt: tuple[int, ...], steps: int, source: str, greedy: Callable[[], Reference],
                 forced: Callable[[Sequence[int], float], torch.Tensor],
                 noise: Callable[[Sequence[int]], Any] | None = None,
                 routes: Callable[[Sequence[int], int], list] | None = None) -> None:
        self.prompt, self.steps, self.source = prompt, steps, source
        self.forced, self.noise, self.routes = forced, noise, routes
        self.evicted: int | None = None  # an exact oracle evicts nothing
        self.alternatives = None
        self._greedy, self._decoded = greedy, None

    def __repr__(self) -> str:
        shown = f"tokens={list(self._decoded.tokens)}" if self._decoded is not None else "not decoded yet"
        return f"Reference(prompt of length {len(self.prompt)}, {self.steps} steps, {shown})"

    @property
    def scored(self) -> bool:
        return True

    @property
    def decoded(self) -> Reference:
        """The oracle's own greedy continuation, decoded now if no one asked before."""
        if self._decoded is None:
            self._decoded = self._greedy()
        return self._decoded

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.decoded.tokens

    @property
    def known(self) -> tuple[int, ...] | None:
        return None if self._decoded is None else self._decoded.tokens

    @property
    def logits(self) -> torch.Tensor:
        return self.decoded.logits

    def given(self, tokens: Sequence[int], tie_tolerance: float) -> torch.Tensor:
        """The oracle's logits [steps, vocab] at each step given this prompt + `tokens` before it (one forward)."""
        if self._decoded is not None and tuple(int(t) for t in tokens) == self._decoded.tokens:
            return self._decoded.logits
        return self.forced(tokens, tie_tolerance)
