"""The verdict of each step of .ci/gpu-session (and of its --dry-run), read from the files the steps wrote.

    python benchmarks/gpu_session_report.py --mode gpu --out OUT --work WORK --steps "anchors captures ..." \\
        --dtypes "bfloat16 float16" --llama-engines "ref-..." --windowed-engines "ref-sliding-window ref-kv-shared"

One block per step: ``OK`` (it ran, and shows what it must), ``CUT`` (the session's deadline stopped it; what it
reached is listed), ``FINDING`` (it ran, and what it shows is wrong: a result about the tree, not about the session)
or ``ERROR`` (the session itself broke: a missing file, a usage error, a crash). Also joins the two anchor runs into
OUT/bench.json and OUT/bench.md. Exits 0 only when every step is OK: that is what a passing --dry-run means.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: what the session leaves in OUT (the device tool returns at most 8 files)
FILES = ("session.txt", "captures.txt", "latency.txt", "gpu-tests.txt", "suites.txt", "bench.log", "bench.json",
         "bench.md")
STEPS = ("anchors", "captures", "latency", "gpu-tests", "suites", "scale")
#: the two anchor runs (bench_strategies.py, side by side): family -> the seed anchors its table must hold
#: (ref-static-cudagraph, anchor c, is CUDA only: the CPU dry run cannot show it)
ANCHORS = {"llama": {"gpu": ("a", "c"), "dry": ("a",)}, "gemma4": {"gpu": ("b",), "dry": ("b",)}}
ORDER = ("OK", "FINDING", "CUT", "ERROR")
COUNTS = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")
VERDICT = re.compile(r"^(FAIL|NOT CHECKED|PASS with known findings|PASS)\s+(\S+): (.*)$")


@dataclass
class Run:
    """One step's output: its text, and the exit status the session appended (``[rc=N ...]``; None: it never ended)."""

    text: str
    rc: int | None

    @classmethod
    def read(cls, path: Path) -> Run | None:
        if not path.is_file():
            return None
        text = path.read_text(errors="replace")
        found = re.findall(r"^\[rc=(\d+)", text, re.M)
        return cls(text, int(found[-1]) if found else None)

    def counts(self) -> str:
        found = [line.strip("= ") for line in self.text.splitlines() if COUNTS.search(line)]
        return found[-1] if found else "no pytest summary line"

    def lines(self, pattern: str) -> list[str]:
        return [line.strip() for line in self.text.splitlines() if re.search(pattern, line)]

    def status(self) -> str:
        """From the exit status: 0 OK, 1 FINDING (tests failed), 2 / 124 / 137 CUT (interrupted, timed out)."""
        if self.rc is None:
            return "ERROR"
        return {0: "OK", 1: "FINDING", 2: "CUT", 124: "CUT", 137: "CUT"}.get(self.rc, "ERROR")


@dataclass
class Verdict:
    step: str
    status: str
    summary: str
    details: list[str] = field(default_factory=list)

    def render(self) -> str:
        return "\n".join([f"{self.status:<8} {self.step}: {self.summary}", *(f"           {d}" for d in self.details)])


def missing(step: str, path: Path) -> Verdict:
    return Verdict(step, "ERROR", f"{path.name} was not written: the step did not run (see session.txt)")


def captures(out: Path, mode: str) -> Verdict:
    """hf-static-compile's recompile + token suites: its line in the compile summary counts CUDA graph captures."""
    run = Run.read(out / "captures.txt")
    if run is None:
        return missing("captures", out / "captures.txt")
    lines = run.lines(r"^hf-static-compile / .*compile\(s\)")
    status = run.status()
    if status == "OK" and mode == "gpu" and not any("CUDA graph captures:" in line for line in lines):
        status = "FINDING"
        lines.append("no CUDA graph capture count in the compile summary (on CUDA it must be there)")
    return Verdict("captures", status, f"hf-static-compile, {run.counts()}", lines + run.lines(r"^FAILED |^ERROR "))


