"""Prompt sets: token-id prompts of chosen lengths, random from a fixed seed.

Every model gets lengths 1, short (7) and long (48). A model with sliding-window layers
of window W also gets W-1, W, W+1 and 2W+3, so prefill and decode land just before, on
and after the window boundary. The batch mixes different lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEED = 1234
SHORT, LONG = 7, 48


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Prompt('{self.name}', length {len(self.ids)})"

    def __len__(self) -> int:
        return len(self.ids)


def _ids(length: int, vocab_size: int, salt: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(SEED * 1000 + salt * 7919 + length)
    return tuple(torch.randint(0, vocab_size, (length,), generator=gen).tolist())


def lengths_for(window: int | None) -> dict[str, int]:
    """Named prompt lengths for a model with sliding window `window` (None: full attention)."""
    named = {}
    if window:
        named = {f"W-1={window - 1}": window - 1, f"W={window}": window, f"W+1={window + 1}": window + 1,
                 f"2W+3={2 * window + 3}": 2 * window + 3}
    named.update({"len1": 1, f"short{SHORT}": SHORT, f"long{LONG}": LONG})
    seen: dict[int, str] = {}
    for name, length in named.items():
        if length >= 1:
            seen.setdefault(length, name)
    return {name: length for length, name in sorted(seen.items())}


def of_length(length: int, vocab_size: int, salt: int = 0) -> Prompt:
    return Prompt(f"len{length}", _ids(length, vocab_size, salt))


def prompt_set(vocab_size: int, window: int | None) -> list[Prompt]:
    return [Prompt(name, _ids(length, vocab_size, salt=0)) for name, length in lengths_for(window).items()]


def variant(prompt: Prompt, vocab_size: int, salt: int) -> Prompt:
    """A different prompt of the same length (same shapes, different tokens)."""
    return Prompt(f"{prompt.name}/v{salt}", _ids(len(prompt), vocab_size, salt=salt))


def batch(vocab_size: int, window: int | None) -> list[Prompt]:
    """Four prompts of different lengths, longest neither first nor last: short, 1, long,
    and W+1 (or 23 for full-attention models)."""
    by_length = {len(p): p for p in prompt_set(vocab_size, window)}
    fourth = by_length[window + 1] if window else of_length(23, vocab_size)
    return [by_length[SHORT], by_length[1], by_length[LONG], fourth]
