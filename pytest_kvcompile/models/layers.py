"""What each layer of a model caches per position, read from its config: one type per cache kind, as transformers'
`cache_utils.py` has a layer class per kind. The memory check (memory/measure.py) and the reports ask a layer's kind,
never a model's `model_type`:

==================  =======================================================  ==========================================
kind                cached per position                                      config fields read
==================  =======================================================  ==========================================
`KVLayer` full      K and V: 2 x kv_heads x head_dim values                  num_key_value_heads, head_dim
`KVLayer` sliding   the same, for the last W positions only                  sliding_window, layer_types
`LatentLayer`       multi-head latent attention (MLA): one compressed        kv_lora_rank, qk_rope_head_dim
                    latent (kv_lora_rank) and one shared RoPE key
                    (qk_rope_head_dim), no per-head K or V
`SharedLayer`       nothing: it reads an earlier layer's K/V                 num_kv_shared_layers
`StateLayer`        nothing per position: a fixed-size state per sequence    layer_types (linear_attention, conv,
                    (its conv window and recurrent state, models/states.py)  mamba; hybrid: beside K/V), the state's
                                                                             sizes (models/states.py)
`NoCacheLayer`      nothing: a layer without attention or state              layer_types (mlp, moe)
==================  =======================================================  ==========================================

Attention sinks (GPT-OSS's learned per-head logit) add no cache entry: the sink is a parameter, not a position, so a
layer with sinks is a `KVLayer` like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytest_kvcompile.models.states import RecurrentState, recurrent_state
from pytest_kvcompile.models.zoo import shared_kv_layers, sliding_layers

#: transformers' layer types (config.layer_types) whose cache is a recurrent state, alone or beside K/V, or nothing
STATE_TYPES, HYBRID_TYPES, NO_CACHE_TYPES = ("linear_attention", "conv", "mamba"), ("hybrid", "hybrid_sliding"), \
    ("mlp", "moe", "dummy")


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache: `values` per position and row (0: it holds none), and how it is described."""

    layer: int

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def values(self) -> int:
        raise NotImplementedError

    @property
    def window(self) -> int | None:
        """Positions it keeps at most (a sliding window), None: every position."""
        return None

    @property
    def shape(self) -> str:
        """Its values per position as a product of the config's sizes, for a footprint's explanation."""
        raise NotImplementedError


@dataclass(frozen=True)
class KVLayer(LayerCache):
    """Per-head keys and values (GQA/MQA/MHA), full or sliding."""

    kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "sliding" if self.sliding_window else "full"

    @property
    def values(self) -> int:
        return 2 * self.kv_heads * self.head_dim

    @property
    def window(self) -> int | None:
        return self.sliding_window

    @property
    def shape(self) -> str:
        return f"2 (K,V) x {self.kv_heads} kv_heads x {self.head_dim} head_dim"


@dataclass(frozen=True)
class LatentLayer(LayerCache):
    """Multi-head latent attention: the compressed latent and the shared RoPE key, the same for every head."""

    latent: int
    rope_dim: int

    @property
    def kind(self) -> str:
        return "latent"

    @property
    def values(self) -> int:
        return self.latent + self.rope_dim

    @property
    def shape(self) -> str:
        return f"({self.latent} kv_lora_rank + {self.rope_dim} qk_rope_head_dim)"


@dataclass(frozen=True)
class SharedLayer(LayerCache):
    """A layer reading an earlier layer's K/V (Gemma3n, Gemma4): it caches nothing of its own."""

    @property
    def kind(self) -> str:
        return "shared"

    @property
    def values(self) -> int:
        return 0

    @property
    def shape(self) -> str:
        return "0 (reuses another layer's KV)"


@dataclass(frozen=True)
class NoCacheLayer(LayerCache):
    """A layer that caches nothing (Nemotron-H's MLP and MoE layers)."""

    @property
    def kind(self) -> str:
        return "none"

    @property
    def values(self) -> int:
        return 0

    @property
    def shape(self) -> str:
        return "0 (no attention, no state)"


