"""KV-cache memory: what a cache really holds, and what it should hold.

- `held_bytes(tensors)`: bytes of the distinct storages behind some tensors. Not ``nbytes``:
  a view holds its whole base storage (transformers' dynamic sliding-window layer keeps a ``W-1``
  view of a ``W``-position buffer, so it holds W/(W-1) times its ``nbytes``: tests/test_memory.py),
  two tensors sharing a storage hold it once, and a lazily allocated cache (transformers'
  ``StaticCache`` before its first forward: keys ``None``) holds nothing.
- `expected_kv_bytes(layout, config, ...)`: the exact bytes a `KVLayout` (contract/engine.py, declared as
  ``Declaration(kv_cache_bytes=True, kv_layout=KVLayout(...))``) holds at the end of ``generate()``, with the
  formula's terms per layer (`Footprint`).
- `live_tensor_bytes()`: every tensor the garbage collector can see (the leak check's census).
- `held_by(engine)`: what an engine object really holds beyond its weights (the memory cross-check).
"""

from __future__ import annotations

import functools
import gc
import types
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pytest_kvcompile.contract.engine import KVLayout
from pytest_kvcompile.memory.units import format_bytes
from pytest_kvcompile.models.layers import LayerCache, StateLayer, layer_caches
from pytest_kvcompile.models.states import KNOWN


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`: ``untyped_storage().nbytes()`` once per storage.

    ``None`` (a layer not allocated yet, a KV-sharing layer) and meta tensors hold 0 bytes.
    """
    storages: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def cache_tensors(cache: Any) -> list[torch.Tensor | None]:
    """The tensors of every layer of a transformers ``Cache`` (``None`` where unallocated): keys and values, and a
    recurrent layer's conv and recurrent states (``LinearAttentionLayer``: 5.24 on); its ``layers`` (4.56 on), else
    its ``key_cache``/``value_cache`` lists (4.x)."""
    if not hasattr(cache, "layers") and hasattr(cache, "key_cache"):
        return [t for pair in zip(cache.key_cache, cache.value_cache) for t in pair]
    found: list[torch.Tensor | None] = []
    for layer in getattr(cache, "layers", ()):
        found += [getattr(layer, name, None) for name in ("keys", "values")]
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            found += list(states.values()) if isinstance(states, dict) else []
    return found


def live_tensor_bytes() -> int:
    """`held_bytes` of every tensor the garbage collector tracks, after a collection.

    Sees tensors held from Python (lists, attributes, closures, caches of transformers objects);
    misses tensors held only from C++ (a compiled graph's constants, an autograd graph). Objects
    moved to the permanent generation by ``gc.freeze()`` are not listed: freeze first to count only
    tensors created since (and make each census take microseconds instead of a full collection).
    """
    gc.collect()
    # Exact types: subclasses include dynamo's FakeTensors, which have no storage to measure.
    return held_bytes(obj for obj in gc.get_objects() if type(obj) in (torch.Tensor, torch.nn.Parameter))


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), types.ModuleType, type, types.CodeType,
           types.BuiltinFunctionType, torch.dtype, torch.device)


def _referents(obj: Any) -> Iterable[Any]:
    """What `obj` holds for `held_by`: containers' items, instance and module attributes, closures and bound
    methods; never a function's globals, a module or a class (they reach the whole process)."""
    if isinstance(obj, dict):
        return obj.values()
    if isinstance(obj, (list, tuple, set, frozenset, deque)):
        return obj
    if isinstance(obj, types.MethodType):
        return (obj.__self__, obj.__func__)
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
    if isinstance(obj, functools.partial):
        return (obj.func, *obj.args, *obj.keywords.values())
    found = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                found.append(getattr(obj, name))
    return found


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Held:
    """What an object graph holds in tensors: `weights` (parameters, and any tensor sharing their storage) and
    `state` (every other tensor: KV cache, buffers, masks, anything kept between calls), distinct storages."""

    weights: int
    state: int
    tensors: int


def held_by(root: Any, limit: int = 500_000) -> Held:
    """Bytes of the tensors reachable from `root` (see `_referents`), split into parameters and the rest.

    The engine-side measurement behind the memory cross-check (suites/test_kv_memory.py): `state` is what an
    engine keeps besides its weights, to compare with what it reports (`kv_cache_bytes()`) and declares
    (`KVLayout`). Tensors held only from C++ (a compiled graph's constants, a native runtime's cache) are not seen.
    At most `limit` objects are visited."""
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    todo = [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            (params if isinstance(obj, torch.nn.Parameter) else other).append(obj)
            continue
        try:
            todo.extend(_referents(obj))
        except Exception:  # an exotic object that refuses introspection holds nothing we can see
            continue
    weight_keys = {(t.device, t.untyped_storage().data_ptr()) for t in params if t.device.type != "meta"}
    state = [t for t in other
             if t.device.type == "meta" or (t.device, t.untyped_storage().data_ptr()) not in weight_keys]
    return Held(held_bytes(params), held_bytes(state), len(params) + len(other))


class StateSizesUnknown(ValueError):
    """A recurrent layer whose state's sizes no reader of models/states.py finds in the config; str: which and why."""


@dataclass(frozen=True)
class LayerTerm:
    """One layer's share of the footprint: its cache kind (models/layers.py) and the positions it holds; a recurrent
    layer's state adds `fixed` bytes per row whatever the length (`fixed_why`: its terms)."""

    cache: LayerCache
    positions: int
    why: str
    fixed: int = 0
    fixed_why: str = ""
    conv_input: int = 0  # a recurrent layer's bytes per conv input and row (its channels in the model's dtype)

    @property
    def layer(self) -> int:
        return self.cache.layer

    @property
    def kind(self) -> str:  # "full", "sliding", "latent", "shared", "state", "state+kv", "none"
        return self.cache.kind

    def bytes(self, rows: int, itemsize: int, state_rows: int | None = None) -> int:
        """Bytes over `rows` rows of K/V and `state_rows` states (None: `rows`: one per row)."""
        return rows * self.positions * self.cache.values * itemsize + (state_rows or rows) * self.fixed


@dataclass(frozen=True)
class Footprint:
    """Expected KV bytes and the terms that make them up."""

    layout: KVLayout
    rows: int
    width: int
    new_tokens: int
    itemsize: int
    layers: tuple[LayerTerm, ...]

    @property
    def state_rows(self) -> int:
        """The states a recurrent layer holds: `KVLayout.state_slots`, else one per row."""
        return self.layout.state_slots or self.rows

    def bytes(self, term: LayerTerm, itemsize: int | None = None) -> int:
        """`term`'s bytes over this footprint's rows and states (`itemsize` None: the footprint's)."""
        return term.bytes(self.rows, self.itemsize if itemsize is None else itemsize, self.state_rows)

    @property
    def total(self) -> int:
        return sum(self.bytes(t) for t in self.layers)

    def explain(self) -> str:
        """The formula with its terms, one line per layer."""
        lines = [f"{self.layout}, T = width {self.width} + new_tokens {self.new_tokens} - 1 = "
                 f"{self.width + self.new_tokens - 1}; "
                 f"bytes = rows x positions x values per position (the layer's kind) x dtype bytes"]
        for t in self.layers:
            if t.fixed:
                kv = (f"{t.positions} [{t.why}] x {t.cache.kv.shape} x {self.itemsize} + "
                      if isinstance(t.cache, StateLayer) and t.cache.kv else "")
                if self.state_rows == self.rows:
                    lines.append(f"  layer {t.layer} ({t.kind}): {self.rows} x ({kv}{t.fixed_why}) = "
                                 f"{self.bytes(t)} (per row whatever the length)")
                else:
                    kv = f"{self.rows} x {kv.removesuffix(' + ')} + " if kv else ""
                    lines.append(f"  layer {t.layer} ({t.kind}): {kv}{self.state_rows} state slots x ({t.fixed_why}) "
                                 f"= {self.bytes(t)} (whatever the batch and length)")
            elif not t.cache.values:
                lines.append(f"  layer {t.layer} ({t.kind}): {t.cache.shape}")
            else:
                lines.append(f"  layer {t.layer} ({t.kind}): {self.rows} x {t.positions} [{t.why}] x {t.cache.shape} "
                             f"x {self.itemsize} = {self.bytes(t)}")
        lines.append(f"  total: {self.total}")
        return "\n".join(lines)


def state_term(cache: StateLayer, layout: KVLayout, model_dtype: torch.dtype) -> tuple[int, str, int]:
    """Bytes per row a recurrent layer's state holds under `layout` (its conv window in `model_dtype`, its recurrent
    state in the layout's or the model reference's dtype: KVLayout), the terms, and the bytes of one conv input."""
    state = cache.state
    if state is None:
        raise StateSizesUnknown(
            f"layer {cache.layer} is a recurrent layer (layer type {cache.layer_type!r}) whose state's sizes are not "
            f"in config fields the suite reads (known: {KNOWN})")
    conv = state.conv_kernel + layout.conv_window_offset
    state_dtype = getattr(torch, layout.state_dtype or state.state_dtype)
    size = state.state_values * state_dtype.itemsize
    why = (f"conv {state.conv_channels} channels x {conv} inputs [K{layout.conv_window_offset or ''}={conv}] x "
           f"{model_dtype.itemsize} + {state.family} state {' x '.join(map(str, state.state_shape))} x "
           f"{state_dtype.itemsize} ({str(state_dtype).removeprefix('torch.')})")
    conv_input = state.conv_channels * model_dtype.itemsize
    return conv_input * conv + size, why, conv_input


def expected_kv_bytes(layout: KVLayout, config: Any, dtype: torch.dtype, rows: int, width: int,
                      new_tokens: int, model_dtype: torch.dtype | None = None) -> Footprint:
    """The footprint `layout` holds after ``generate(<rows prompts, longest `width`>, new_tokens)`` on `config`
    (``layout.rows`` rows where it fixes them), each layer by its cache kind (models/layers.py): K/V stored in `dtype`,
    a recurrent layer's conv window in `model_dtype` (None: `dtype`). Raises StateSizesUnknown for a recurrent layer
    whose sizes the config does not give in fields the suite reads."""
    if new_tokens < 2:
        raise ValueError(f"expected_kv_bytes needs new_tokens >= 2 (at least one decode step), got {new_tokens}")
    written = width + new_tokens - 1
    terms = []
    for cache in layer_caches(config):
        positions, why = layout.positions(written, cache.window) if cache.values else (0, "no K/V per position")
        fixed, fixed_why, conv_input = state_term(cache, layout, model_dtype or dtype) \
            if isinstance(cache, StateLayer) else (0, "", 0)
        terms.append(LayerTerm(cache, positions, why, fixed, fixed_why, conv_input))
    return Footprint(layout, layout.rows or rows, width, new_tokens, dtype.itemsize, tuple(terms))


def available_bytes(device: str) -> int | None:
    """Memory a new allocation on `device` can still get: a CUDA device's free memory plus what torch's allocator
    has reserved but not allocated; the host's ``MemAvailable`` (Linux) for the CPU; None where unknown."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as info:
            return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


__all__ = [
    "Footprint",
    "Held",
    "LayerTerm",
    "StateSizesUnknown",
    "available_bytes",
    "cache_tensors",
    "expected_kv_bytes",
    "format_bytes",
    "held_by",
    "held_bytes",
    "live_tensor_bytes",
]

