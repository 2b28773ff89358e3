"""Long generations: hundreds of tokens in one call, up to the model's position limit, every step verified with the
near-tie rules (the oracle on the engine's own prefix). Engines break late where the suites' 16-token calls never
reach: a decode buffer that wraps, a static cache or a CUDA-graph bucket by length that runs out, a ring buffer on a
windowed model crossing its window dozens of times during decode, position tables that end.

- one prompt of SHORT tokens continued to the model's last position (at most LONG_POSITIONS: the zoo's 512 positions
  give 505 new tokens, 62 window crossings on its windowed models), or to the engine's own last one where it declares
  ``Bounds(max_positions=N)`` (a static cache of N positions, filled to its end);
- a batch of prompts of 1 and LONG tokens continued to the last position of the longer row (engines declaring
  batching).

Cost: the oracle's and the engine's decode steps, about a thousand per engine and model: seconds on the tiny zoo in
float32, several times that in 16-bit on a CPU (docs/prefix-caching.md)."""

import pytest

from pytest_kvcompile.models.prompts import LONG, SHORT, Prompt, of_length
from pytest_kvcompile.verdicts.failures import Where

LONG_POSITIONS = 1024  # a checkpoint allowing more positions is generated up to here


def _new_tokens(kv_engine, longest: int) -> int:
    limit = min(kv_engine.max_positions or LONG_POSITIONS, LONG_POSITIONS)  # a declared bound: to the engine's end
    if limit - longest <= kv_engine.max_new_tokens:
        pytest.skip(f"model '{kv_engine.spec.name}' has {limit} positions: a prompt of {longest} tokens leaves no "
                    f"longer generation than the other checks' {kv_engine.max_new_tokens} tokens")
    return limit - longest


def _where(kv_engine, n: int, end: int, **fields) -> Where:
    window = f", crossing the sliding window W={kv_engine.window} {end // kv_engine.window} times" \
        if kv_engine.window else ""
    return Where(note=f"long generation: {n} new tokens, to position {end}{window}", **fields)


def test_long_generation(kv_engine, kv_oracle, kv_check_tokens):
    prompt = Prompt(f"long-gen{SHORT}", of_length(SHORT, kv_engine.spec.vocab_size, salt=90).ids)
    n = _new_tokens(kv_engine, len(prompt))
    got = kv_engine.generate([prompt], n)[0]
    kv_check_tokens(kv_oracle.reference(prompt.ids, n), got, prompt, _where(kv_engine, n, len(prompt) + n))


@pytest.mark.kv_requires("batching")
def test_long_generation_batched(kv_engine, kv_oracle, kv_check_tokens):
    vocab = kv_engine.spec.vocab_size
    batch = [Prompt(f"long-gen{n}", of_length(n, vocab, salt=91).ids) for n in (1, LONG)]
    n = _new_tokens(kv_engine, LONG)
    lengths = tuple(len(p) for p in batch)
    for i, (prompt, got) in enumerate(zip(batch, kv_engine.generate(batch, n))):
        kv_check_tokens(kv_oracle.reference(prompt.ids, n), got, prompt,
                        _where(kv_engine, n, len(prompt) + n, index=i, lengths=lengths))
