"""The sizes of a recurrent layer's state, read from a config: what a hybrid model's Mamba or linear-attention layer
caches per sequence, whatever the sequence's length (models/layers.py's `StateLayer`).

Such a layer keeps two things per sequence, as transformers' `LinearAttentionLayer` (cache_utils.py) holds them:
the last `conv_kernel` inputs of its causal depthwise convolution (`conv_channels` each: its `conv_states`) and the
recurrent state its scan carries (`recurrent_states`). Each family spells its sizes in its own config fields; a
reader per family (`READERS`) knows them, matched by the fields a config has, never by its ``model_type``:

- ``mamba2`` (Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1, Zamba2): conv channels heads x head_dim + 2 x groups x
  d_state, state heads x head_dim x d_state (the SSD state); fields ``mamba_n_heads`` (or ``mamba_num_heads``,
  ``n_mamba_heads``), ``mamba_d_head`` (``mamba_head_dim``, ``mamba_headdim``), ``mamba_n_groups`` (``n_groups``,
  ``mamba_ngroups``), ``mamba_d_state`` (``ssm_state_size``), ``mamba_d_conv`` (``conv_kernel``).
- ``gated-deltanet`` (Qwen3-Next, Qwen3.5, Olmo-Hybrid): conv channels 2 x key_heads x key_dim + value_heads x
  value_dim (q, k and v), state value_heads x key_dim x value_dim (the delta rule's); fields ``linear_num_key_heads``,
  ``linear_key_head_dim``, ``linear_num_value_heads``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``.
- ``mamba`` (Mamba1: Jamba): conv channels expand x hidden, state expand x hidden x d_state; fields ``mamba_expand``,
  ``mamba_d_state``, ``mamba_d_conv``.

Models' own references keep the recurrent state in float32 in a 16-bit run (transformers' Mamba2 and Gated DeltaNet
paths, whatever a config's ``mamba_ssm_cache_dtype`` says: its modeling code never reads it; SGLang's default) and the
conv window in the model's dtype. A layer whose sizes no reader finds is a `StateLayer` without sizes: the memory check
then says so by name and checks nothing of it (suites/test_kv_memory.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecurrentState:
    """One recurrent layer's state per sequence: its conv window and its recurrent state (family: `READERS`)."""

    family: str
    conv_channels: int
    conv_kernel: int
    state_shape: tuple[int, ...]
    state_dtype: str = "float32"  # what the model's own reference keeps it in (module docstring)

    @property
    def state_values(self) -> int:
        return math.prod(self.state_shape)

    def describe(self, conv_positions: int) -> str:
        return (f"conv {self.conv_channels} channels x {conv_positions} inputs + {self.family} state "
                f"{' x '.join(map(str, self.state_shape))}")


def _field(config: Any, *names: str) -> int | None:
    """The first of `names` the config sets to an int, else None."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _mamba2(config: Any) -> RecurrentState | None:
    heads = _field(config, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    head_dim = _field(config, "mamba_d_head", "mamba_head_dim", "mamba_headdim")
    groups = _field(config, "mamba_n_groups", "n_groups", "mamba_ngroups")
    d_state = _field(config, "mamba_d_state", "ssm_state_size")
    kernel = _field(config, "mamba_d_conv", "conv_kernel")
    if None in (heads, head_dim, groups, d_state, kernel):
        return None
    inner = heads * head_dim  # Mamba2 splits its inner width into heads: heads x head_dim
    return RecurrentState("mamba2", inner + 2 * groups * d_state, kernel, (heads, head_dim, d_state))


def _mamba1(config: Any) -> RecurrentState | None:
    expand, d_state = _field(config, "mamba_expand", "expand"), _field(config, "mamba_d_state", "ssm_state_size")
    kernel, hidden = _field(config, "mamba_d_conv", "conv_kernel"), _field(config, "hidden_size")
    if None in (expand, d_state, kernel, hidden):
        return None
    return RecurrentState("mamba", expand * hidden, kernel, (expand * hidden, d_state))


def _gated_deltanet(config: Any) -> RecurrentState | None:
    key_heads, key_dim = _field(config, "linear_num_key_heads"), _field(config, "linear_key_head_dim")
    value_heads, value_dim = _field(config, "linear_num_value_heads"), _field(config, "linear_value_head_dim")
    kernel = _field(config, "linear_conv_kernel_dim")
    if None in (key_heads, key_dim, value_heads, value_dim, kernel):
        return None
    return RecurrentState("gated-deltanet", 2 * key_heads * key_dim + value_heads * value_dim, kernel,
                          (value_heads, key_dim, value_dim))


#: the families, tried in order (Mamba2's head fields first: a Mamba2 config has Mamba1's expand and d_state too)
READERS: tuple[Callable[[Any], RecurrentState | None], ...] = (_mamba2, _gated_deltanet, _mamba1)
#: what the memory check's skip names when no reader finds a layer's sizes
KNOWN = ("Mamba2 (mamba_n_heads/mamba_num_heads, mamba_d_head, mamba_n_groups/n_groups, mamba_d_state/ssm_state_size, "
         "mamba_d_conv/conv_kernel), Gated DeltaNet (linear_num_key_heads, linear_key_head_dim, "
         "linear_num_value_heads, linear_value_head_dim, linear_conv_kernel_dim), Mamba1 (mamba_expand, mamba_d_state, "
         "mamba_d_conv)")


def recurrent_state(config: Any) -> RecurrentState | None:
    """The state of `config`'s recurrent layers, by the first reader whose fields it has; None: none has them."""
    for read in READERS:
        found = read(config)
        if found is not None:
            return found
    return None


__all__ = ["KNOWN", "READERS", "RecurrentState", "recurrent_state"]
