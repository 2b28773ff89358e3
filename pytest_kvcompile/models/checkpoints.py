"""The models a run checks: the built-in tiny zoo plus any ``--kv-model`` checkpoints.

Configs are read at collection (cheap) so prompt sets can depend on the sliding
window; zoo weights are built on first use and cached on disk (see ``zoo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models import zoo
from pytest_kvcompile.run.options import MODEL, ZOO, Settings


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config: Any | None
    path: Path | None  # None for zoo models: built on demand
    unavailable: str | None = None

    @property
    def window(self) -> int | None:
        return zoo.attention_window(self.config) if self.config is not None else None

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
    names = list(zoo.ZOO) if settings.zoo is None else list(settings.zoo)
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        raise pytest.UsageError(f"{ZOO}: unknown zoo model(s) {unknown}; choose from {', '.join(zoo.ZOO)}, 'all' or 'none'")
    entries: dict[str, ModelEntry] = {}
    for name in names:
        try:
            entries[name] = ModelEntry(name, zoo.ZOO[name].build_config(settings.zoo_head_dim), None)
        except zoo.ModelUnavailable as exc:
            entries[name] = ModelEntry(name, None, None, unavailable=str(exc))
    for path in settings.models:
        entries[_local_name(path, entries)] = _local_entry(path, _local_name(path, entries))
    return entries


def _local_name(path: Path, taken: dict) -> str:
    name = path.resolve().name
    return name if name not in taken else f"{name}@{abs(hash(str(path.resolve()))) % 10**6}"


def _local_entry(path: Path, name: str) -> ModelEntry:
    if not (path / "config.json").is_file():
        raise pytest.UsageError(f"{MODEL}={path}: not a local Hugging Face checkpoint directory (no config.json there)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise pytest.UsageError(f"{MODEL}={path}: transformers cannot read its config.json: {exc}") from None
    return ModelEntry(name, config, path)


def spec_for(entry: ModelEntry, settings: Settings) -> ModelSpec:
    """The ModelSpec engines receive; builds the zoo checkpoint if needed."""
    path = entry.path or zoo.checkpoint(entry.name, settings.cache_dir / "zoo", settings.zoo_head_dim)
    return ModelSpec(entry.name, path, entry.config, settings.device, getattr(torch, settings.dtype))
