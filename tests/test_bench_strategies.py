"""benchmarks/bench_strategies.py keeps running: its --quick mode on ref-sliding-window (with
hf-eager and hf-static-compile), aot_eager, the tiny Mistral.

Checks the plumbing (every engine built on the right model, side by side with the baselines, one row per
shape, the memory probe and the verdicts), never the speed: timings depend on the machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_strategies.py"


def test_quick_mode_runs_and_reports(tmp_path, zoo_cache):
    out = tmp_path / "perf.json"
    md = tmp_path / "perf.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVCOMPILE_CACHE_DIR": str(zoo_cache)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--backend", "aot_eager",
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
        assert row["prefill_ms"] > 0 and row["decode_tok_s"] > 0, row
    assert not any(g["failed"] for g in result["groups"].values()), result["groups"]

    ring = [m for m in result["memory"] if m["engine"] == "ref-sliding-window"]
    assert ring and len({m["kv_cache_bytes"] for m in ring}) == 1  # the ring: W slots, whatever the length
    assert [m["prompt"] for m in ring] == [4, 8, 32]  # below, at and above W=8

    targets = {(v["target"], v["engine"], v["model"]) for v in result["verdicts"]}
    assert ("decode >= 2x hf-eager", "ref-sliding-window", "mistral-tiny") in targets
    assert ("sliding-window KV memory flat past W", "ref-sliding-window", "mistral-tiny") in targets
    assert "| ref-sliding-window |" in md.read_text()
