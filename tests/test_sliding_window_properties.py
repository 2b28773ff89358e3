"""Property tests of the sliding-window ring buffer (reference_impls/sliding_window.py), with hypothesis.

Ring properties run the engine's own ring update (`ring_sources` + `gather_ring`) without a model, on
keys whose value is their absolute position, over random batches (left-padded prompts), windows and
prefill chunkings, and check the state after every chunk and decode step against the rule read
literally: a sliding layer keeps exactly the last min(length, W) positions, each in slot p % W.
Engine properties run the real engine (eager backend) on the zoo's `mistral-sw` and `gemma3-hybrid`.

Profiles: "ci" (default; fixed, derandomized, few examples) and "dev" (HYPOTHESIS_PROFILE=dev).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models import zoo
from reference_impls.compiled_dynamic import CompiledDynamicCache
from reference_impls.model import attention_mask
from reference_impls.sliding_window import SlidingWindowCache, gather_ring, ring_sources

settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
ENGINE_PROFILE = settings(PROFILE, max_examples=min(PROFILE.max_examples, 6))  # each example runs the model


def run_ring(lengths: list[int], window: int, chunk: int, decode_steps: int):
    """Feed left-padded prompts of `lengths` in chunks of `chunk`, then `decode_steps` single tokens,
    through the ring update; yield (tokens seen per row, ring positions, ring values) after each call."""
    b, width = len(lengths), max(lengths)
    valid = torch.tensor([[False] * (width - n) + [True] * n for n in lengths])
    length = torch.zeros(b, dtype=torch.long)
    ring_pos = torch.full((b, window), -1)
    ring = torch.full((b, window, 1, 1), -1.0)  # a key's value is its position
    calls = list(valid.split(chunk, dim=1)) + [torch.ones(b, 1, dtype=torch.bool)] * decode_steps
    for part in calls:
        pos = length[:, None] + part.long().cumsum(-1) - 1
        new_length = length + part.sum(-1)
        keys = torch.where(part, pos, -100).float()[:, :, None, None]  # pads carry a value no rule can keep
        src, ring_pos = ring_sources(length, new_length, ring_pos, window, part.size(1))
        ring = gather_ring(torch.cat((ring, keys), dim=1), src)
        length = new_length
        yield length.tolist(), ring_pos, ring[:, :, 0, 0]


rings = dict(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    window=st.integers(1, 12),
    chunk=st.integers(1, 45),
    decode_steps=st.integers(0, 20),
)


@settings(PROFILE)
@given(**rings)
def test_ring_keeps_exactly_the_last_window_positions(lengths, window, chunk, decode_steps):
    for seen, ring_pos, values in run_ring(lengths, window, chunk, decode_steps):
        for row, n in enumerate(seen):
            kept = [p for p in ring_pos[row].tolist() if p >= 0]
            # the budget formula: a sliding layer holds min(length, W) keys
            assert len(kept) == min(n, window), f"row {row}: {n} tokens seen, W={window}, ring holds {kept}"
            # unique, in range, and exactly the protected recent window: the last min(n, W) positions
            assert len(set(kept)) == len(kept) and all(0 <= p < n for p in kept)
            assert sorted(kept) == list(range(max(0, n - window), n))
            # each position in slot p % W, holding that position's key (never a pad's)
            for slot, p in enumerate(ring_pos[row].tolist()):
                assert p < 0 or slot == p % window, f"position {p} in slot {slot}, W={window}"
                assert values[row, slot] == (p if p >= 0 else -1)


@settings(PROFILE)
@given(**rings)
def test_ring_after_chunked_prefill_equals_one_shot(lengths, window, chunk, decode_steps):
    *_, one_shot = run_ring(lengths, window, max(lengths), decode_steps)
    *_, chunked = run_ring(lengths, window, chunk, decode_steps)
    assert one_shot[0] == chunked[0]
    assert torch.equal(one_shot[1], chunked[1]) and torch.equal(one_shot[2], chunked[2])


@settings(PROFILE)
@given(st.integers(1, 30), st.integers(1, 6), st.data())
def test_a_window_at_least_the_length_is_exactly_full_attention(n, t, data):
    t = min(t, n)
    window = data.draw(st.integers(n, 40), label="window")
    k_pos = torch.arange(n)[None] - data.draw(st.integers(0, n - 1), label="left pads")
    q_pos = k_pos[:, n - t:].clamp(min=0)
    assert torch.equal(attention_mask(q_pos, k_pos, k_pos >= 0, window), attention_mask(q_pos, k_pos, k_pos >= 0))


# --------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def engines(zoo_cache):
    """Per zoo model: the ring engine; for mistral-sw also full attention (the same weights, no window)."""
    built = {}
    for name in ("mistral-sw", "gemma3-hybrid"):
        path = zoo.checkpoint(name, zoo_cache / "zoo")
        built[name] = SlidingWindowCache(ModelSpec(name, path, AutoConfig.from_pretrained(path)),
                                         compile_backend="eager")
    path = zoo.checkpoint("mistral-sw", zoo_cache / "zoo")
    full = AutoConfig.from_pretrained(path)
    full.sliding_window = None
    built["full"] = CompiledDynamicCache(ModelSpec("mistral-sw/no-window", path, full), compile_backend="eager")
    return built


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@settings(ENGINE_PROFILE, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(["mistral-sw", "gemma3-hybrid"]), n=st.integers(1, 3 * zoo.WINDOW),
       chunk=st.integers(1, 2 * zoo.WINDOW), seed=st.integers(0, 2**16))
def test_engine_chunked_prefill_equals_one_shot(engines, model, n, chunk, seed):
    engine, prompt, cont = engines[model], ids(n, seed), ids(3, seed + 1)  # 2 decode steps after the prefill
    try:
        engine.prefill_chunk = None
        one_shot = engine.score(prompt, cont)
        engine.prefill_chunk = chunk
        chunked = engine.score(prompt, cont)
    finally:
        engine.prefill_chunk = None
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)


@settings(ENGINE_PROFILE, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, zoo.WINDOW - 1), seed=st.integers(0, 2**16))
def test_engine_within_the_window_is_full_attention(engines, n, seed):
    """Sequences no longer than W: the ring engine equals the same weights with no window at all."""
    prompt, cont = ids(n, seed), ids(zoo.WINDOW - n, seed + 1)  # n + len(cont) = W positions
    torch.testing.assert_close(engines["mistral-sw"].score(prompt, cont), engines["full"].score(prompt, cont),
                               atol=1e-5, rtol=1e-5)
