"""The parts an engine's `Declaration` is built from (contract/engine.py): how its KV cache stores positions
(`KVLayout`), a prefix cache kept across calls (`PrefixCache`), the shapes it refuses by design (`Bounds`) and the ids
it never emits (`never_emitted`); and `renamed_keywords`, the deprecated spellings their constructors still take.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvcompile.verdicts.lowered import Lowered  # noqa: F401 (re-exported: the contract's part)

ALLOCATIONS = ("dynamic", "static", "budget")  # KVLayout.allocation
STATE_DTYPES = (None, "float32", "bfloat16", "float16")  # KVLayout.state_dtype: None, the model reference's


def renamed_keywords(**renames: str) -> Callable[[type], type]:
    """Class decorator of a dataclass: `old=` keywords of its constructor (and reading ``obj.old``) still accepted
    for the field `new`, with a DeprecationWarning naming the new spelling (issue 27: one name per concept).
    Equality and ``dataclasses.replace(obj, new=...)`` see only the new fields (`with_declaration` also takes the old
    keywords); giving both spellings is a TypeError."""

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **renamed_to_new(cls, kwargs))

        def alias(old: str, new: str) -> property:
            def read(self: Any) -> Any:
                warnings.warn(f"{cls.__name__}.{old} is deprecated: read {cls.__name__}.{new}", DeprecationWarning,
                              stacklevel=2)
                return getattr(self, new)

            return property(read, doc=f"Deprecated spelling of `{new}`.")

        cls.__init__ = __init__  # type: ignore[misc]
        for old, new in renames.items():
            setattr(cls, old, alias(old, new))
        cls.RENAMED = {**getattr(cls, "RENAMED", {}), **renames}  # type: ignore[attr-defined]
        return cls

    return decorate


def renamed_to_new(cls: type, kwargs: dict[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """`kwargs` for `cls` with its deprecated keywords (``cls.RENAMED``: old -> new) renamed, each with a
    DeprecationWarning naming the new one, attributed `stacklevel` frames above the caller (2: the caller's caller)."""
    kwargs, name = dict(kwargs), cls.__name__
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in kwargs:
            if new in kwargs:
                raise TypeError(f"{name}() got both {old}= and {new}=: write {new}= only ({old}= is its deprecated "
                                "spelling)")
            warnings.warn(f"{name}({old}=...) is deprecated: write {name}({new}=...), the same value",
                          DeprecationWarning, stacklevel=stacklevel + 1)
            kwargs[new] = kwargs.pop(old)
    return kwargs


@renamed_keywords(kind="allocation")
@dataclass(frozen=True)
class KVLayout:
    """How an engine's KV cache stores positions, so its footprint can be computed exactly.

    T = positions written by ``generate(prompts, new_tokens)`` = prompt width + new_tokens - 1: the
    width is the longest prompt (a batch is one padded cache of one row per prompt) and the last
    generated token is never fed back. W = the model's ``sliding_window``. Per layer with its own KV
    (KV-sharing layers hold none), each position holds what the layer's cache kind holds (models/layers.py: K and V
    of ``kv_heads x head_dim`` each; a latent-attention layer its ``kv_lora_rank + qk_rope_head_dim`` latent), per
    row, for as many positions as `allocation` (the first argument; ``kind=`` is its deprecated spelling) says:

    ============  ==========================  =====================================================
    allocation    full-attention layer        sliding-window layer (S = W + window_offset)
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

    A recurrent layer (a hybrid model's Mamba or Gated DeltaNet layer: models/states.py) holds, per row and whatever
    T, its conv window (conv channels x the conv's kernel K + `conv_window_offset` inputs: transformers keeps K,
    offset 0; vLLM's and SGLang's state caches keep K-1, offset -1) in the model's dtype and its recurrent state in
    `state_dtype` (None: what the model's own reference keeps, float32 for every family read; "bfloat16" or
    "float16": a state stored lower). `state_slots`: the states a recurrent layer allocates whatever the batch (a
    prefix cache's state snapshots, one per block: vLLM's and SGLang's mamba prefix caches); None: one per row.
    """

    allocation: str = "dynamic"
    max_cache_len: int | None = None
    budget: int | None = None
    window_offset: int = 0
    rows: int | None = None
    windowed: bool = True
    extra_positions: int = 0
    conv_window_offset: int = 0
    state_dtype: str | None = None
    state_slots: int | None = None

    def __post_init__(self) -> None:
        usage = ('KVLayout("dynamic"), KVLayout("static", max_cache_len=N) or KVLayout("budget", budget=N), '
                 "optionally with window_offset=-1 (sliding layers hold W-1 positions) or 0 (W) and rows=N "
                 "(rows allocated whatever the batch)")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"KVLayout allocation {self.allocation!r} is unknown; write {usage}")
        for name, needed in (("max_cache_len", "static"), ("budget", "budget"), ("rows", None), ("state_slots", None)):
            value = getattr(self, name)
            if needed and (self.allocation == needed) != (value is not None):
                raise ValueError(f"{self}: {name} is required for allocation {needed!r} and only there; write "
                                 f"{usage}")
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{self}: {name} must be an int >= 1, got {value!r}")
        if type(self.window_offset) is not int or self.window_offset not in (-1, 0):
            raise ValueError(f"{self}: window_offset must be -1 (W-1 positions) or 0 (W), got {self.window_offset!r}")
        if type(self.windowed) is not bool:
            raise ValueError(f"{self}: windowed must be True or False, got {self.windowed!r}")
        if type(self.extra_positions) is not int or self.extra_positions < 0:
            raise ValueError(f"{self}: extra_positions must be an int >= 0, got {self.extra_positions!r}")
        if type(self.conv_window_offset) is not int or self.conv_window_offset not in (-1, 0):
            raise ValueError(f"{self}: conv_window_offset must be -1 (the conv keeps kernel-1 inputs) or 0 (kernel), "
                             f"got {self.conv_window_offset!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"{self}: state_dtype must be one of {', '.join(map(repr, STATE_DTYPES))}, got "
                             f"{self.state_dtype!r}")

    def __str__(self) -> str:
        params = [f"{n}={getattr(self, n)}" for n in ("max_cache_len", "budget", "rows", "state_slots")
                  if getattr(self, n) is not None]
        params += [f"window_offset={self.window_offset}"] if self.window_offset else []
        params += ["windowed=False"] if not self.windowed else []
        params += [f"extra_positions={self.extra_positions}"] if self.extra_positions else []
        params += [f"conv_window_offset={self.conv_window_offset}"] if self.conv_window_offset else []
        params += [f"state_dtype={self.state_dtype!r}"] if self.state_dtype else []
        return f"KVLayout({', '.join([repr(self.allocation), *params])})"

    def positions(self, written: int, window: int | None) -> tuple[int, str]:
        """Positions one layer holds after `written` positions (window: None for full attention), and why."""
        if self.allocation == "static":
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
class PrefixCache:
    """A KV cache kept across calls so that prompts sharing a prefix reuse it (vLLM's automatic prefix caching,
    SGLang's radix cache, llama.cpp's prompt cache): it grows by design, up to a capacity, and is no leak.

    - `capacity_tokens`: the positions it keeps at most, over all calls (required: a cache without a bound is a leak).
      The suite offers more distinct prefixes than that, so it must evict (suites/test_prefix_cache.py), and the
      memory check drives it past that capacity and holds it there (suites/test_kv_memory.py).
    - `block_size`: positions per block where the cache shares whole blocks (vLLM: 16); the suite's prompt lengths
      then land on k*B-1, k*B and k*B+1. None (a radix tree, a prompt cache): the suite sweeps 1, 16, 32 and 64.
    - `capacity_bytes`: the bytes it may grow by at most (whatever tensors it keeps: K/V, logits, indexes); None: the
      K/V of `capacity_tokens` positions of the model in its dtype (on a model with recurrent layers, and a state
      snapshot per block of them), times the memory checks' HELD_FACTOR.
    """

    capacity_tokens: int
    block_size: int | None = None
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "block_size", "capacity_bytes"):
            value = getattr(self, name)
            if (value is not None or name == "capacity_tokens") and (type(value) is not int or value < 1):
                raise ValueError(f"PrefixCache({name}={value!r}): {name} must be an int >= 1"
                                 + ("" if name == "capacity_tokens" else " or None") +
                                 ", e.g. PrefixCache(capacity_tokens=2048, block_size=16)")


