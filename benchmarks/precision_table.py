"""The measured tables of docs/precision.md: per zoo model and 16-bit dtype, the noise the rule measured
(pytest_kvcompile/oracles/precision.py), the tolerance and budgets it derived, the near-tie rate of correct
engines run through the suites' token checks (their JSON report: near-tie tokens / verified tokens), and the power
table (issue 44): positions verified per engine, the measured flip rate, the chance a 5x engine fails there
(verdicts/run_rules.py: RunRate), and the score() rate beside the computations'.

    python benchmarks/precision_table.py --md precision-table.md          # hf-eager + reference engines, ~15 min
    python benchmarks/precision_table.py --engines hf-eager --dtypes bfloat16 --models llama

Each (dtype, engine) is one pytest run of suites/ (token checks, every model given) under
--kv-compile-backend (default aot_eager: the reference engines' guards and numerics of their graphs, at a fraction
of inductor's compile time) writing --kv-report-json; the noise columns are the rows' "noise", the eviction table
their "eviction_noise" (scoring eviction policies).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("hf-eager", "ref-compiled-dynamic", "ref-static", "ref-sliding-window", "ref-kv-shared", "ref-streaming-llm",
           "ref-h2o", "ref-tova")
MODELS = ("llama", "mistral-sw", "gemma3-hybrid", "gemma4-kvshared", "gpt2-abspos")
CHECKS = "token_identity or batch_consistency or stale_state or determinism or shared_prefixes or near_tie_rate"


def run(engine: str, dtype: str, models: list[str], backend: str, out: Path) -> dict:
    report = out / f"{engine}-{dtype}.json"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "suites"), f"--kv-engine={engine}", f"--kv-dtype={dtype}",
           f"--kv-zoo={','.join(models)}", f"--kv-compile-backend={backend}", "-k", CHECKS, "-q",
           "-p", "no:cacheprovider", "-p", "no:benchmark", f"--kv-report-json={report}", "--rootdir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"{engine} {dtype}: exit {proc.returncode}: {last}", flush=True)
    rows = json.loads(report.read_text())["rows"] if report.exists() else []
    return {"engine": engine, "dtype": dtype, "exit": proc.returncode, "summary": last, "rows": rows}


def markdown(runs: list[dict]) -> str:
    noise: dict[tuple[str, str], dict] = {}
    rates: dict[tuple[str, str], list[str]] = {}
    for r in runs:
        for row in r["rows"]:
            if row.get("noise"):
                noise[(row["model"], row["dtype"])] = row["noise"]
            if row.get("verified_tokens"):
                rate = row["near_tie_tokens"] / row["verified_tokens"]
                failed = row["tests"].get("failed", 0) + row["tests"].get("error", 0)
                rates.setdefault((row["model"], row["dtype"]), []).append(
                    f"{row['engine']} {rate:.1%}{' FAILED' if failed else ''}")
    lines = ["| model | dtype | noise scale (p99) | max error | tie tolerance | flip rate (bound) "
             "| near ties / sequence of 16 | score() tolerance | transformers' own path vs truth "
             "| correct engines: near-tie rate |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for (model, dtype), n in sorted(noise.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        own = next(iter(n["per_computation"].values()))
        lines.append(f"| {model} | {dtype} | {n['scale']:.3g} | {n['max_error']:.3g} | {n['tolerance']:.3g} | "
                     f"{n['flip_rate']:.1%} ({n['flip_rate_bound']:.1%}) | {_budget(n)} | {n['score_tolerance']:.3g} | "
                     f"{own['flips']}/{n['positions']} flips | {', '.join(rates.get((model, dtype), [])) or '-'} |")
    evictions = {(row["model"], row["dtype"], row["eviction_noise"]["policy"]): row["eviction_noise"]
                 for r in runs for row in r["rows"] if row.get("eviction_noise")}
    if evictions:
        lines += ["", "| model | dtype | policy | cuts | score noise (p99, relative) | max error "
                  "| eviction tie tolerance | cuts kept otherwise by the 16-bit computation |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {model} | {dtype} | `{policy}` | {n['cuts']} | {n['scale']:.3g} | {n['max_error']:.3g} | "
                  f"{n['tolerance']:.3g} | {n['flips']} |" for (model, dtype, policy), n in sorted(evictions.items())]
    lines += ["", *power_table(runs)]
    verdicts = [f"- `{r['engine']}` {r['dtype']}: exit {r['exit']}, {r['summary']}" for r in runs]
    return "\n".join(lines + ["", *verdicts]) + "\n"


def power_table(runs: list[dict]) -> list[str]:
    """Per model, dtype and engine: the run-level rates (RunRate) over the positions its run verified."""
    from pytest_kvcompile.verdicts.failures import Kind
    from pytest_kvcompile.verdicts.rows import Row
    from pytest_kvcompile.verdicts.run_rules import run_rates

    lines = ["| model | dtype | calibration: positions, flips | flip rate (bound) | positions the check adds | engine "
             "| positions verified | its near-tie rate, p | a 5x engine fails | score() beyond the noise: engine vs "
             "computations (bound), p |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    found = sorted(((row["dtype"], row["model"], row["engine"]), row) for r in runs for row in r["rows"]
                   if row.get("noise") and not row["noise"].get("kv_dtype"))
    for (dtype, model, engine), row in found:
        n = row["noise"]
        rates = {rate.kind: rate for rate in run_rates(Row.from_json(row, f"{engine} / {model}"))}
        ties, scored = rates.get(Kind.RUN_DRIFT), rates.get(Kind.LOGIT_DRIFT)
        if ties is None or not ties.positions:
            continue
        logits = (f"{scored.rate:.1%} vs {scored.measured:.1%} ({scored.bound:.1%}), p = {scored.p_value:.2g}"
                  if scored and scored.positions else "- (no score())")
        lines.append(f"| {model} | {dtype} | {n['positions']}, {n['flips']} | {n['flip_rate']:.2%} "
                     f"({n['flip_rate_bound']:.2%}) | {n.get('positions_needed', '-')} | {engine} | {ties.positions} | "
                     f"{ties.rate:.2%}, p = {ties.p_value:.2g} | {ties.power:.0%} | {logits} |")
    return lines


def _budget(n: dict) -> int:
    from pytest_kvcompile.oracles.precision import budget

    return budget(16, n["flip_rate_bound"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            for engine in args.engines.split(","):
                runs.append(run(engine, dtype, args.models.split(","), args.backend, Path(tmp)))
    text = markdown(runs)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
