"""KV memory, reported and measured.

- ``kv_cache_bytes()`` equals the exact footprint of the engine's declared ``KVLayout``
  (pytest_kvcompile/memory/measure.py: dynamic, static, eviction budget; sliding and KV-sharing layers), alone and in
  a padded batch.
- What the engine object really holds after ``generate()`` (``memory.held_by``: tensors reachable from it that are
  not its weights; on CUDA also the growth of ``torch.cuda.memory_allocated`` while it was built and during its
  calls, so graph pools and workspaces held only from C++ count) is at most
  HELD_FACTOR x what it reports and what its layout declares, plus HELD_SLACK for small buffers (RoPE tables,
  masks, positions): an engine holding 16x what it reports fails with both numbers.
- An engine declaring ``kv_released`` (each call's cache dropped when ``generate()`` returns) holds at most
  HELD_SLACK besides its weights after a call: a cache still referenced (kept on the model, as transformers
  5.13-5.14's ``model._cache``, #47731) fails.
- Calls of the same shapes with different prompts do not grow memory (a leak, a memo keyed by prompt); a declared
  ``PrefixCache`` grows up to its capacity and then stops, measured."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from pytest_kvcompile.contract.engine import KVLayout
from pytest_kvcompile.memory.measure import (
    StateSizesUnknown,
    expected_kv_bytes,
    format_bytes,
)
from pytest_kvcompile.models.checkpoints import OwnConfig
from pytest_kvcompile.models.layers import LatentLayer, StateLayer, expanded
from pytest_kvcompile.models.prompts import variant
from pytest_kvcompile.verdicts.failures import Kind, fail
from pytest_kvcompile.verdicts.rows import KVBytes, LayerBytes

WARMUP_CALLS, REPEATS = 1, 3
MAX_CALLS = 96  # calls to offer a declared PrefixCache PREFIX_OFFERED x its capacity
PREFIX_OFFERED = 2  # distinct prompt positions offered to a declared PrefixCache, in capacities, before it must plateau
HELD_FACTOR, HELD_SLACK = 1.5, 64 * 1024

#: A declared KVLayout's footprint is computed from a transformers config (layers, KV heads, head_dim, windows).
OWN_MODEL = ("model '{}' is not a transformers checkpoint (its config.json is the engine's own): the footprint of a "
             "declared kv_layout cannot be computed from it, so it is not checked")


def _reported(kv_engine) -> int:
    got = kv_engine.engine.kv_cache_bytes()
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        fail(Kind.MEMORY, f"engine '{kv_engine.name}': kv_cache_bytes() returned {got!r}; it must return an int "
             ">= 0 (bytes held by the KV cache after the last generate())")
    return got


def _hint(footprint, got: int, footprint_of, config) -> str:
    """What a wrong count most likely means (footprint_of: layout -> Footprint of the same call; `config` the
    model's, for the layers' cache kinds)."""
    other_offset = dataclasses.replace(footprint.layout, window_offset=-1 - footprint.layout.window_offset)
    other = footprint_of(other_offset)
    if got == other.total != footprint.total:
        held, declared = (("W-1", "W") if other_offset.window_offset else ("W", "W-1"))
        return (f"the count matches {other_offset}, sliding layers holding {held} positions, not {declared}. A W-1 "
                "view of a W-position buffer (transformers' dynamic sliding layer) holds W: count storages with "
                "pytest_kvcompile.memory.measure.held_bytes, not tensor.nbytes; if the engine really holds "
                f"{held}, declare {other_offset}")
    written = footprint.width + footprint.new_tokens - 1
    unbounded = sum(footprint.bytes(dataclasses.replace(t, positions=written) if t.kind == "sliding" else t)
                    for t in footprint.layers)
    if footprint.layout.allocation == "dynamic" and got == unbounded != footprint.total:
        return (f"the count matches sliding layers holding all T={written} positions: the engine keeps keys that "
                "left the window (masked, never read again); drop them to bound memory by the window")
    if footprint.layout.allocation == "static":
        for positions in (written, written + 1):
            if got == footprint_of(
                    dataclasses.replace(footprint.layout, max_cache_len=positions)).total != footprint.total:
                return (f"the count matches a static cache of {positions} positions, the prompt plus the new tokens, "
                        f"not the declared max_cache_len={footprint.layout.max_cache_len}: the engine's cache length "
                        "setting was ignored (transformers < 5.13 ignored generate()'s cache_config={'max_cache_len': "
                        "...} on the static path, #46424), and every new length re-sizes the cache")
    caches = [t.cache for t in footprint.layers]
    wide = dataclasses.replace(footprint, layers=tuple(dataclasses.replace(t, cache=expanded(t.cache, config))
                                                       for t in footprint.layers))
    if got == wide.total != footprint.total:
        if any(isinstance(c, LatentLayer) for c in caches):
            return ("the count matches K and V per head, the latent up-projected (kv_b_proj) before it was cached: "
                    "multi-head latent attention caches the compressed latent and the shared RoPE key "
                    f"({caches[0].shape} per position), which is its memory saving; cache those and up-project (or "
                    "absorb the projection into the query and output) when attending")
        return ("the count matches K and V repeated for every query head (num_attention_heads instead of "
                "num_key_value_heads): a grouped-query cache holds each KV head once; repeat at attention time")
    state_hint = _state_hint(footprint, got, footprint_of)
    if state_hint:
        return state_hint
    if 2 * got == footprint.total:
        return "the count is exactly half the footprint: are keys or values left out?"
    if footprint.rows > 1 and got * footprint.rows == footprint.total:
        return "the count is one row's: a batch cache holds one row per prompt"
    return ("count what is held, pytest_kvcompile.memory.measure.held_bytes(tensors) "
            "(untyped_storage().nbytes() of distinct "
            "storages; a view holds its whole base, a shared storage counts once), "
            "or declare the layout the engine has")


def _state_hint(footprint, got: int, footprint_of) -> str | None:
    """What a wrong count on a model with recurrent layers most likely means, None if none of these."""
    states = [t for t in footprint.layers if isinstance(t.cache, StateLayer)]
    if not states:
        return None
    layers = ", ".join(str(t.layer) for t in states)
    if got == footprint.total - sum(footprint.bytes(t, 0) for t in states):
        return (f"the count matches the attention layers alone: the recurrent layers' states (layers {layers}: "
                f"{states[0].fixed_why} per row) were not counted; count a state layer's conv and recurrent states "
                "(transformers' LinearAttentionLayer.conv_states and .recurrent_states: "
                "pytest_kvcompile.memory.measure.cache_tensors does)")
    written = footprint.width + footprint.new_tokens - 1
    grown = footprint.total + sum(footprint.state_rows * t.conv_input
                                  * (written - t.cache.state.conv_kernel - footprint.layout.conv_window_offset)
                                  for t in states)
    if got == grown != footprint.total:
        return (f"the count matches conv windows holding all T={written} inputs, not the conv's kernel: a recurrent "
                "layer's state grows with the sequence (transformers' activate_past_recording() keeps every input "
                "until crop() is called): keep the last kernel inputs only, so the state stays one size per sequence")
    for dtype in ("bfloat16", "float32"):
        other = dataclasses.replace(footprint.layout, state_dtype=dtype)
        if other != footprint.layout and got == footprint_of(other).total != footprint.total:
            return (f"the count matches recurrent states stored as {dtype}, not as declared: if the engine stores its "
                    f"states so, declare {other} (a state stored lower is a declared capability)")
    return None


def kv_stored(kv_engine):
    """The dtype the engine's KV cache stores: Declaration.kv_cache_dtype when a float one, else the model's; None for
    a quantized one (int8/int4/int2: the model's dtype bounds what it holds)."""
    declared = kv_engine.ref.declaration.kv_cache_dtype
    if declared is None:
        return kv_engine.spec.dtype
    return getattr(torch, declared) if declared.startswith(("float", "bfloat")) else None


def _check_footprint(kv_engine, prompts, what: str) -> None:
    layout = kv_engine.ref.declaration.kv_layout
    if layout is None:
        pytest.skip(f"engine '{kv_engine.name}' declares kv_cache_bytes but no kv_layout: declare "
                    "Declaration(kv_layout=pytest_kvcompile.KVLayout(...)) to check its footprint")
    new_tokens = kv_engine.max_new_tokens
    if new_tokens < 2:
        pytest.skip("the footprint is checked after at least one decode step; run with --kv-max-new-tokens >= 2")
    if isinstance(kv_engine.spec.config, OwnConfig):
        pytest.skip(OWN_MODEL.format(kv_engine.spec.name))
    if kv_stored(kv_engine) is None:
        pytest.skip(f"engine '{kv_engine.name}' stores K and V as {kv_engine.ref.declaration.kv_cache_dtype} "
                    "(Declaration.kv_cache_dtype): a quantized cache's scales and zero points have no declared "
                    "layout, so its exact footprint cannot be computed (test_memory_held still bounds what it holds)")
    kv_engine.generate(prompts)
    got = _reported(kv_engine)
    spec = kv_engine.spec
    footprint_of = partial(expected_kv_bytes, config=spec.config, dtype=kv_stored(kv_engine), rows=len(prompts),
                           width=max(map(len, prompts)), new_tokens=new_tokens, model_dtype=spec.dtype)
    try:
        footprint = footprint_of(layout)
    except StateSizesUnknown as exc:
        pytest.skip(f"model '{spec.name}': {exc}, so its footprint is not computed and kv_cache_bytes() is not checked "
                    "(test_memory_held still bounds what the engine holds by what it reports)")
    if got != footprint.total:
        fail(
            Kind.MEMORY,
            f"engine '{kv_engine.name}' on model '{spec.name}', {what}, {new_tokens} new tokens: kv_cache_bytes() = "
            f"{format_bytes(got)} but its declared {layout} holds {format_bytes(footprint.total)} "
            f"({got - footprint.total:+,} B)\n{footprint.explain()}\n"
            f"  hint: {_hint(footprint, got, footprint_of, spec.config)}",
        )


@pytest.mark.kv_requires("kv_cache_bytes")
def test_kv_cache_bytes(kv_engine, kv_prompt):
    _check_footprint(kv_engine, [kv_prompt], f"prompt '{kv_prompt.name}' alone")


@pytest.mark.kv_requires("kv_cache_bytes", "batching")
def test_kv_cache_bytes_batched(kv_engine, kv_batch):
    _check_footprint(kv_engine, kv_batch, f"a batch of lengths {[len(p) for p in kv_batch]}")


def _measures(kv_engine, census) -> dict[str, int]:
    """Memory after a call: bytes of tensors the garbage collector sees (in the engine's process), CUDA bytes
    allocated (in-process engines on CUDA), kv_cache_bytes() (engines declaring it)."""
    found = {"live tensor bytes": census()}
    if torch.device(kv_engine.spec.device).type == "cuda" and kv_engine.host.cuda_here:
        torch.cuda.synchronize()
        found["CUDA bytes allocated"] = torch.cuda.memory_allocated()
    if kv_engine.ref.declaration.kv_cache_bytes:
        found["kv_cache_bytes()"] = _reported(kv_engine)
    return found


def _call(kv_engine, kv_prompts, kv_batch):
    return kv_batch if kv_engine.ref.declaration.batching else [max((p for p in kv_prompts if len(p) <= 64), key=len)]


def test_memory_held_matches_reported(kv_engine, kv_prompts, kv_batch, kv_record):
    """The engine object's measured state after generate() against what it reports and declares (module rule)."""
    call = _call(kv_engine, kv_prompts, kv_batch)
    kv_engine.generate(call)
    held = kv_engine.held()
    state, measure = held.state, "tensors reachable from the engine object that are not parameters (pytest_kvcompile." \
                                 "memory.held_by), distinct storages"
    if kv_engine.cuda_grown is not None:  # allocations held only from C++ (graph pools, workspaces) count too
        grown = kv_engine.cuda_grown - held.weights
        if grown > state:
            state, measure = grown, ("growth of torch.cuda.memory_allocated() while the engine was built and during "
                                     "its generate() calls, minus its parameters")
    held = dataclasses.replace(held, state=state)
    declared, spec = kv_engine.ref.declaration, kv_engine.spec
    if declared.kv_layout and isinstance(spec.config, OwnConfig):
        pytest.skip(OWN_MODEL.format(spec.name))
    try:
        footprint = declared.kv_layout and expected_kv_bytes(declared.kv_layout, spec.config,
                                                             kv_stored(kv_engine) or spec.dtype, len(call),
                                                             max(map(len, call)), kv_engine.max_new_tokens, spec.dtype)
    except StateSizesUnknown:  # (test_kv_cache_bytes names it) bounded by what it reports alone
        footprint = None
    expected = footprint and footprint.total
    reported = _reported(kv_engine) if declared.kv_cache_bytes else None
    layers = [LayerBytes(t.layer, t.kind, t.positions, t.fixed_why or t.why,
                         footprint.bytes(t)) for t in footprint.layers] if footprint else []
    kv_record.metric(kv_bytes=KVBytes(expected,
                                      reported if reported is not None else held.state, held.state,
                                      str(declared.kv_layout or ""), layers, _describe(call, kv_engine)))
    claims = {f"kv_cache_bytes() = {format_bytes(reported)}": reported} if reported is not None else {}
    if expected:
        claims[f"its declared {declared.kv_layout} = {format_bytes(expected)}"] = expected
    if declared.kv_released:  # the cache was the call's own: nothing of it may outlive the call
        claims = {"0 B of cache (it declares kv_released: every call's cache is dropped when generate() returns)": 0}
    if held.state == 0 and held.weights == 0 and not declared.kv_released:
        pytest.skip(f"engine '{kv_engine.name}' holds no tensor visible from Python after "
                    f"{_describe(call, kv_engine)}, "
                    "not even its weights: its model and cache live in native memory (a C/C++ runtime), which this "
                    "check cannot see, so nothing was measured (recorded in the reports)")
    if not claims:
        pytest.skip(f"engine '{kv_engine.name}' holds {format_bytes(held.state)} besides its weights after "
                    f"{_describe(call, kv_engine)}, but declares neither kv_cache_bytes nor a kv_layout to compare "
                    "it with (recorded in the reports)")
    over = {what: value for what, value in claims.items() if held.state > HELD_FACTOR * value + HELD_SLACK}
    if over:
        fail(
            Kind.MEMORY,
            f"engine '{kv_engine.name}' on model '{spec.name}' holds {format_bytes(held.state)} besides its weights "
            f"({format_bytes(held.weights)}) after {_describe(call, kv_engine)}, more than {HELD_FACTOR:g} x "
            + " and ".join(over) + f" + {format_bytes(HELD_SLACK)}\n"
            f"  measured: {measure}\n  hint: "
            + ("the call's cache is still referenced after generate() returned (kept on the engine or its model, as "
               "transformers 5.13-5.14 kept model._cache: #47731); drop it, or do not declare kv_released"
               if declared.kv_released else
               "a cache preallocated larger than it reports (a static cache sized for more rows or positions), "
               "earlier calls' caches kept, or a report that counts only part of the cache"),
        )


def _describe(call, kv_engine) -> str:
    return f"generate(<{len(call)} prompt(s) of lengths {[len(p) for p in call]}>, {kv_engine.max_new_tokens})"


def _prefix_bound(kv_engine) -> tuple[int, str]:
    """What a declared PrefixCache may grow by in all: its capacity_bytes, else HELD_FACTOR x the K/V of its
    capacity_tokens positions, and on a model with recurrent layers a state snapshot per block of them (per position
    without a block size) (+ HELD_SLACK), and how that was reached."""
    declared, spec = kv_engine.ref.declaration.prefix_cache, kv_engine.spec
    if declared.capacity_bytes is not None:
        return declared.capacity_bytes, f"its declared capacity_bytes={declared.capacity_bytes:,}"
    if isinstance(spec.config, OwnConfig):
        pytest.skip(OWN_MODEL.format(spec.name).replace("a declared kv_layout", "declared capacity_tokens") +
                    ": declare PrefixCache(capacity_bytes=...) too")
    snapshots = -(-declared.capacity_tokens // (declared.block_size or 1))
    try:
        layout = KVLayout("dynamic", windowed=False, state_slots=snapshots)
        footprint = expected_kv_bytes(layout, spec.config, kv_stored(kv_engine) or spec.dtype, 1,
                                      declared.capacity_tokens, 1 + 1, spec.dtype)
    except StateSizesUnknown as exc:
        pytest.skip(f"model '{spec.name}': {exc}: the bound of a declared capacity_tokens is not computed; declare "
                    "PrefixCache(capacity_bytes=...) too")
    states = f" and {snapshots} state snapshots" if any(isinstance(t.cache, StateLayer) for t in footprint.layers) \
        else ""
    return (int(HELD_FACTOR * footprint.total) + HELD_SLACK,
            f"{HELD_FACTOR:g} x the K/V of its declared capacity_tokens={declared.capacity_tokens}{states} "
            f"({format_bytes(footprint.total)}) + {format_bytes(HELD_SLACK)}")


def test_no_memory_growth(kv_engine, kv_prompts, kv_batch, kv_record):
    """A leak grows memory at every call; a one-off allocation (a lazily built buffer) grows once. Rule: after
    WARMUP_CALLS calls, a measure that grows at each of REPEATS more calls of the same shapes, each with other
    prompts (a memo keyed by prompt grows too), is a leak; kv_cache_bytes() must not change at all. Objects alive
    before the first call are frozen out of the census (gc.freeze()), which makes it cheap; tensors created since
    are what can grow.

    A declared `PrefixCache` grows by design: the calls go on until they have offered PREFIX_OFFERED x its
    capacity_tokens of distinct prompt positions alone (at most MAX_CALLS calls; a cache may keep prompts only, so
    generated positions do not count), and then it must have stopped growing (a plateau over the REPEATS calls after
    that) and never hold more than its capacity allows (`_prefix_bound`), kv_cache_bytes() included."""
    if not kv_engine.ref.declaration.kv_cache_bytes and kv_engine.held().weights == 0:
        pytest.skip(f"engine '{kv_engine.name}' holds no tensor visible from Python, not even its weights, and reports "
                    "no kv_cache_bytes(): its memory is native (a C/C++ runtime), which this census cannot see")
    base = _call(kv_engine, kv_prompts, kv_batch)
    prefix = kv_engine.ref.declaration.prefix_cache
    offered = sum(len(p) for p in base)  # distinct prompt positions one call offers (a cache may keep prompts only)
    fill = -(-PREFIX_OFFERED * prefix.capacity_tokens // offered) if prefix else 0
    if WARMUP_CALLS + fill + REPEATS > MAX_CALLS:
        pytest.skip(f"engine '{kv_engine.name}' declares {prefix}: offering {PREFIX_OFFERED} x its capacity takes "
                    f"{fill} calls of {offered} prompt positions, more than {MAX_CALLS}: build the engine with a "
                    "smaller cache for the suite")
    vocab = kv_engine.spec.vocab_size
    calls = [[variant(p, vocab, salt=100 + i) for p in base] for i in range(WARMUP_CALLS + fill + REPEATS)]
    call = base
    with kv_engine.tensor_census() as census:
        for call in calls[:WARMUP_CALLS]:
            kv_engine.generate(call)
        history = [_measures(kv_engine, census)]
        for call in calls[WARMUP_CALLS:]:
            kv_engine.generate(call)
            history.append(_measures(kv_engine, census))
    described = f"{_describe(call, kv_engine)}, each call with other prompts of these lengths"
    problems = []
    for measure in history[0]:
        values = [h[measure] for h in history]
        steps = [b - a for a, b in zip(values, values[1:])]
        if all(s > 0 for s in steps[-REPEATS:]) or (measure == "kv_cache_bytes()" and not prefix and any(steps)):
            problems.append(f"  {measure}: {format_bytes(values[0])} after {WARMUP_CALLS} warmup call(s), then "
                            f"{', '.join(f'{s:+,} B' for s in steps[-REPEATS:])} per call"
                            + (f" (the last {REPEATS} of {len(steps)}, after {fill * offered:,} distinct prompt "
                               f"positions offered, {PREFIX_OFFERED} x its capacity_tokens)" if prefix else ""))
    if prefix:
        bound, why = _prefix_bound(kv_engine)
        problems += [f"  {measure}: {format_bytes(peak)} at its peak, over the {format_bytes(bound)} it may hold "
                     f"({why})" for measure in history[0] if (peak := max(h[measure] for h in history)) > bound]
    if problems:
        what = (f"grows past its declared {prefix} over {len(calls)} calls {described}" if prefix else
                f"memory grows over {REPEATS} repeated calls {described}")
        fail(
            Kind.MEMORY,
            f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': {what}\n" + "\n".join(problems) +
            ("\n  hint: a bounded cache must evict once full (least recently used blocks, oldest prompts) and hold no "
             "more than its capacity; or declare the capacity it really has" if prefix else
             "\n  hint: generate() keeps something per call (caches or outputs appended to a list, a memo keyed by "
             "prompt, a cache never reset): keep only the last call's cache; a prefix cache kept across calls on "
             "purpose declares Declaration(prefix_cache=PrefixCache(capacity_tokens=N))"),
        )
