"""Fixtures for suites and downstream tests. Engine, model and prompt are parametrized
from the run's options (see ``plugin.pytest_generate_tests``)."""

from __future__ import annotations

import pytest

from .harness import EngineUnderTest
from .options import Settings
from .prompts import Prompt, batch, prompt_set
from .results import Recorder
from .session import SESSION

UNAVAILABLE_PROMPT = Prompt("unavailable", ())


@pytest.fixture(scope="session")
def kv_settings(pytestconfig: pytest.Config) -> Settings:
    """The run's validated kvcompile options."""
    return pytestconfig.stash[SESSION].settings


@pytest.fixture
def kv_model(pytestconfig: pytest.Config, kv_model_name: str):
    """The ModelSpec of the current model (its checkpoint built if needed)."""
    return pytestconfig.stash[SESSION].spec(kv_model_name)


@pytest.fixture
def kv_engine(request: pytest.FixtureRequest, kv_engine_name: str, kv_model_name: str) -> EngineUnderTest:
    """The current engine built for the current model, shared by every test in this process.

    Skips when the model is unavailable, or the engine does not declare the device, dtype
    or a capability the test asks for with ``@pytest.mark.kv_requires(...)``.
    """
    session = request.config.stash[SESSION]
    session.spec(kv_model_name)
    ref = session.engines[kv_engine_name]
    for mark in request.node.iter_markers("kv_requires"):
        for capability in mark.args:
            if not getattr(ref.declaration, capability):
                pytest.skip(f"engine '{kv_engine_name}' does not declare capability '{capability}' "
                            f"(declare it with kv_declaration = Declaration({capability}=True) if it supports it)")
    return session.engine(kv_engine_name, kv_model_name)


@pytest.fixture
def kv_oracle(request: pytest.FixtureRequest, kv_engine_name: str, kv_model_name: str):
    """The oracle of the engine's declared strategy on the current model."""
    return request.config.stash[SESSION].oracle(kv_engine_name, kv_model_name)


@pytest.fixture
def kv_prompts(request: pytest.FixtureRequest, kv_model_name: str) -> list[Prompt]:
    """The current model's prompt set (lengths 1, short, long and around its sliding window)."""
    entry = request.config.stash[SESSION].models[kv_model_name]
    if entry.unavailable:
        pytest.skip(f"model '{kv_model_name}' unavailable: {entry.unavailable}")
    return prompt_set(entry.vocab_size, entry.window)


@pytest.fixture
def kv_prompt(kv_prompts: list[Prompt], kv_prompt_name: str) -> Prompt:
    """One prompt of the current model's set (parametrized)."""
    return next(p for p in kv_prompts if p.name == kv_prompt_name)


@pytest.fixture
def kv_batch(request: pytest.FixtureRequest, kv_model_name: str, kv_prompts) -> list[Prompt]:
    """A batch of prompts of different lengths for the current model."""
    entry = request.config.stash[SESSION].models[kv_model_name]
    return batch(entry.vocab_size, entry.window)


@pytest.fixture
def kv_record(request: pytest.FixtureRequest) -> Recorder:
    """``kv_record(category, line, **metrics)``: a passing-but-notable fact (a near tie, a compile
    count) for the run's terminal summary; metrics go to the reports (see results.Recorder)."""
    return Recorder(request.node)
