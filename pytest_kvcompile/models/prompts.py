"""Prompt sets: token-id prompts of chosen lengths, random from a fixed seed.

Every model gets lengths 1, short (7), long (48) and a sequence past 256 positions (a prompt
of 250: prefill crosses 64 and 128, decode crosses 256, the sizes RoPE tables, static caches and
paged blocks use), where the model's position limit allows. A model with sliding-window layers
of window W also gets W-1, W, W+1 and 2W+3, so prefill and decode land just before, on
and after the window boundary. Strategies with a budget (eviction) add budget+1 and 2*budget+3,
so eviction really happens (`oracle.exercising_lengths`). The batch mixes different lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

SEED = 1234
SHORT, LONG, PAST_256 = 7, 48, 250


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Prompt('{self.name}', length {len(self.ids)})"

    def __len__(self) -> int:
        return len(self.ids)


def _ids(length: int, vocab_size: int, salt: int) -> tuple[int, ...]:
    import torch  # lazily: the options and the fuzzer's settings import this module

    gen = torch.Generator().manual_seed(SEED * 1000 + salt * 7919 + length)
    return tuple(torch.randint(0, vocab_size, (length,), generator=gen).tolist())


def lengths_for(window: int | None, extra: dict[str, int] | None = None, limit: int | None = None) -> dict[str, int]:
    """Named prompt lengths for a model with sliding window `window` (None: full attention), plus `extra`
    (name -> length), keeping lengths in [1, limit] (limit: the longest prompt the model's positions allow)."""
    named = {}
    if window:
        named = {f"W-1={window - 1}": window - 1, f"W={window}": window, f"W+1={window + 1}": window + 1,
                 f"2W+3={2 * window + 3}": 2 * window + 3}
    named.update({"len1": 1, f"short{SHORT}": SHORT, f"long{LONG}": LONG, f"long{PAST_256}": PAST_256})
    named.update(extra or {})
    seen: dict[int, str] = {}
    for name, length in named.items():
        if 1 <= length <= (limit or length):
            seen.setdefault(length, name)
    return {name: length for length, name in sorted(seen.items())}


def of_length(length: int, vocab_size: int, salt: int = 0) -> Prompt:
    return Prompt(f"len{length}", _ids(length, vocab_size, salt))


def prompt_set(vocab_size: int, window: int | None, extra: dict[str, int] | None = None,
               limit: int | None = None) -> list[Prompt]:
    return [Prompt(name, _ids(length, vocab_size, salt=0))
            for name, length in lengths_for(window, extra, limit).items()]


def variant(prompt: Prompt, vocab_size: int, salt: int) -> Prompt:
    """A different prompt of the same length (same shapes, different tokens)."""
    return Prompt(f"{prompt.name}/v{salt}", _ids(len(prompt), vocab_size, salt=salt))


def batch(vocab_size: int, window: int | None) -> list[Prompt]:
    """Four prompts of different lengths, longest neither first nor last: short, 1, long,
    and W+1 (or 23 for full-attention models)."""
    by_length = {len(p): p for p in prompt_set(vocab_size, window)}
    fourth = by_length[window + 1] if window else of_length(23, vocab_size)
    return [by_length[SHORT], by_length[1], by_length[LONG], fourth]
