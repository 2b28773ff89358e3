"""``@pytest.mark.latency_budget`` on a real engine, next to its twin that misses its budget (.ci/gpu-session).

    python -m pytest benchmarks/gpu_latency_budgets.py --kv-engine=ref-static-cudagraph --kv-device=cuda \\
        --kv-zoo=llama -p no:benchmark -rA

Absolute budgets are enforced on CUDA: test_within_budget must PASS (5 s prefill, 1 s per token: any engine on a
GPU) and its twin test_twin_misses_budget (1 microsecond per token, which no engine meets) must FAIL, its medians
"timed with cuda-events". On CPU absolute budgets are only recorded: the same run needs --kv-enforce-latency (what
the session's --dry-run passes). tests/test_gpu.py::test_absolute_latency_budgets_are_enforced_on_cuda checks the
same through --kv-latency-budget.
"""

import pytest


@pytest.mark.latency_budget(prefill_ms=5000, decode_ms_per_token=1000)
def test_within_budget(kv_engine, kv_latency):
    kv_latency.measure(kv_engine)


@pytest.mark.latency_budget(decode_ms_per_token=0.001)
def test_twin_misses_budget(kv_engine, kv_latency):
    kv_latency.measure(kv_engine)
