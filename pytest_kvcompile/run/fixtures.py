"""Fixtures for suites and downstream tests. Engine, model and prompt are parametrized from the run's options
(``plugin.pytest_generate_tests``); every fixture gets its collaborators through ``kv_session`` (the run's
`session.Session`, built by the plugin on first use) and ``kv_record``, never from a global."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pytest

from pytest_kvcompile.config.options import NO_ENGINE, Settings
from pytest_kvcompile.errors import NotApplicable, OracleUnreliable, Unjudgeable
from pytest_kvcompile.latency.marker import Probe
from pytest_kvcompile.models.prompts import Prompt, batch
from pytest_kvcompile.verdicts.collect import Recorder
from pytest_kvcompile.verdicts.failures import Where

if TYPE_CHECKING:  # torch-heavy: the fixtures module is imported by every run, they only when a fixture runs
    from pytest_kvcompile.oracles.reference import Reference
    from pytest_kvcompile.oracles.store import StoredOracle
    from pytest_kvcompile.oracles.token_match import Verdict
    from pytest_kvcompile.run.harness import EngineUnderTest
    from pytest_kvcompile.run.session import Session

UNAVAILABLE_PROMPT = Prompt("unavailable", ())


def _checked(session: Session, engine: str | None = "", model: str | None = "") -> Session:
    if engine is None:  # the "no-engine" parameter (the controller raises a usage error; an xdist worker lands here)
        pytest.fail(NO_ENGINE, pytrace=False)
    if model and session.models[model].unavailable:
        raise NotApplicable(f"model '{model}' unavailable: {session.models[model].unavailable}")
    return session


@pytest.fixture(scope="session")
def kv_settings(kv_session: Session) -> Settings:
    """The run's validated kvcompile options."""
    return kv_session.settings


@pytest.fixture
def kv_model(kv_session: Session, kv_model_name: str):
    """The ModelSpec of the current model (its checkpoint built if needed)."""
    return _checked(kv_session, model=kv_model_name).spec(kv_model_name)


@pytest.fixture
def kv_engine(kv_session: Session, kv_engine_name: str, kv_model_name: str) -> EngineUnderTest:
    """The current engine built for the current model, shared by every test in this process
    (``--kv-fresh-engine``: built for each test).

    Skips when the model is unavailable, or the engine does not declare the device, dtype
    or a capability the test asks for with ``@pytest.mark.kv_requires(...)``.
    """
    session = _checked(kv_session, kv_engine_name, kv_model_name)
    session.spec(kv_model_name)
    return session.engine(kv_engine_name, kv_model_name)


@pytest.fixture
def kv_oracle(kv_session: Session, kv_engine_name: str, kv_model_name: str) -> StoredOracle:
    """The engine's oracle on the current model (--kv-oracle: the oracle of its declared strategy, or an engine,
    oracles/engine.py). Its references are checked against an independent path (oracles.store: a transformers
    oracle each sequence it judges, the others the model's whole prompt set before the first test uses them): an
    oracle that fails that self-check SKIPS its token checks on the model as not judged (OracleUnreliable), never a
    verdict on the engine; an engine oracle without a reference for one prompt skips that prompt's checks alone."""
    session = _checked(kv_session, kv_engine_name, kv_model_name)
    oracle = session.oracle(kv_engine_name, kv_model_name)
    entry = session.models[kv_model_name]
    # a lazy oracle (oracles/store.py) self-checks each sequence it judges; the others replay the prompt set first
    for prompt in [] if oracle.lazy else session.prompts(kv_model_name) + batch(entry.vocab_size, entry.window):
        try:
            oracle.reference(prompt.ids, session.settings.max_new_tokens)  # OracleUnreliable: a skip, not judged
        except OracleUnreliable:
            if oracle.unreliable:  # the model's self-check failed: every token check on it is not judged
                raise
            # an engine oracle without a reference for this one prompt (oracles/engine.py): its tests skip alone
    session.collector.add(kv_engine_name, kv_model_name, oracle=oracle.facts())
    return oracle


@pytest.fixture
def kv_oracle_or_none(request: pytest.FixtureRequest, kv_record: Recorder) -> StoredOracle | None:
    """``kv_oracle``, or None when no oracle covers the engine's strategy on this model (the reason is recorded
    as a declared limitation): for checks that still mean something without an oracle (same prompt, same tokens)."""
    try:
        return request.getfixturevalue("kv_oracle")
    except OracleUnreliable:  # recorded as not judged by the token checks; these checks go on without it
        return None
    except NotApplicable as exc:
        if not isinstance(exc, Unjudgeable):  # a declaration that leaves nothing to judge excuses nothing
            kv_record.metric(declared_skips=[str(exc.msg)])
        return None


@pytest.fixture
def kv_prompts(kv_session: Session, kv_model_name: str) -> list[Prompt]:
    """The current model's prompt set (lengths 1, short, long, past 256, around its sliding window and the
    run's eviction budgets)."""
    return _checked(kv_session, model=kv_model_name).prompts(kv_model_name)


