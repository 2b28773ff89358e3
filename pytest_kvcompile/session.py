"""Per-process state of a run, kept in ``config.stash``: settings, resolved engines,
models, and the engines/oracles built so far (shared by every test of the process)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest

from . import engine_io, models
from .engine import ModelSpec, missing_capability
from .harness import EngineUnderTest
from .models import ModelEntry
from .options import Settings
from .recompiles import CompileRecorder, isolate
from .oracle import NoOracle, oracle_for
from .registry import EngineRef


@dataclass
class Session:
    settings: Settings
    engines: dict[str, EngineRef]
    _models: dict[str, ModelEntry] | None = None
    _specs: dict[str, ModelSpec] = field(default_factory=dict)
    _built: dict[tuple[str, str], EngineUnderTest | str] = field(default_factory=dict)
    _oracles: dict[tuple[str, str], Any] = field(default_factory=dict)

    @property
    def models(self) -> dict[str, ModelEntry]:
        """Zoo and local models, read on first use (imports transformers only then)."""
        if self._models is None:
            self._models = models.collect(self.settings)
        return self._models

    def spec(self, model: str) -> ModelSpec:
        entry = self.models[model]
        if entry.unavailable:
            pytest.skip(f"model '{model}' unavailable: {entry.unavailable}")
        if model not in self._specs:
            self._specs[model] = models.spec_for(entry, self.settings)
        return self._specs[model]

    def engine(self, name: str, model: str) -> EngineUnderTest:
        """The engine built for the model, once per process; a failed build fails every test using it."""
        ref, spec = self.engines[name], self.spec(model)
        missing = missing_capability(ref.declaration, spec)
        if missing:
            pytest.skip(f"engine '{name}' does not declare {missing}")
        key = (name, model)
        if key not in self._built:
            self._built[key] = f"engine '{name}' failed to build for model '{model}' in an earlier test"
            recorder = CompileRecorder() if ref.declaration.compiled else contextlib.nullcontext()
            if ref.declaration.compiled:
                isolate()  # a fresh dynamo per compiled engine: no shared cache entries or recompile limit
            try:
                with recorder:  # engines that compile up front (vLLM) do it here
                    instance = engine_io.build(ref, spec, self.settings.compile_backend)
            except pytest.skip.Exception:
                del self._built[key]
                raise
            self._built[key] = EngineUnderTest(ref, spec, instance, self.settings.max_new_tokens,
                                               self.settings.tie_tolerance, self.models[model].window,
                                               len(recorder.events) if ref.declaration.compiled else 0)
        built = self._built[key]
        if isinstance(built, str):
            pytest.fail(built + " (see its first failure for the traceback)", pytrace=False)
        return built

    def oracle(self, name: str, model: str):
        strategy = self.engines[name].declaration.strategy
        key = (str(strategy), model)
        if key not in self._oracles:
            try:
                self._oracles[key] = oracle_for(strategy, self.spec(model))
            except NoOracle as exc:
                self._oracles[key] = exc
        found = self._oracles[key]
        if isinstance(found, NoOracle):
            pytest.skip(f"engine '{name}': {found}")
        return found


SESSION = pytest.StashKey[Session]()
