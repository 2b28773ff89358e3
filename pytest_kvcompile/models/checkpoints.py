"""The models a run checks: the built-in tiny zoo plus any ``--kv-model`` checkpoints.

Configs are read at collection (cheap) so prompt sets can depend on the sliding
window; zoo weights are built on first use and cached on disk (see ``zoo``).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytest_kvcompile.config.options import MODEL, ZOO, Settings
from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.errors import UsageError
from pytest_kvcompile.models import zoo


def _installed(distribution: str) -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version(distribution).split(".")[:2]
    return int(major), int(minor.split("rc")[0].split("dev")[0])


#: read once, here: `with_cache` runs inside users' compiled functions, where dynamo warns about a call to a
#: functools.lru_cache-wrapped function (issue 59) and traces a constant without a word
_TRANSFORMERS = _installed("transformers")


def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    return _TRANSFORMERS


def cache_keyword() -> str:
    """The keyword that hands a ``Cache`` to a transformers ``forward()``/``generate()``, and the output field that
    returns it: ``cache`` from 5.24 (there ``past_key_values`` is deprecated: removed in 5.40 for ``forward()``, 6.0
    for ``generate()``), ``past_key_values`` before. Every call the plugin makes into transformers goes through
    `with_cache`/`returned_cache`, so the spelling is chosen here only."""
    return "cache" if transformers_version() >= (5, 24) else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """The keyword argument passing `cache` (a ``Cache``, or None) to a transformers model: ``model(ids,
    **with_cache(cache))``."""
    return {cache_keyword(): cache}


def positions(start: int, length: int, device: Any = "cpu") -> dict[str, Any]:
    """The keyword numbering the `length` tokens a forward feeds after `start` cached ones: ``position_ids``. Every
    incremental forward the harness makes passes it: transformers 5.24's Bamba numbers the tokens of a forward that
    gets none from 0 whatever its cache holds (``BambaModel.forward``: ``arange(seq_len)``, where Nemotron-H, Falcon-H1
    and Zamba add the cache's length), so its decode steps all sat at RoPE position 0 (tests/test_states.py)."""
    return {"position_ids": torch.arange(start, start + length, device=device)[None]}


def returned_cache(output: Any) -> Any:
    """The ``Cache`` a transformers model output or ``generate()`` result carries (under `cache_keyword`)."""
    return getattr(output, cache_keyword())


def pretrained(path: Path | str, dtype: torch.dtype, **kwargs: Any):
    """``AutoModelForCausalLM.from_pretrained(path, ...)`` in `dtype`: transformers names that keyword ``dtype`` from
    4.56 and ``torch_dtype`` before (4.x releases run the released-bug rows). Every built-in loader goes through it."""
    from transformers import AutoModelForCausalLM

    keyword = "dtype" if transformers_version() >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, **{keyword: dtype}, **kwargs)
    if dtype == torch.float64:
        per_expert(model)
    return model


#: transformers' experts implementation that loops over experts with plain matmuls: the one that runs in float64
#: (its default, "grouped_mm", calls torch's grouped GEMM, which refuses float64 on every device)
PER_EXPERT = "eager"


def experts_implementation(model: Any) -> dict[str, str | None] | None:
    """`model`'s experts implementation (transformers' `get_experts_implementation`), None where it has no routed
    experts it can set (a dense model, or a transformers without the switch)."""
    can = getattr(model, "_can_set_experts_implementation", None)
    if not (callable(can) and can() and hasattr(model, "get_experts_implementation")):
        return None
    return model.get_experts_implementation()


def per_expert(model: Any) -> dict[str, str | None] | None:
    """Switch a mixture-of-experts `model` to the per-expert loop (PER_EXPERT), the same function as the grouped
    kernel (checked to float32's rounding in tests/test_zoo.py and by the float64 self-check of every float32 run)
    that also runs in float64; returns what to restore (`set_experts_implementation`), None for a dense model."""
    before = experts_implementation(model)
    if before is not None and set(before.values()) - {PER_EXPERT, None}:
        model.set_experts_implementation(PER_EXPERT)
    return before


def keep_last(model: Any, n: int) -> dict[str, int]:
    """The keyword asking `model` for the logits of its last `n` positions only (``logits_to_keep``, before 4.50
    ``num_logits_to_keep``), where its forward has one: the vocabulary projection of a long prompt is not computed."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return {name: n}
    return {}


def per_layer_cache() -> bool:
    """Whether transformers' ``DynamicCache`` is built per layer from the model's config (4.56 on): before, one cache
    class served every model and some (Gemma3 on 4.5x) fail with it, so the oracles recompute the whole sequence at
    every step instead (``use_cache=False``), which no cache bug can touch."""
    return transformers_version() >= (4, 56)


def dynamic_cache(config, cls: type | None = None):
    """A fresh ``DynamicCache`` (or subclass `cls`) for a model of `config`: per layer (`per_layer_cache`), else one
    full cache, the mask applying the window. Oracles and engines build theirs here."""
    if cls is None:
        from transformers import DynamicCache as cls

    return cls(config=config) if per_layer_cache() else cls()


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config: Any | None
    path: Path | None  # None for zoo models: built on demand
    unavailable: str | None = None
    own: bool = False  # not a transformers checkpoint: `config` is its config.json as the engine's own (OwnConfig)

    @property
    def window(self) -> int | None:
        if self.config is None or self.own:
            return getattr(self.config, "sliding_window", None) if self.own else None
        return zoo.attention_window(self.config)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size) if self.config is not None else 0

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.config)


def max_positions(config: Any) -> int | None:
    """The model's position limit (learned position tables end there), if its config says."""
    found = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(found) if found else None


