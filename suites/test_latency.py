"""Latency: prefill and decode per token of every engine on every model, recorded for the run's
reports (the rule: ``pytest_kvcompile.latency.measure``); ``--kv-latency-budget`` applies, e.g.
``relative_to=hf-eager,factor=1.1``. With pytest-benchmark installed and enabled: prefill and decode
benchmarks, with engine, model, device, dtype and versions in ``extra_info``."""

from importlib.metadata import version

import pytest
import torch

from pytest_kvcompile.contract.engine import dtype_name
from pytest_kvcompile.latency.measure import DECODE_TOKENS, PROMPT_LEN, WARMUP, fresh


def test_latency(kv_engine, kv_latency):
    kv_latency.measure(kv_engine)


def _benchmark(request: pytest.FixtureRequest):
    if not request.config.pluginmanager.hasplugin("benchmark"):
        pytest.skip("pytest-benchmark is not installed (pip install pytest-benchmark) or disabled with -p no:benchmark")
    benchmark = request.getfixturevalue("benchmark")
    if benchmark.disabled:
        benchmark.skipped = True  # pytest-benchmark's own flag: else it warns "fixture was not used at all"
        pytest.skip("pytest-benchmark is disabled in this run: it turns itself off under pytest-xdist (-n) and with "
                    "--benchmark-disable; run without -n to benchmark")
    return benchmark


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_benchmark(request, kv_session, kv_engine, step):
    """prefill: generate([prompt], 1); decode: generate([prompt], 1 + K), so decode ms/token =
    (decode - prefill) / K (see pytest_kvcompile.latency.measure)."""
    benchmark = _benchmark(request)
    spec = kv_engine.spec
    prompts = fresh(PROMPT_LEN, spec.vocab_size)  # a prompt per round: a prompt cache cannot answer a timed call
    n = 1 if step == "prefill" else 1 + DECODE_TOKENS
    kv_engine.generate([next(prompts)], n)  # validated once: a broken engine fails with a clear message
    benchmark.group = f"{spec.name} {step}"
    benchmark.extra_info.update(
        engine=kv_engine.name, model=spec.name, device=spec.device, dtype=dtype_name(spec.dtype), step=step,
        prompt_len=PROMPT_LEN, max_new_tokens=n, decode_tokens=DECODE_TOKENS if step == "decode" else 0,
        torch=torch.__version__, transformers=version("transformers"),
    )
    benchmark.pedantic(kv_engine.engine.generate, setup=lambda: (([list(next(prompts).ids)], n), {}),
                       warmup_rounds=WARMUP, rounds=kv_session.latency.repeats, iterations=1)