def latency(out: Path, mode: str) -> Verdict:
    """benchmarks/gpu_latency_budgets.py: the budget met must pass, its twin (0.001 ms/token) must fail."""
    run = Run.read(out / "latency.txt")
    if run is None:
        return missing("latency", out / "latency.txt")
    timer = "cuda-events" if mode == "gpu" else "perf_counter"
    within = run.lines(r"^(PASSED|FAILED) \S*::test_within_budget")
    twin = run.lines(r"^(PASSED|FAILED) \S*::test_twin_misses_budget")
    details = run.lines(r"median .* budget|timed with") + within + twin
    if run.status() in ("CUT", "ERROR"):
        return Verdict("latency", run.status(), f"rc={run.rc}, {run.counts()}", details)
    if not (within and twin):
        return Verdict("latency", "ERROR", f"the two tests did not both run: {run.counts()}", details)
    if within[0].startswith("FAILED"):
        return Verdict("latency", "FINDING", "the budget every engine meets (5 s prefill, 1 s/token) failed", details)
    if twin[0].startswith("PASSED"):
        return Verdict("latency", "FINDING", "the twin passed a 0.001 ms/token budget: absolute budgets NOT enforced",
                       details)
    if f"timed with {timer}" not in run.text:
        return Verdict("latency", "FINDING", f"the twin failed, but not timed with {timer}", details)
    return Verdict("latency", "OK", f"budget met: passed; twin over its budget: failed, as it must ({timer})", details)


def gpu_tests(out: Path, mode: str) -> Verdict:
    """tests/test_gpu.py: everything passes on CUDA; on a CPU everything skips, naming why (the dry run)."""
    run = Run.read(out / "gpu-tests.txt")
    if run is None:
        return missing("gpu-tests", out / "gpu-tests.txt")
    status, counts = run.status(), run.counts()
    if status == "OK" and mode == "gpu" and "passed" not in counts:
        status = "ERROR"  # all skipped on the GPU machine: torch there saw no CUDA
    note = "" if mode == "gpu" else " (no CUDA on this CPU: each skips, naming why)"
    return Verdict("gpu-tests", status, counts + note, run.lines(r"^(\[gw\d+\] )?(FAILED|ERROR) "))


def suites(work: Path, dtypes: list[str], groups: dict[str, list[str]], mode: str) -> Verdict:
    """.ci/gpu's runs: one log per dtype and model group, each with the plugin's verdict per engine. An engine NOT
    CHECKED is a finding, except in the dry run for an engine declared for CUDA only (ref-static-cudagraph)."""
    statuses, details, counts = [], [], []
    for dtype in dtypes:
        for group, engines in groups.items():
            if not engines:
                continue
            log = work / "suites" / f"gpu-{dtype}-{group}.log"
            run = Run.read(log)
            if run is None:
                statuses.append("ERROR")
                details.append(f"{dtype} {group}: {log.name} was not written")
                continue
            statuses.append(run.status())
            found = {m[2]: f"{m[1]}: {m[3]}" for m in map(VERDICT.match, run.text.splitlines()) if m}
            unchecked = [e for e in engines if found.get(e, "").startswith("NOT CHECKED") and not (
                mode == "dry" and f"engine '{e}' does not declare device 'cpu'" in run.text)]
            if unchecked:
                statuses.append("FINDING")
                details.append(f"{dtype} {group}: nothing checked on {', '.join(unchecked)}")
            counts.append(f"{dtype} {group}: {run.counts()} (rc={run.rc})")
            details += [f"{dtype} {e}: {found.get(e, 'not reached')}" for e in engines]
    summary = "; ".join(counts) or "no suite runs"
    return Verdict("suites", max(statuses or ["ERROR"], key=ORDER.index), summary, details)


