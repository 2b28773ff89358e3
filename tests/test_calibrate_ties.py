"""benchmarks/calibrate_ties.py: a quick CPU run (float32, tiny Llama, eager backend, 2 prompts) with two correct
engines, a CUDA-only one (listed as skipped) and a deliberately wrong one (tests/kv_test_engines.py's
WrongLateToken: large gaps), checked through its JSON; the gap arithmetic directly; a clear error for a device
this torch cannot use."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import import_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate_ties.py"
TESTS_DIR = Path(__file__).resolve().parent


def _run(tmp_path, zoo_cache, *args, timeout=240):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVCOMPILE_CACHE_DIR": str(zoo_cache),
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=tmp_path)


@pytest.fixture(scope="module")
def calibrate():
    return import_benchmark("calibrate_ties")


@pytest.mark.full  # the benchmark script end to end
def test_quick_cpu_run(tmp_path, zoo_cache):
    out, md = tmp_path / "ties.json", tmp_path / "ties.md"
    proc = _run(tmp_path, zoo_cache, "--dtypes", "float32", "--models", "llama", "--prompts", "2", "--new-tokens", "6",
                "--backend", "eager", "--engines",
                "hf-eager,ref-compiled-dynamic,ref-static-cudagraph,kv_test_engines:WrongLateToken",
                "--json", str(out), "--md", str(md))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())

    assert result["current"]["tie_tolerance"]["float32"] == 1e-3
    (group,) = result["groups"]
    assert (group["dtype"], group["model"]) == ("float32", "llama")
    rows = {r["engine"]: r for r in group["rows"]}
    assert list(rows) == ["hf-eager", "ref-compiled-dynamic", "kv_test_engines:WrongLateToken"]
    for row in rows.values():
        assert (row["prompts"], row["steps"]) == (2, 12) and "error" not in row, row
        for key in ("divergences", "sequences_diverged", "max_per_sequence", "rate", "max_gap", "p50", "p99",
                    "p99.9", "over_tolerance", "gaps", "float64"):
            assert key in row, key
    for name in ("hf-eager", "ref-compiled-dynamic"):  # correct, float32: at most a near tie
        assert rows[name]["max_gap"] <= 1e-3 and rows[name]["over_tolerance"] == 0, rows[name]
    wrong = rows["kv_test_engines:WrongLateToken"]  # its token two before the end is off by one, in every sequence
    assert wrong["sequences_diverged"] == 2 and wrong["max_gap"] > 0.5 and wrong["over_tolerance"] >= 2, wrong
    assert wrong["float64"]["max_gap"] > 0.5
    assert len(wrong["gaps"]) == wrong["divergences"] and min(wrong["gaps"]) > 0

    (skip,) = group["skipped"]
    assert skip["engine"] == "ref-static-cudagraph" and "devices=['cuda']" in skip["reason"]
    oracle = group["oracle"]
    assert oracle["steps"] == 12 and oracle["max_gap"] <= 1e-3 and "float64" in oracle["path"]
    assert oracle["margin"]["steps"] == 12 and oracle["margin"]["p50"] > 0

    summary = result["summary"]["float32"]  # the wrong engine is a suspect, not evidence for a wider tolerance
    assert summary["current_tie_tolerance"] == 1e-3 and summary["engines"] == 2 and summary["max_gap"] <= 1e-3
    assert summary["suggested_tie_tolerance"] is None or summary["suggested_tie_tolerance"] <= 2e-3
    (suspect,) = summary["suspects"]
    assert suspect.startswith("kv_test_engines:WrongLateToken on llama")
    text = md.read_text()
    assert "| float32 | llama | ref-compiled-dynamic |" in text and "ref-static-cudagraph" in text
    assert "suggested auto tie tolerance" in proc.stdout and "SUSPECT" in proc.stdout
    assert "Suspects" in text


def test_gap_arithmetic(calibrate):
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.25, 0.5], [-1.0, -2.0, -4.0]])
    assert calibrate.step_gaps(logits, [1, 2, 2]) == [0.0, 0.0, 3.0]  # argmax, an exact tie, 3 behind
    assert calibrate.step_gaps(logits, [0, 1, 0]) == [2.0, 0.25, 0.0]
    assert calibrate.top2_margins(logits) == [1.0, 0.0, 1.0]

    stats = calibrate.gap_stats([[0.0, 2.0, 0.0], [0.5, 0.0, 0.25], [0.0, 0.0, 0.0]], tolerance=0.3)
    counts = (stats["steps"], stats["divergences"], stats["sequences_diverged"], stats["max_per_sequence"])
    assert counts == (9, 3, 2, 2)
    assert (stats["max_gap"], stats["p50"], stats["p99"], stats["over_tolerance"]) == (2.0, 0.5, 2.0, 2)
    assert stats["gaps"] == [0.25, 0.5, 2.0] and stats["rate"] == pytest.approx(1 / 3)
    empty = calibrate.gap_stats([[0.0] * 4])
    assert (empty["divergences"], empty["max_gap"], empty["p50"]) == (0, 0.0, None)

    assert [calibrate.clean_ceiling(x) for x in (0.0, 1e-5, 0.094, 0.1, 0.1001, 0.16, 0.2250001, 4.2, 8.0)] == [
        0.0, 1e-5, 0.1, 0.1, 0.15, 0.2, 0.3, 5.0, 10.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tmp_path, zoo_cache):
    proc = _run(tmp_path, zoo_cache, "--device", "cuda", timeout=120)
    assert proc.returncode == 2 and "--device cuda:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = _run(tmp_path, zoo_cache, "--dtypes", "float64", timeout=120)
    assert proc.returncode == 2 and "--dtypes" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
