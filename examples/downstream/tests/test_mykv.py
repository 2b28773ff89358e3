"""mykv's own tests, written with pytest-kvcompile's markers and fixtures (the conformance suites run apart:
pytest --pyargs pytest_kvcompile.suites). The model comes from the plugin's tiny zoo (ini: kv_zoo = "llama")."""

import pytest
from pytest_kvcompile import HFEagerOracle, check_tokens

from mykv.engine import StaticDecode

PROMPT = [5, 17, 42, 99, 3, 64, 8]


@pytest.fixture
def engine(kv_model, kv_settings):
    return StaticDecode(kv_model, compile_backend=kv_settings.compile_backend)


@pytest.mark.no_recompile(warmup=True)
def test_decode_compiles_once(engine, kv_compile_recorder):
    engine.generate([PROMPT], 4)  # warmup: the decode step compiles here
    kv_compile_recorder.mark_warmup_done()
    engine.generate([PROMPT[:3]], 20)  # other prompt length, other positions: nothing may compile
    engine.generate([PROMPT * 4], 8)


def test_tokens_match_the_oracle(engine, kv_model):
    got = engine.generate([PROMPT], 12)[0]
    reference = HFEagerOracle(kv_model).reference(PROMPT, 12)
    check_tokens(reference, got, engine="mykv", model=kv_model.name)


@pytest.mark.limit_memory("32 MiB")
def test_a_call_allocates_little(engine):
    engine.generate([PROMPT], 8)  # the cache is preallocated once; a call must not allocate another


@pytest.mark.latency_budget(relative_to="hf-eager", factor=3.0)
def test_decode_no_slower_than_3x_transformers(kv_engine, kv_latency):
    kv_latency.measure(kv_engine)
