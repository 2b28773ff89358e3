"""The GPU checks (issue 17): CUDA-graph engine, CUDA-graph re-capture detection, CUDA memory and latency budgets.

Each check runs next to its broken-engine twin (tests/kv_test_engines_static.py), which must FAIL. Everything
here needs a CUDA device and is skipped, with the reason, elsewhere; results of the last GPU run are in
docs/gpu-results.md.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from conftest import run_suites  # noqa: E402
from pytest_kvcompile.contract.engine import ModelSpec  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.recompiles.recorder import CompileRecorder, RecompileError, expect_no_recompiles  # noqa: E402
from reference_impls.static_cache import StaticCacheCudaGraph  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU check: torch sees no CUDA device here (run on a GPU runner, "
                                       "docs/gpu-results.md)")

CUDA = "--kv-device=cuda"
STATIC = "--kv-engine=kv_test_engines_static:"


@pytest.fixture(scope="module")
def llama_cuda(zoo_cache) -> ModelSpec:
    path = zoo.checkpoint("llama", zoo_cache)
    return ModelSpec("llama", path, AutoConfig.from_pretrained(path), device="cuda")


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed + length)).tolist()


# --- 16-bit compiles (issue 30) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_compiled_reference_engines_compile_in_16_bit_on_cuda(kvtester, dtype):
    """SDPA's fused CUDA backends guard `Eq(u0, 1)` on the unbacked prompt width (torch 2.11):
    reference_impls.model.sdpa holds compiled 16-bit CUDA attention to the math backend. Without it every engine here
    errors at its first call."""
    result = run_suites(kvtester, "--kv-engine=ref-compiled-dynamic", "--kv-engine=ref-static", CUDA,
                        f"--kv-dtype={dtype}", "-k", "token_identity or recompiles")
    assert result.ret == 0, result.stdout.str()[-4000:]
    result.stdout.fnmatch_lines(["*ref-compiled-dynamic / llama: *, 0 after warmup over*"])


# --- ref-static-cudagraph ------------------------------------------------------------------------------------------
def test_the_cudagraph_engine_passes_the_suite_on_cuda(kvtester):
    result = run_suites(kvtester, "--kv-engine=ref-static-cudagraph", CUDA,
                        "-k", "token_identity or recompiles or stale_state or memory or batch_consistency")
    assert result.ret == 0, result.stdout.str()[-4000:]
    result.stdout.fnmatch_lines(["*CUDA graph captures: 1 while building, 0 in warmup, 0 after*"])


def test_one_graph_is_captured_at_build_and_replayed_after(llama_cuda):
    with CompileRecorder() as recorder:
        engine = StaticCacheCudaGraph(llama_cuda)  # compiles decode and captures its graph
        engine.generate([prompt(5)], 8)  # compiles the prefill
        recorder.mark_warmup_done()
        replays = []
        replay = engine.graph.replay
        engine.graph.replay = lambda: (replays.append(1), replay())[1]
        for lengths in [(7,), (1, 48), (23, 5, 2), (3, 9, 17, 30), (64,) * 6]:
            engine.generate([prompt(n) for n in lengths], 8)
    assert len(recorder.captures) == 1, recorder.captures
    assert recorder.captures[0].startswith("torch.cuda.CUDAGraph capture in StaticCacheCudaGraph._capture ("), \
        recorder.captures
    assert recorder.post_warmup_captures == [] and recorder.post_warmup_events == []
    assert len(replays) == 7 * 6  # 7 decode steps per chunk: 4 single chunks, the batch of 6 in two (max_batch_size=4)


# --- re-capture is a recompile -------------------------------------------------------------------------------------
def test_a_graph_captured_per_batch_size_fails_the_recompile_check(kvtester):
    result = run_suites(kvtester, STATIC + "RecapturePerBatch", CUDA, "-k", "no_recompiles_after_warmup")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*CUDA graph capture(s) after warmup, 0 allowed: a new graph was recorded for a shape warmup did not "
        "capture (generate(<3 prompt(s) of lengths*",
        "*CUDA graph capture after warmup: torch.cuda.CUDAGraph capture in StaticCacheCudaGraph._capture (*) called "
        "from RecapturePerBatch._prefill (*kv_test_engines_static.py:*)*",
    ])


def test_cudagraph_trees_recording_a_new_shape_after_warmup_fails_no_recompile():
    step = torch.compile(lambda x: (x * 2).sum(0), mode="reduce-overhead", dynamic=True)
    for _ in range(3):  # cudagraph trees: a warmup run, then the recording
        step(torch.ones(4, 8, device="cuda"))
    with pytest.raises(RecompileError, match=r"(?s)CUDA graph capture\(s\) after warmup.*cudagraph trees"):
        with expect_no_recompiles(warmup=True) as recorder:
            step(torch.ones(4, 8, device="cuda"))
            recorder.mark_warmup_done()
            for _ in range(3):
                step(torch.ones(16, 8, device="cuda"))
    with expect_no_recompiles() as recorder:  # the shapes it recorded replay: nothing captured
        for _ in range(3):
            step(torch.ones(4, 8, device="cuda"))
    assert recorder.captures == []


def test_the_no_recompile_marker_counts_captures(pytester):
    pytester.makepyfile("""
        import pytest, torch

        @pytest.mark.no_recompile(warmup=True)
        def test_recaptures(kv_compile_recorder):
            x = torch.ones(8, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x * 2
            kv_compile_recorder.mark_warmup_done()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x * 3
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*1 CUDA graph capture(s) after warmup, 0 allowed*",
                                 "*torch.cuda.CUDAGraph capture in test_recaptures (*"])


