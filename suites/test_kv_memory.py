"""KV memory: ``kv_cache_bytes()`` equals the exact footprint of the engine's declared ``KVLayout``
(pytest_kvcompile/memory.py: dynamic, static, eviction budget; sliding and KV-sharing layers), alone
and in a padded batch; and repeating one ``generate()`` call does not grow memory."""

from __future__ import annotations

import dataclasses
import gc
from functools import partial

import pytest
import torch

from pytest_kvcompile.memory import expected_kv_bytes, format_bytes, live_tensor_bytes

WARMUP_CALLS, REPEATS = 1, 3


def _reported(kv_engine) -> int:
    got = kv_engine.engine.kv_cache_bytes()
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        pytest.fail(f"engine '{kv_engine.name}': kv_cache_bytes() returned {got!r}; it must return an int >= 0 "
                    "(bytes held by the KV cache after the last generate())", pytrace=False)
    return got


def _hint(footprint, got: int, footprint_of) -> str:
    """What a wrong count most likely means (footprint_of: layout -> Footprint of the same call)."""
    other_offset = dataclasses.replace(footprint.layout, window_offset=-1 - footprint.layout.window_offset)
    other = footprint_of(other_offset)
    if got == other.total != footprint.total:
        held, declared = (("W-1", "W") if other_offset.window_offset else ("W", "W-1"))
        return (f"the count matches {other_offset}, sliding layers holding {held} positions, not {declared}. A W-1 "
                "view of a W-position buffer (transformers' dynamic sliding layer) holds W: count storages with "
                "pytest_kvcompile.memory.held_bytes, not tensor.nbytes; if the engine really holds "
                f"{held}, declare {other_offset}")
    written = footprint.width + footprint.new_tokens - 1
    unbounded = sum((dataclasses.replace(t, positions=written) if t.kind == "sliding" else t).bytes(
        footprint.rows, footprint.itemsize) for t in footprint.layers)
    if footprint.layout.kind == "dynamic" and got == unbounded != footprint.total:
        return (f"the count matches sliding layers holding all T={written} positions: the engine keeps keys that "
                "left the window (masked, never read again); drop them to bound memory by the window")
    if 2 * got == footprint.total:
        return "the count is exactly half the footprint: are keys or values left out?"
    if footprint.rows > 1 and got * footprint.rows == footprint.total:
        return "the count is one row's: a batch cache holds one row per prompt"
    return ("count what is held, pytest_kvcompile.memory.held_bytes(tensors) (untyped_storage().nbytes() of distinct "
            "storages; a view holds its whole base, a shared storage counts once), or declare the layout the engine has")


def _check_footprint(kv_engine, prompts, what: str) -> None:
    layout = kv_engine.ref.declaration.kv_layout
    if layout is None:
        pytest.skip(f"engine '{kv_engine.name}' declares kv_cache_bytes but no kv_layout: declare "
                    "Declaration(kv_layout=pytest_kvcompile.memory.KVLayout(...)) to check its footprint")
    new_tokens = kv_engine.max_new_tokens
    if new_tokens < 2:
        pytest.skip("the footprint is checked after at least one decode step; run with --kv-max-new-tokens >= 2")
    kv_engine.generate(prompts)
    got = _reported(kv_engine)
    spec = kv_engine.spec
    footprint_of = partial(expected_kv_bytes, config=spec.config, dtype=spec.dtype, rows=len(prompts),
                           width=max(map(len, prompts)), new_tokens=new_tokens)
    footprint = footprint_of(layout)
    if got != footprint.total:
        pytest.fail(
            f"engine '{kv_engine.name}' on model '{spec.name}', {what}, {new_tokens} new tokens: kv_cache_bytes() = "
            f"{format_bytes(got)} but its declared {layout} holds {format_bytes(footprint.total)} "
            f"({got - footprint.total:+,} B)\n{footprint.explain()}\n  hint: {_hint(footprint, got, footprint_of)}",
            pytrace=False,
        )


@pytest.mark.kv_requires("kv_cache_bytes")
def test_kv_cache_bytes(kv_engine, kv_prompt):
    _check_footprint(kv_engine, [kv_prompt], f"prompt '{kv_prompt.name}' alone")


@pytest.mark.kv_requires("kv_cache_bytes", "batching")
def test_kv_cache_bytes_batched(kv_engine, kv_batch):
    _check_footprint(kv_engine, kv_batch, f"a batch of lengths {[len(p) for p in kv_batch]}")


def _measures(kv_engine) -> dict[str, int]:
    """Memory after a call: bytes of tensors the garbage collector sees, CUDA bytes allocated (engines on CUDA),
    kv_cache_bytes() (engines declaring it)."""
    found = {"live tensor bytes": live_tensor_bytes()}
    if torch.device(kv_engine.spec.device).type == "cuda":
        torch.cuda.synchronize()
        found["CUDA bytes allocated"] = torch.cuda.memory_allocated()
    if kv_engine.ref.declaration.kv_cache_bytes:
        found["kv_cache_bytes()"] = _reported(kv_engine)
    return found


def test_no_memory_growth(kv_engine, kv_prompts, kv_batch, kv_record):
    """A leak grows memory at every repeated call; a one-off allocation (a lazily built buffer) grows once.
    Rule: after WARMUP_CALLS identical calls, a measure that grows at each of REPEATS more calls is a leak;
    kv_cache_bytes() must not change at all. Objects alive before the first call are frozen out of the
    census (gc.freeze()), which makes it cheap; tensors created since are what can grow."""
    call = kv_batch if kv_engine.ref.declaration.batching else [max(kv_prompts, key=len)]
    gc.collect()
    gc.freeze()
    try:
        for _ in range(WARMUP_CALLS):
            kv_engine.generate(call)
        history = [_measures(kv_engine)]
        for _ in range(REPEATS):
            kv_engine.generate(call)
            history.append(_measures(kv_engine))
    finally:
        gc.unfreeze()
    if "kv_cache_bytes()" in history[-1]:
        layout, spec = kv_engine.ref.declaration.kv_layout, kv_engine.spec
        expected = layout and expected_kv_bytes(layout, spec.config, spec.dtype, len(call), max(map(len, call)),
                                                kv_engine.max_new_tokens).total
        kv_record.metric(kv_bytes={"expected": expected, "measured": history[-1]["kv_cache_bytes()"]})
    described = f"generate(<{len(call)} prompt(s) of lengths {[len(p) for p in call]}>, {kv_engine.max_new_tokens})"
    problems = []
    for measure in history[0]:
        values = [h[measure] for h in history]
        steps = [b - a for a, b in zip(values, values[1:])]
        if all(s > 0 for s in steps) or (measure == "kv_cache_bytes()" and any(steps)):
            problems.append(f"  {measure}: {format_bytes(values[0])} after {WARMUP_CALLS} warmup call(s), then "
                            f"{', '.join(f'{s:+,} B' for s in steps)} per call")
    if problems:
        pytest.fail(
            f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': memory grows over {REPEATS} repeated "
            f"identical calls {described}\n" + "\n".join(problems) + "\n  hint: generate() keeps something per call "
            "(caches or outputs appended to a list, a memo keyed by prompt, a cache never reset): keep only the last "
            "call's cache",
            pytrace=False,
        )
