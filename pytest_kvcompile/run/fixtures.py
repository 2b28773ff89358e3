"""Fixtures for suites and downstream tests. Engine, model and prompt are parametrized
from the run's options (see ``plugin.pytest_generate_tests``)."""

from __future__ import annotations

import pytest

from pytest_kvcompile.errors import NotApplicable
from pytest_kvcompile.run.harness import EngineUnderTest
from pytest_kvcompile.run.options import NO_ENGINE, Settings
from pytest_kvcompile.models.prompts import Prompt, batch
from pytest_kvcompile.oracles.store import OracleUnreliable, StoredOracle
from pytest_kvcompile.reports.results import Recorder
from pytest_kvcompile.run.session import SESSION

UNAVAILABLE_PROMPT = Prompt("unavailable", ())


def _session(request: pytest.FixtureRequest, engine: str | None = "", model: str | None = ""):
    if engine is None:  # the "no-engine" parameter (the controller raises a usage error; an xdist worker lands here)
        pytest.fail(NO_ENGINE, pytrace=False)
    session = request.config.stash[SESSION]
    if model and session.models[model].unavailable:
        raise NotApplicable(f"model '{model}' unavailable: {session.models[model].unavailable}")
    return session


@pytest.fixture(scope="session")
def kv_settings(pytestconfig: pytest.Config) -> Settings:
    """The run's validated kvcompile options."""
    return pytestconfig.stash[SESSION].settings


@pytest.fixture
def kv_model(request: pytest.FixtureRequest, kv_model_name: str):
    """The ModelSpec of the current model (its checkpoint built if needed)."""
    return _session(request, model=kv_model_name).spec(kv_model_name)


@pytest.fixture
def kv_engine(request: pytest.FixtureRequest, kv_engine_name: str, kv_model_name: str) -> EngineUnderTest:
    """The current engine built for the current model, shared by every test in this process
    (``--kv-fresh-engine``: built for each test).

    Skips when the model is unavailable, or the engine does not declare the device, dtype
    or a capability the test asks for with ``@pytest.mark.kv_requires(...)``.
    """
    session = _session(request, kv_engine_name, kv_model_name)
    session.spec(kv_model_name)
    ref = session.engines[kv_engine_name]
    for mark in request.node.iter_markers("kv_requires"):
        for capability in mark.args:
            if not getattr(ref.declaration, capability):
                pytest.skip(f"engine '{kv_engine_name}' does not declare capability '{capability}' "
                            f"(declare it with kv_declaration = Declaration({capability}=True) if it supports it)")
    return session.engine(kv_engine_name, kv_model_name)


@pytest.fixture
def kv_oracle(request: pytest.FixtureRequest, kv_engine_name: str, kv_model_name: str) -> StoredOracle:
    """The oracle of the engine's declared strategy on the current model. Before the first test uses it, the
    model's prompt set is replayed through an independent path (reference_store): an oracle that fails that
    self-check is an ERROR of every token check on the model, never a verdict on the engine."""
    session = _session(request, kv_engine_name, kv_model_name)
    oracle = session.oracle(kv_engine_name, kv_model_name)
    entry = session.models[kv_model_name]
    try:
        for prompt in session.prompts(kv_model_name) + batch(entry.vocab_size, entry.window):
            oracle.reference(prompt.ids, session.settings.max_new_tokens)
    except OracleUnreliable as exc:
        Recorder(request.node).metric(oracle_errors=[str(exc).split(". ")[0]])
        pytest.fail(str(exc), pytrace=False)
    return oracle


@pytest.fixture
def kv_oracle_or_none(request: pytest.FixtureRequest, kv_engine_name: str, kv_model_name: str) -> StoredOracle | None:
    """``kv_oracle``, or None when no oracle covers the engine's strategy on this model (the reason is recorded
    as a declared limitation): for checks that still mean something without an oracle (same prompt, same tokens)."""
    try:
        return request.getfixturevalue("kv_oracle")
    except NotApplicable as exc:
        Recorder(request.node).metric(declared_skips=[str(exc.msg)])
        return None


@pytest.fixture
def kv_prompts(request: pytest.FixtureRequest, kv_model_name: str) -> list[Prompt]:
    """The current model's prompt set (lengths 1, short, long, past 256, around its sliding window and the
    run's eviction budgets)."""
    return _session(request, model=kv_model_name).prompts(kv_model_name)


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