# --- a stale graph buffer fails token identity ---------------------------------------------------------------------
def test_returning_the_previous_replays_output_fails_token_identity(kvtester):
    result = run_suites(kvtester, STATIC + "StaleGraphOutput", CUDA, "-k", "token_identity and short7 and not batched")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*StaleGraphOutput' diverges from the oracle on model 'llama', prompt 'short7'*"])


# --- CUDA memory ----------------------------------------------------------------------------------------------------
def test_memory_held_only_by_the_cuda_allocator_counts(kvtester):
    result = run_suites(kvtester, STATIC + "HiddenWorkspace", CUDA, "-k", "memory_held")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*growth of torch.cuda.memory_allocated() while the engine was built and during its "
                                 "generate() calls*"])


def test_limit_memory_on_cuda_measures_the_peak(pytester):
    pytester.makepyfile("""
        import pytest, torch

        @pytest.mark.limit_memory("4 MiB", device="cuda")
        def test_within():
            torch.empty(2 * 1024 * 1024, dtype=torch.uint8, device="cuda")

        @pytest.mark.limit_memory("4 MiB", device="cuda")
        def test_peak_over_then_freed():
            x = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
            del x
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["limit_memory: test allocated 67,108,864 B (64.0 MiB), limit 4 MiB (4,194,304 B)"])


# --- latency budgets: enforced on CUDA, timed with CUDA events ------------------------------------------------------
@pytest.mark.parametrize("budget, outcome", [("decode_ms_per_token=1000,prefill_ms=5000", "passed"),
                                             ("decode_ms_per_token=0.001", "failed")])
def test_absolute_latency_budgets_are_enforced_on_cuda(kvtester, budget, outcome):
    result = run_suites(kvtester, "--kv-engine=ref-static-cudagraph", CUDA, f"--kv-latency-budget={budget}",
                        "-k", "test_latency")
    result.assert_outcomes(**{outcome: 1}, skipped=2)  # the pytest-benchmark tests: -p no:benchmark
    if outcome == "failed":
        result.stdout.fnmatch_lines(["*decode median * budget 0.001*", "*timed with cuda-events*"])