def anchors(work: Path, out: Path, mode: str) -> Verdict:
    """The two bench_strategies.py runs: joined into bench.json / bench.md; each must hold its seed anchors."""
    joined, markdown, statuses, details = {}, [], [], []
    for family, expected in ANCHORS.items():
        run = Run.read(work / f"bench-{family}.log")
        path = work / f"bench-{family}.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        joined[family] = result if result is not None else {"error": f"{path.name} was not written"}
        ended = run is not None and run.rc in (0, 2, 124, 137)  # finished, or stopped by the deadline
        crash = [] if ended or run is None else [f"{family}: {line}" for line in run.text.splitlines()[-6:]]
        if result is None:
            statuses.append("CUT" if ended and run.rc else "ERROR")
            details += [f"{family}: no result ({'rc=' + str(run.rc) if run else 'no log'})", *crash]
            continue
        md = work / f"bench-{family}.md"
        markdown += [f"# {family}: `{result['command']}`", "", md.read_text() if md.is_file() else "(no Markdown)", ""]
        found = result.get("anchors", [])
        details += [f"({a['anchor']}) {a['what']}, {a['model']}, {a['shape']}: {a['measured']}" for a in found]
        lacking = [x for x in expected[mode] if not any(a["anchor"] == x for a in found)]
        skipped = [f"{s['what']}: {s['why']}" for s in result.get("skipped", [])]
        failed = [f"{k}: {v}" for g in result.get("groups", {}).values() for k, v in g.get("failed", {}).items()]
        if lacking:
            details += [f"{family}: no anchor {', '.join(lacking)}", *(f"{family}: {x}" for x in skipped + failed)]
            budget = any("--time-budget" in x for x in skipped + failed) or (ended and bool(run.rc))
            statuses.append("CUT" if budget else "FINDING" if ended else "ERROR")
        else:
            statuses.append("OK" if ended else "ERROR")
            if ended and run.rc:  # the tables were written; what came after them (the kvshared section) was cut
                details.append(f"{family}: stopped by the deadline (rc={run.rc}) after its anchors were written")
        details += crash
    (out / "bench.json").write_text(json.dumps(joined, indent=1, default=str))
    (out / "bench.md").write_text("\n".join(markdown) + "\n")
    found = sum(line.startswith("(") for line in details)
    return Verdict("anchors", max(statuses, key=ORDER.index), f"{found} anchor row(s), tables in bench.md", details)


def scale(work: Path, out: Path) -> Verdict:
    """bench_scale.py over the real shapes: every shape's token checks ran and passed; its table joins bench.md, each
    shape's wall time and the run's own peak-memory line (host, and each CUDA device's peak) are the details."""
    run = Run.read(work / "scale.log")
    if run is None:
        return missing("scale", work / "scale.log")
    path = work / "scale.json"
    found = json.loads(path.read_text()) if path.is_file() else []
    table = work / "scale.md"
    text = table.read_text() if table.is_file() else f"(no table: {run.counts()})"
    with (out / "bench.md").open("a") as md:
        md.write(f"# bench_scale.py\n\n{text}\n")
    details = [f"{m['shape']} {m['dtype']}: {m['parameters'] / 1e6:,.0f}M parameters, {m['wall_s']:,.0f} s, "
               f"{m['summary']}; {m.get('memory') or 'no peak-memory line'}" for m in found]
    status = run.status()
    if status == "OK" and not found:
        status = "ERROR"  # it exited 0 and measured nothing
    if status == "OK" and not all(m["exit"] == 0 and "passed" in m["summary"] for m in found):
        status = "FINDING"
    if status != "OK":
        details += run.text.strip().splitlines()[-6:]
    return Verdict("scale", status, f"{len(found)} shape(s) measured, table in bench.md", details)


def files(out: Path) -> Verdict | None:
    """Every file the session promises, and no more than the device tool returns."""
    lacking = [name for name in FILES if not (out / name).is_file()]
    if lacking:
        return Verdict("files", "ERROR", f"not written to {out}: {', '.join(lacking)}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("gpu", "dry"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", default=" ".join(STEPS))
    parser.add_argument("--dtypes", default="bfloat16 float16")
    parser.add_argument("--llama-engines", default="")
    parser.add_argument("--windowed-engines", default="")
    args = parser.parse_args(argv)
    steps = args.steps.split()
    found = []
    for step in STEPS:
        if step not in steps:
            continue
        if step == "anchors":
            found.append(anchors(args.work, args.out, args.mode))
        elif step == "captures":
            found.append(captures(args.out, args.mode))
        elif step == "latency":
            found.append(latency(args.out, args.mode))
        elif step == "gpu-tests":
            found.append(gpu_tests(args.out, args.mode))
        elif step == "scale":
            found.append(scale(args.work, args.out))
        else:
            found.append(suites(args.work, args.dtypes.split(),
                                {"llama": args.llama_engines.split(), "windowed": args.windowed_engines.split()},
                                args.mode))
    if set(steps) == set(STEPS):
        found += [v for v in [files(args.out)] if v]
    print("\n".join(v.render() for v in found))
    bad = [v.step for v in found if v.status != "OK"]
    print(f"session: {'OK, every step ran as it must' if not bad else 'NOT OK: ' + ', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
