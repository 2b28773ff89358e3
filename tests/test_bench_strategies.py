"""benchmarks/bench_strategies.py keeps running: its --quick mode on ref-sliding-window (with
hf-eager and hf-static-compile), aot_eager, the tiny Mistral, on --device cpu; a bfloat16 run of the anchors'
engines; a clear error for a device this torch cannot use; presets, engine selection per device, the
device-side weight builder and the time budget, in process.

Checks the plumbing (every engine built on the right model, side by side with the baselines, one row per
shape, the memory probe and the verdicts), never the speed: timings depend on the machine.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import import_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_strategies.py"


@pytest.mark.full  # the benchmark script end to end
def test_quick_mode_runs_and_reports(tmp_path, zoo_cache):
    out = tmp_path / "perf.json"
    md = tmp_path / "perf.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVCOMPILE_CACHE_DIR": str(zoo_cache)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--backend", "aot_eager", "--device", "cpu",
         "--engines", "ref-sliding-window", "--json", str(out), "--md", str(md)],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())

    assert result["machine"]["threads"] == 1
    assert [m["key"] for m in result["models"]] == ["mistral-tiny"]
    engines = [r["engine"] for r in result["speed"]]  # baselines first, then the family's engines
    assert engines == ["hf-eager", "hf-static-compile", "ref-sliding-window", "floor: weight matmuls only"], \
        result["groups"]
    for row in result["speed"]:
        assert (row["batch"], row["prompt"], row["new_tokens"]) == (1, 16, 4)
        assert row["prefill_ms"] > 0 and row["decode_tok_s"] > 0 and row["e2e_ms"] > 0, row
    assert result["skipped"] == []  # nothing declared off cpu/float32 among these
    assert not any(g["failed"] for g in result["groups"].values()), result["groups"]

    ring = [m for m in result["memory"] if m["engine"] == "ref-sliding-window"]
    assert ring and len({m["kv_cache_bytes"] for m in ring}) == 1  # the ring: W slots, whatever the length
    assert [m["prompt"] for m in ring] == [4, 8, 32]  # below, at and above W=8

    targets = {(v["target"], v["engine"], v["model"]) for v in result["verdicts"]}
    assert ("decode >= 2x hf-eager", "ref-sliding-window", "mistral-tiny") in targets
    assert ("sliding-window KV memory flat past W", "ref-sliding-window", "mistral-tiny") in targets
    assert "| ref-sliding-window |" in md.read_text()


def _run(tmp_path, zoo_cache, *args, timeout=240):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVCOMPILE_CACHE_DIR": str(zoo_cache)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=tmp_path)


@pytest.mark.full  # the benchmark script end to end
def test_bfloat16_run_reports_the_anchors(tmp_path, zoo_cache):
    """The anchors' engines in bfloat16 on the tiny Llama: rows with end-to-end times, anchor (a) printed, the static
    cache built for the one row timed (max_batch_size 1), no CUDA-graph engine on cpu."""
    out, md = tmp_path / "perf.json", tmp_path / "perf.md"
    proc = _run(tmp_path, zoo_cache, "--quick", "--dtype", "bfloat16", "--backend", "aot_eager", "--engines",
                "ref-compiled-dynamic,ref-static", "--baselines", "hf-eager", "--no-floor", "--sections", "speed",
                "--json", str(out), "--md", str(md))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["dtype"] == "bfloat16"
    assert [r["engine"] for r in result["speed"]] == ["hf-eager", "ref-compiled-dynamic", "ref-static"]
    static = next(r for r in result["speed"] if r["engine"] == "ref-static")
    assert "max_batch_size=1 (default 4)" in static["notes"]
    assert [a["anchor"] for a in result["anchors"]] == ["a"]
    assert result["anchors"][0]["e2e_x"] > 0
    text = md.read_text()
    assert "## Seed anchors" in text and "ref-compiled-dynamic vs hf-eager" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tmp_path, zoo_cache):
    proc = _run(tmp_path, zoo_cache, "--device", "cuda", "--quick", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--device cuda:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    proc = _run(tmp_path, zoo_cache, "--dtype", "float64", "--quick", timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_strategies")


def test_presets_give_the_real_shapes(bench):
    args = bench.parse_args(["--preset", "tinyllama"])
    llama = bench.large_config("llama", args)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.intermediate_size, llama.vocab_size) == (2048, 22, 32, 4, 64, 5632, 32000)
    gemma4 = bench.large_config("gemma4", args)
    assert (gemma4.hidden_size, gemma4.num_hidden_layers, gemma4.num_kv_shared_layers) == (2048, 12, 4)
    qwen = bench.large_config("llama", bench.parse_args(["--preset", "qwen3-0.6b"]))
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim, qwen.intermediate_size, qwen.vocab_size) == (1024, 28, 16, 8, 128, 3072, 151936)
    plain = bench.large_config("llama", bench.parse_args([]))  # no preset: the flags' old defaults
    assert (plain.hidden_size, plain.num_attention_heads, plain.num_key_value_heads, plain.intermediate_size) == (
        512, 8, 4, 1536)


def test_cuda_adds_the_cuda_graph_twin_and_cpu_skips_it(bench):
    engines, baselines, skipped = bench.select_engines(["ref-static", "ref-kv-shared"], ["hf-eager"], "cuda",
                                                       "bfloat16")
    assert engines == ["ref-static", "ref-static-cudagraph", "ref-kv-shared"] and baselines == ["hf-eager"]
    assert skipped == {}
    engines, _, skipped = bench.select_engines(["ref-static", "ref-static-cudagraph"], ["hf-eager"], "cpu", "float32")
    assert engines == ["ref-static"] and "devices=['cuda']" in skipped["ref-static-cudagraph"]


def test_weights_built_on_the_device_are_the_zoos(bench, tmp_path):
    """On cpu, build_random draws exactly zoo._build_model's weights (same generator, order and gains)."""
    from safetensors.torch import load_file

    from pytest_kvcompile.models import zoo

    config = zoo.ZOO["llama"].build_config()
    bench.build_random(config, tmp_path / "m", "cpu", torch.float32)
    built = load_file(tmp_path / "m" / "model.safetensors")
    want = zoo._build_model(config).state_dict()
    assert built.keys() <= want.keys() and built
    for name, tensor in built.items():
        assert torch.equal(tensor, want[name]), name


