"""KV-cache memory: what a cache really holds, and what it should hold.

- `held_bytes(tensors)`: bytes of the distinct storages behind some tensors. Not ``nbytes``:
  a view holds its whole base storage (transformers' dynamic sliding-window layer keeps a ``W-1``
  view of a ``W``-position buffer, so it holds W/(W-1) times its ``nbytes``: tests/test_memory.py),
  two tensors sharing a storage hold it once, and a lazily allocated cache (transformers'
  ``StaticCache`` before its first forward: keys ``None``) holds nothing.
- `KVLayout`: how an engine's cache stores positions, declared as
  ``Declaration(kv_cache_bytes=True, kv_layout=KVLayout(...))``.
- `expected_kv_bytes(layout, config, ...)`: the exact bytes that layout holds at the end of
  ``generate()``, with the formula's terms per layer (`Footprint`).
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

from pytest_kvcompile.memory.units import format_bytes
from pytest_kvcompile.models.zoo import shared_kv_layers, sliding_layers

KINDS = ("dynamic", "static", "budget")


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
    """The key and value tensors of every layer of a transformers ``Cache`` (``None`` where unallocated)."""
    return [getattr(layer, name, None) for layer in getattr(cache, "layers", ()) for name in ("keys", "values")]


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
        cell.cell_contents
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
    state = [t for t in other if t.device.type == "meta" or (t.device, t.untyped_storage().data_ptr()) not in weight_keys]
    return Held(held_bytes(params), held_bytes(state), len(params) + len(other))


@dataclass(frozen=True)
class KVLayout:
    """How an engine's KV cache stores positions, so its footprint can be computed exactly.

    T = positions written by ``generate(prompts, new_tokens)`` = prompt width + new_tokens - 1: the
    width is the longest prompt (a batch is one padded cache of one row per prompt) and the last
    generated token is never fed back. W = the model's ``sliding_window``. Per layer with its own KV
    (KV-sharing layers hold none), each of K and V holds ``rows x kv_heads x head_dim`` values per position:

    ============  ==========================  =====================================================
    kind          full-attention layer        sliding-window layer (S = W + window_offset)
    ============  ==========================  =====================================================
    ``dynamic``   T (grows by concatenation)  min(T, S)
    ``static``    max_cache_len (allocated)   min(max_cache_len, S)
    ``budget``    min(T, budget) (eviction)   min(T, budget, S)
    ============  ==========================  =====================================================

    `rows`: rows the cache allocates whatever the batch (a static cache padded to a max batch size);
    None: one row per prompt.

    `windowed=False`: sliding layers keep every position like full layers (keys that left the window are
    masked, never read again, but held). `extra_positions`: positions a growing (dynamic or budget) layer holds
    beyond T, e.g. one pad key kept so the cache is never empty.

    `window_offset`: what a sliding layer really holds, relative to W. transformers' dynamic sliding
    layer keeps W-1 positions as a view of the W-position concatenation of the last step, so it
    *holds* W (offset 0); its static sliding layer allocates W (offset 0). An engine copying out the
    last W-1 positions declares -1. The formulas hold after a ``generate()`` that ran at least one
    decode step (new_tokens >= 2): after prefill alone transformers' dynamic sliding layer still holds
    the whole prompt (its W-1 kept positions are a view of the prefill's keys).
    """

    kind: str = "dynamic"
    max_cache_len: int | None = None
    budget: int | None = None
    window_offset: int = 0
    rows: int | None = None
    windowed: bool = True
    extra_positions: int = 0

    def __post_init__(self) -> None:
        usage = ('KVLayout("dynamic"), KVLayout("static", max_cache_len=N) or KVLayout("budget", budget=N), '
                 "optionally with window_offset=-1 (sliding layers hold W-1 positions) or 0 (W) and rows=N "
                 "(rows allocated whatever the batch)")
        if self.kind not in KINDS:
            raise ValueError(f"KVLayout kind {self.kind!r} is unknown; write {usage}")
        for name, needed in (("max_cache_len", "static"), ("budget", "budget"), ("rows", None)):
            value = getattr(self, name)
            if needed and (self.kind == needed) != (value is not None):
                raise ValueError(f"{self}: {name} is required for kind {needed!r} and only there; write {usage}")
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{self}: {name} must be an int >= 1, got {value!r}")
        if type(self.window_offset) is not int or self.window_offset not in (-1, 0):
            raise ValueError(f"{self}: window_offset must be -1 (W-1 positions) or 0 (W), got {self.window_offset!r}")
        if type(self.windowed) is not bool:
            raise ValueError(f"{self}: windowed must be True or False, got {self.windowed!r}")
        if type(self.extra_positions) is not int or self.extra_positions < 0:
            raise ValueError(f"{self}: extra_positions must be an int >= 0, got {self.extra_positions!r}")

    def __str__(self) -> str:
        params = [f"{n}={getattr(self, n)}" for n in ("max_cache_len", "budget", "rows") if getattr(self, n) is not None]
        params += [f"window_offset={self.window_offset}"] if self.window_offset else []
        params += ["windowed=False"] if not self.windowed else []
        params += [f"extra_positions={self.extra_positions}"] if self.extra_positions else []
        return f"KVLayout({', '.join([repr(self.kind), *params])})"

    def positions(self, written: int, window: int | None) -> tuple[int, str]:
        """Positions one layer holds after `written` positions (window: None for full attention), and why."""
        if self.kind == "static":
            bounds = [(self.max_cache_len, f"max_cache_len={self.max_cache_len}")]
        else:
            extra = self.extra_positions
            bounds = [(written + extra, f"T+{extra}={written + extra}" if extra else f"T={written}")]
            bounds += [(self.budget, f"budget={self.budget}")] if self.budget else []
        if window is not None and self.windowed:
            slots = window + self.window_offset
            bounds.append((slots, f"W-1={slots}" if self.window_offset else f"W={slots}"))
        held = min(value for value, _ in bounds)
        return held, bounds[0][1] if len(bounds) == 1 else f"min({', '.join(term for _, term in bounds)})"


@dataclass(frozen=True)
class LayerTerm:
    """One layer's share of the footprint."""

    layer: int
    kind: str  # "full", "sliding" or "shared"
    positions: int
    why: str
    kv_heads: int
    head_dim: int

    def bytes(self, rows: int, itemsize: int) -> int:
        return rows * self.positions * 2 * self.kv_heads * self.head_dim * itemsize


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
    def total(self) -> int:
        return sum(t.bytes(self.rows, self.itemsize) for t in self.layers)

    def explain(self) -> str:
        """The formula with its terms, one line per layer."""
        lines = [f"{self.layout}, T = width {self.width} + new_tokens {self.new_tokens} - 1 = "
                 f"{self.width + self.new_tokens - 1}; bytes = rows x positions x 2 (K,V) x kv_heads x head_dim x dtype bytes"]
        for t in self.layers:
            if t.kind == "shared":
                lines.append(f"  layer {t.layer} (shared KV): 0")
                continue
            lines.append(f"  layer {t.layer} ({t.kind}): {self.rows} x {t.positions} [{t.why}] x 2 x {t.kv_heads} x "
                         f"{t.head_dim} x {self.itemsize} = {t.bytes(self.rows, self.itemsize)}")
        lines.append(f"  total: {self.total}")
        return "\n".join(lines)


def _geometry(config: Any, layer: int) -> tuple[int, int]:
    """(kv_heads, head_dim) of one layer: transformers' per-layer view where it has one (Gemma4's global layers)."""
    per_layer = getattr(config, "per_layer_config", None)
    c = per_layer[layer] if per_layer is not None else config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def expected_kv_bytes(layout: KVLayout, config: Any, dtype: torch.dtype, rows: int, width: int,
                      new_tokens: int) -> Footprint:
    """The footprint `layout` holds after ``generate(<rows prompts, longest `width`>, new_tokens)`` on `config`
    (``layout.rows`` rows where it fixes them)."""
    if new_tokens < 2:
        raise ValueError(f"expected_kv_bytes needs new_tokens >= 2 (at least one decode step), got {new_tokens}")
    written = width + new_tokens - 1
    sliding, shared = set(sliding_layers(config)), set(shared_kv_layers(config))
    terms = []
    for layer in range(config.num_hidden_layers):
        heads, head_dim = _geometry(config, layer)
        if layer in shared:
            terms.append(LayerTerm(layer, "shared", 0, "reuses another layer's KV", heads, head_dim))
            continue
        window = config.sliding_window if layer in sliding else None
        positions, why = layout.positions(written, window)
        terms.append(LayerTerm(layer, "sliding" if window else "full", positions, why, heads, head_dim))
    return Footprint(layout, layout.rows or rows, width, new_tokens, dtype.itemsize, tuple(terms))


__all__ = [
    "KINDS",
    "Footprint",
    "Held",
    "KVLayout",
    "LayerTerm",
    "cache_tensors",
    "expected_kv_bytes",
    "format_bytes",
    "held_by",
    "held_bytes",
    "live_tensor_bytes",
]