TOKEN_ROLES = ("eos", "bos", "pad")  # Declaration.never_emits names these by role: the model config's ids
MAX_NEVER_EMITS = 8  # ids one engine may declare it never emits: a runtime suppresses special tokens, not a vocabulary


@dataclass(frozen=True)
class Bounds:
    """Shapes an engine refuses by design (a runtime's documented limit, not a bug). None: no bound. A call outside
    them is still made: if the engine raises, that check is a named skip, never a pass; if it answers, the answer is
    judged like any other (a bound narrows what must work, never what may be wrong: LitGPT 0.5.12 answered prompts
    longer than its window with tokens that broke causality, 0.5.13 raises; docs/released-bugs.md).

    - `max_prompt`: the longest prompt it prefills.
    - `max_positions`: prompt + new tokens it can hold.
    - `max_batch`: prompts in one ``generate`` call.
    - `prompt_within_window`: on a model with a sliding window W, a prompt longer than W is refused (LitGPT 0.5:
      "Prefill length (48) exceeds the sliding window size (8)").
    """

    max_prompt: int | None = None
    max_positions: int | None = None
    max_batch: int | None = None
    prompt_within_window: bool = False

    def __post_init__(self) -> None:
        for name in ("max_prompt", "max_positions", "max_batch"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"Bounds({name}={value!r}): {name} must be an int >= 1 or None (no bound)")
        if type(self.prompt_within_window) is not bool:
            raise ValueError(f"Bounds(prompt_within_window={self.prompt_within_window!r}) must be True or False")

    def __str__(self) -> str:
        shown = [f"{name}={getattr(self, name)}" for name in ("max_prompt", "max_positions", "max_batch")
                 if getattr(self, name) is not None]
        return f"Bounds({', '.join(shown + (['prompt_within_window=True'] if self.prompt_within_window else []))})"

    def outside(self, lengths: Sequence[int], new_tokens: int, window: int | None) -> str | None:
        """Which bound a ``generate(prompts of these lengths, new_tokens)`` call on a model with this sliding window
        (None: none) passes, or None when it is inside them all."""
        longest = max(lengths, default=0)
        if self.max_batch is not None and len(lengths) > self.max_batch:
            return f"{len(lengths)} prompts in one call > max_batch={self.max_batch}"
        if self.max_prompt is not None and longest > self.max_prompt:
            return f"a prompt of {longest} tokens > max_prompt={self.max_prompt}"
        if self.max_positions is not None and longest + new_tokens > self.max_positions:
            return f"{longest} prompt + {new_tokens} new tokens > max_positions={self.max_positions}"
        if self.prompt_within_window and window is not None and longest > window:
            return f"a prompt of {longest} tokens > the model's sliding window {window} (prompt_within_window=True)"
        return None


def never_emitted(declared: Sequence[int | str], config: Any) -> dict[int, str]:
    """The ids `declared` (Declaration.never_emits) names on a model: id -> how it was named ("eos" -> the config's
    eos_token_id, every one of a list, else its text_config's; an int as itself). A role the config has no id for names
    none."""
    found: dict[int, str] = {}
    text = getattr(config, "text_config", None)
    for entry in declared:
        if isinstance(entry, str):
            ids = getattr(config, f"{entry}_token_id", None)
            ids = ids if ids is not None or text is None else getattr(text, f"{entry}_token_id", None)
            for i in ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]:
                found.setdefault(int(i), entry)
        else:
            found.setdefault(int(entry), str(entry))
    return found