def test_time_budget_spent_builds_nothing(bench, zoo_cache, monkeypatch):
    from transformers import AutoConfig

    from pytest_kvcompile.contract.engine import ModelSpec
    from pytest_kvcompile.models import zoo

    monkeypatch.setattr(bench.recompiles, "reset_dynamo", lambda: None)  # keep this process's dynamo as it is
    path = zoo.checkpoint("llama", zoo_cache)
    model = bench.Model("llama-tiny", "llama", "tiny", ModelSpec("llama-tiny", path, AutoConfig.from_pretrained(path)))
    args = bench.parse_args(["--quick", "--no-floor"])
    args.deadline = time.perf_counter() - 1
    out = bench.measure_group(model, ["hf-eager", "ref-static"], [(1, 16)], args)
    assert out["rows"] == [] and out["build_s"] == {}
    spent = "not built: --time-budget spent"
    assert out["failed"] == {"hf-eager": spent, "ref-static": spent,
                             "batch 1, prompt 16": "not measured: --time-budget spent"}


def test_anchor_ratios(bench):
    """The three seed anchors from a speed table like a CUDA run's (the CUDA-graph engine cannot run here)."""
    def row(model, engine, prefill, decode, e2e, prompt=128):
        return {"model": model, "engine": engine, "batch": 1, "prompt": prompt, "new_tokens": 64,
                "prefill_ms": prefill, "decode_ms": decode, "decode_tok_s": 64e3 / decode, "repeats": 3, "notes": [],
                "e2e_ms": e2e}

    result = {"models": [{"key": "llama-large", "about": "", "layers": 22, "shared": 0},
                         {"key": "gemma4-large", "about": "", "layers": 12, "shared": 4}],
              "speed": [row("llama-large", "hf-eager", 20, 1200, 1220),
                        row("llama-large", "ref-compiled-dynamic", 10, 500, 510),
                        row("llama-large", "ref-static", 10, 400, 410),
                        row("llama-large", "ref-static-cudagraph", 10, 200, 205),
                        row("gemma4-large", "hf-eager", 30, 1500, 1530, 1024),
                        row("gemma4-large", "ref-compiled-dynamic", 40, 600, 640, 1024),
                        row("gemma4-large", "ref-kv-shared", 30, 600, 630, 1024)],
              "kv_shared": [{"mode": "eager", "command": "bench_kv_shared_prefill.py --threads 1", "device": "cpu",
                             "measured": 0.45, "theoretical": 0.5, "flops": 0.48, "full_ms": 16.6, "skip_ms": 9.7}],
              "groups": {}, "compile": [], "memory": [], "verdicts": []}
    found = bench.anchors(result)
    by = {(a["anchor"], a["model"]): a for a in found}
    a = by[("a", "llama-large")]
    assert a["decode_x"] == pytest.approx(2.4) and a["e2e_x"] == pytest.approx(1220 / 510)
    c = by[("c", "llama-large")]
    assert c["e2e_cut_vs_ref-static"] == pytest.approx(1 - 205 / 410)
    assert c["e2e_cut_vs_hf-eager"] == pytest.approx(1 - 205 / 1220)
    assert c["decode_x_vs_ref-static"] == pytest.approx(2.0)
    b = by[("b", "gemma4-large")]
    assert b["saving"] == pytest.approx(0.25) and b["theory"] == pytest.approx(4 / 12 * 1023 / 1024)
    assert any(x["anchor"] == "b" and x["saving"] == 0.45 for x in found)  # bench_kv_shared_prefill.py's row
    text = bench.markdown(result)
    assert "## Seed anchors" in text and "50% cut" in text and "16.60 -> 9.70 ms" in text