@dataclass(frozen=True)
class StateLayer(LayerCache):
    """A recurrent layer (Mamba, Mamba2, Gated DeltaNet): a fixed-size state per sequence, whatever its length, and
    with `kv` K/V per position beside it (a hybrid layer: Falcon-H1). `state` None: its sizes are not in fields any
    reader of models/states.py knows (`layer_type`: the config's name for the layer)."""

    layer_type: str
    state: RecurrentState | None
    kv: KVLayer | None = None

    @property
    def kind(self) -> str:
        return "state" if self.kv is None else "state+kv"

    @property
    def values(self) -> int:
        return self.kv.values if self.kv is not None else 0

    @property
    def window(self) -> int | None:
        return self.kv.window if self.kv is not None else None

    @property
    def shape(self) -> str:
        per_position = f"{self.kv.shape} per position, " if self.kv is not None else ""
        state = self.state.describe(self.state.conv_kernel) if self.state else "sizes unknown"
        return f"{per_position}{state} per sequence"


@dataclass(frozen=True)
class ExpandedLayer(LayerCache):
    """What an engine holds that caches a layer's K and V per query head (`expanded`): GQA's shared heads repeated,
    or MLA's latent up-projected; never a layer of a config, only a footprint's alternative for a hint."""

    heads: int
    key_dim: int
    value_dim: int
    window_of: int | None = None
    of: str = "full"

    @property
    def kind(self) -> str:
        return self.of

    @property
    def values(self) -> int:
        return self.heads * (self.key_dim + self.value_dim)

    @property
    def window(self) -> int | None:
        return self.window_of

    @property
    def shape(self) -> str:
        return f"{self.heads} heads x ({self.key_dim} + {self.value_dim})"


def expanded(cache: LayerCache, config: Any) -> LayerCache:
    """`cache` as an engine holds it that keeps K and V per query head: a latent layer up-projected
    (num_attention_heads x (qk_nope + qk_rope + v_head_dim)), a GQA layer's K/V repeated for every query head."""
    heads = config.num_attention_heads
    if isinstance(cache, LatentLayer):
        key = int(getattr(config, "qk_nope_head_dim", 0)) + cache.rope_dim
        return ExpandedLayer(cache.layer, heads, key, int(getattr(config, "v_head_dim", key)), of="latent")
    if isinstance(cache, KVLayer) and cache.kv_heads < heads:
        return ExpandedLayer(cache.layer, heads, cache.head_dim, cache.head_dim, cache.window, cache.kind)
    return cache


def _geometry(config: Any, layer: int) -> tuple[int, int]:
    """(kv_heads, head_dim) of one layer: transformers' per-layer view where it has one (Gemma4's global layers)."""
    per_layer = getattr(config, "per_layer_config", None)
    c = per_layer[layer] if per_layer is not None else config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def layer_caches(config: Any) -> tuple[LayerCache, ...]:
    """Each layer's cache kind, from `config` (module docstring)."""
    sliding, shared = set(sliding_layers(config)), set(shared_kv_layers(config))
    latent, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    types = list(getattr(config, "layer_types", None) or [])
    found: list[LayerCache] = []
    for layer in range(config.num_hidden_layers):
        kind = types[layer] if layer < len(types) else "full_attention"
        if layer in shared:
            found.append(SharedLayer(layer))
        elif kind in NO_CACHE_TYPES:
            found.append(NoCacheLayer(layer))
        elif kind in STATE_TYPES or kind in HYBRID_TYPES:
            heads, head_dim = _geometry(config, layer)
            kv = KVLayer(layer, heads, head_dim, config.sliding_window if kind == "hybrid_sliding" else None) \
                if kind in HYBRID_TYPES else None
            found.append(StateLayer(layer, kind, recurrent_state(config), kv))
        elif latent and rope is not None:
            found.append(LatentLayer(layer, int(latent), int(rope)))
        else:
            heads, head_dim = _geometry(config, layer)
            found.append(KVLayer(layer, heads, head_dim, config.sliding_window if layer in sliding else None))
    return tuple(found)


def states_of(config: Any) -> str:
    """The recurrent layers of `config` for a failure's hint ("layers 0, 2: mamba2, conv window 4 over 160
    channels, state 4 x 32 x 16"), "" where it has none or its config is not a transformers one."""
    try:
        found = [c for c in layer_caches(config) if isinstance(c, StateLayer)]
    except (AttributeError, TypeError, IndexError):  # an engine's own config: no layer kinds to read
        return ""
    if not found:
        return ""
    state = found[0].state
    sizes = (f": {state.family}, conv window {state.conv_kernel} over {state.conv_channels} channels, state "
             f"{' x '.join(map(str, state.state_shape))}") if state else ""
    return f"layers {', '.join(str(c.layer) for c in found)}{sizes}"


__all__ = ["ExpandedLayer", "KVLayer", "LatentLayer", "LayerCache", "NoCacheLayer", "SharedLayer", "StateLayer",
           "expanded", "layer_caches", "states_of"]