def collect(settings: Settings) -> dict[str, ModelEntry]:
    """Zoo entries (as selected) then local checkpoints; a bad selection is a usage error."""
    names = zoo.selected(["all"] if settings.zoo is None else list(settings.zoo))
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        raise UsageError(f"{ZOO}: unknown zoo model(s) {unknown}; choose from {', '.join(zoo.ZOO)}, a group "
                         f"({', '.join(repr(g) for g in zoo.GROUPS)}) or 'none'")
    entries: dict[str, ModelEntry] = {}
    for name in names:
        try:
            entries[name] = (_trained_entry(name, settings) if zoo.ZOO[name].trained is not None
                             else ModelEntry(name, zoo.ZOO[name].build_config(settings.zoo_head_dim), None))
        except zoo.ModelUnavailable as exc:
            entries[name] = ModelEntry(name, None, None, unavailable=str(exc))
    for path in settings.models:
        entries[_local_name(path, entries)] = _local_entry(path, _local_name(path, entries),
                                                           any(o != "hf" for _, o in settings.oracles))
    return entries


def _trained_entry(name: str, settings: Settings) -> ModelEntry:
    """A trained zoo model: its checkpoint dequantised once (models/trained.py), its config read from there; where
    that fails, the model is unavailable with the cause (its checks skip by name), never a collection error."""
    from transformers import AutoConfig

    try:
        path = zoo.checkpoint(name, settings.cache_dir / "zoo")
        return ModelEntry(name, AutoConfig.from_pretrained(path, local_files_only=True), path)
    except zoo.ModelUnavailable:
        raise
    except Exception as exc:
        raise zoo.ModelUnavailable(f"the trained checkpoint could not be converted here: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def _local_name(path: Path, taken: dict) -> str:
    name = path.resolve().name
    return name if name not in taken else f"{name}@{abs(hash(str(path.resolve()))) % 10**6}"


class OwnConfig(types.SimpleNamespace):
    """The config.json of a checkpoint transformers cannot read, as the engine's own (its keys as attributes;
    ``model_type`` is always "own", the file's own value is kept as ``declared_model_type``). The suite reads
    `vocab_size` (required), `max_position_embeddings` and `sliding_window` from it; checks that need a transformers
    config skip by name. `unreadable`: why transformers could not read it."""

    def __init__(self, keys: dict[str, Any] | None = None, unreadable: str = "") -> None:  # no keys: unpickling
        keys = keys or {}
        super().__init__(**{**keys, "model_type": "own", "declared_model_type": keys.get("model_type"),
                            "unreadable": unreadable})


def _local_entry(path: Path, name: str, own_allowed: bool) -> ModelEntry:
    """A --kv-model directory: a transformers checkpoint, or with an engine oracle (own_allowed) any directory whose
    config.json gives its vocab_size."""
    fix = ("; checked against an engine (--kv-oracle=eager or NAME), any directory with a config.json giving "
           "vocab_size works" if not own_allowed else "")
    if not (path / "config.json").is_file():
        own = ('; checked against an engine, a directory whose config.json (a JSON object) gives "vocab_size" also '
               "works" if own_allowed else fix)
        raise UsageError(f"{MODEL}={path}: not a local Hugging Face checkpoint directory (no config.json "
                         f"there){own}")
    from transformers import AutoConfig

    try:
        return ModelEntry(name, AutoConfig.from_pretrained(path, local_files_only=True), path)
    except Exception as exc:
        if not own_allowed:
            raise UsageError(f"{MODEL}={path}: transformers cannot read its config.json: {exc}{fix}") from None
        unreadable = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{MODEL}={path}: its config.json is not JSON ({exc})") from None
    vocab = raw.get("vocab_size") if isinstance(raw, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise UsageError(f"{MODEL}={path}: transformers cannot read its config.json and it gives no "
                         f"\"vocab_size\" (a whole number >= 2; got {vocab!r}): the suite draws prompt token "
                         "ids from it")
    return ModelEntry(name, OwnConfig(raw, unreadable), path, own=True)


def spec_for(entry: ModelEntry, settings: Settings) -> ModelSpec:
    """The ModelSpec engines receive; builds the zoo checkpoint if needed."""
    path = entry.path or zoo.checkpoint(entry.name, settings.cache_dir / "zoo", settings.zoo_head_dim)
    return ModelSpec(entry.name, path, entry.config, settings.device, getattr(torch, settings.dtype))