@pytest.fixture
def kv_prompt(kv_prompts: list[Prompt], kv_prompt_name: str) -> Prompt:
    """One prompt of the current model's set (parametrized)."""
    return next(p for p in kv_prompts if p.name == kv_prompt_name)


@pytest.fixture
def kv_batch(kv_session: Session, kv_model_name: str, kv_prompts) -> list[Prompt]:
    """A batch of prompts of different lengths for the current model."""
    entry = kv_session.models[kv_model_name]
    return batch(entry.vocab_size, entry.window)


@pytest.fixture
def kv_record(request: pytest.FixtureRequest, kv_session: Session) -> Recorder:
    """``kv_record(category, line, **metrics)``: a passing-but-notable fact (a near tie, a compile
    count) for the run's terminal summary; metrics go to the reports (see verdicts.rows.Recorder)."""
    return Recorder(request.node, kv_session.collector)


def _check_and_record(engine: EngineUnderTest, record: Recorder, reference: Reference, got: Sequence[int],
                      prompt: Prompt, where: Where | str = "alone") -> Verdict:
    """engine.check_tokens, with the verdict (or the mismatch) recorded for the reports."""
    from pytest_kvcompile.oracles.token_match import TokenMismatch

    __tracebackhide__ = True
    where = Where.of(where)
    try:
        verdict = engine.check_tokens(reference, got, prompt, where)
    except TokenMismatch:
        record.verdict(None, "", len(got), None)
        raise
    record.verdict(verdict, f"{engine.name} / {engine.spec.name} / {prompt.name} ({where.describe()})", len(got),
                   reference.evicted, _sequence(reference, got))
    return verdict


def _sequence(reference: Reference, got: Sequence[int]) -> str:
    """The key of a verified sequence (its prompt and the engine's tokens): one verified again counts once."""
    return hashlib.sha256(repr((tuple(reference.prompt), tuple(int(t) for t in got))).encode()).hexdigest()[:16]


@pytest.fixture
def kv_check_tokens(kv_engine: EngineUnderTest, kv_record: Recorder) -> Callable[..., Verdict]:
    """``kv_check_tokens(reference, got, prompt, where="alone")``: the engine's tokens `got` for `prompt` against
    the oracle's `reference` under the run's verdict rules (TokenMismatch says where and why), the verdict recorded
    for the reports. `where` is a `pytest_kvcompile.verdicts.failures.Where` (the row of a batch, the call number,
    the prompts served before: the failure's hint reads them) or a plain string shown as is."""

    def check_tokens(reference: Reference, got: Sequence[int], prompt: Prompt, where: Where | str = "alone") -> Verdict:
        __tracebackhide__ = True
        return _check_and_record(kv_engine, kv_record, reference, got, prompt, where)

    return check_tokens


@pytest.fixture
def kv_check_score(kv_engine: EngineUnderTest, kv_record: Recorder, kv_session: Session) -> Callable[..., float | None]:
    """``kv_check_score(reference, got, prompt)``: the engine's declared score() of its tokens `got` for `prompt`
    against the oracle's logits and against `got` (token_match.check_score; a server's log-probabilities where it
    gives them), the largest logit difference returned (None: nothing to check). Where the verdict numbers are
    measured (16-bit, a KV cache stored lower) and the oracle is the float64 truth they were measured against (not
    an engine, --kv-oracle), its steps beyond the dtype's median noise are recorded for the run's score() rate
    (verdicts/run_rules.py: RunRate)."""
    truth = getattr(kv_session.oracles.get(kv_engine.name), "ref", None) is None

    def check_score(reference: Reference, got: Sequence[int], prompt: Prompt) -> float | None:
        __tracebackhide__ = True
        scored = kv_engine.scored(prompt, got)
        worst = kv_engine.check_score(reference, got, prompt, scored)
        if scored is not None and kv_engine.noise is not None and reference.scored and truth:
            kv_record.metric(scored={_sequence(reference, got): [len(got),
                                                                 kv_engine.beyond_noise(reference, got, scored)]})
        return worst

    return check_score


@pytest.fixture
def kv_check(kv_check_tokens: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """Deprecated spelling of ``kv_check_tokens``."""
    warnings.warn("the kv_check fixture is deprecated: use kv_check_tokens (same arguments)",
                  pytest.PytestDeprecationWarning, stacklevel=2)
    return kv_check_tokens


@pytest.fixture
def kv_latency(request: pytest.FixtureRequest, kv_session: Session, kv_record: Recorder,
               kv_engine_name: str, kv_model_name: str) -> Probe:
    """Measure the test's engine: ``kv_latency.measure()`` (see pytest_kvcompile.latency)."""
    def engine(name: str | None) -> EngineUnderTest:
        __tracebackhide__ = True
        if name is None:
            return request.getfixturevalue("kv_engine")
        return kv_session.engine_named(name, kv_model_name, why=f"latency budget relative_to={name!r}")

    return Probe(request.node, engine, kv_record, kv_session.latency, kv_session.settings.device,
                 kv_session.settings.dtype)
