"""The lent-GPU session (.ci/gpu-session) cannot go stale silently: its --dry-run runs the GPU run's steps into the
same files, every reference engine of the registry is in its engine lists (and in .ci/gpu's), the benchmark flags it
passes parse, and its report tells a step that showed what it must from one that broke. Cheap: --plan runs nothing;
the whole dry run (minutes) is run by hand before GPU minutes are spent (docs/gpu-results.md)."""

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import import_benchmark
from pytest_kvcompile.contract.registry import BUILTIN_ENGINES

ROOT = Path(__file__).resolve().parent.parent
SESSION = ROOT / ".ci" / "gpu-session"
GPU_JOB = ROOT / ".ci" / "gpu"
REFERENCE = {name for name in BUILTIN_ENGINES if name.startswith("ref-")}
DRY_ONLY = {"--quick", "--kv-enforce-latency"}  # the dry run's tiny sizes; CPU latency budgets enforced on request
report = import_benchmark("gpu_session_report")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("STEPS", "DEADLINE", "CHECKS", "OUT", "WORK")}


def plan(*flags: str) -> dict:
    text = subprocess.run(["bash", str(SESSION), "--plan", *flags], capture_output=True, text=True, check=True,
                          cwd=ROOT, env=clean_env(), timeout=60).stdout
    found = {"steps": []}
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        if key == "step":
            head, _, command = rest.partition(": ")
            name, _, files = head.partition(" -> ")
            found["steps"].append((name, files.split(), shlex.split(command)))
        elif key == "engines":
            what, _, lists = rest.partition(" ")
            found[f"engines {what}"] = [group.split() for group in lists.split("|")]
        else:
            found[key] = rest
    return found


@pytest.fixture(scope="module")
def plans() -> tuple[dict, dict]:
    return plan(), plan("--dry-run")


def test_the_scripts_parse():
    for script in (SESSION, GPU_JOB):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_the_dry_run_runs_the_gpu_runs_steps_into_the_same_files(plans):
    gpu, dry = plans
    assert (gpu["mode"], gpu["device"], dry["mode"], dry["device"]) == ("gpu", "cuda", "dry", "cpu")
    assert gpu["files"] == dry["files"]
    files = gpu["files"].split()
    assert tuple(files) == report.FILES and len(files) <= 8, "the device tool returns at most 8 files"
    assert [(name, out) for name, out, _ in gpu["steps"]] == [(name, out) for name, out, _ in dry["steps"]]
    assert {name for name, _, _ in gpu["steps"]} == set(report.STEPS)
    assert {f for _, out, _ in gpu["steps"] for f in out} | {"session.txt"} == set(files)
    assert int(gpu["deadline"]) <= 600 - 60, "one device command is at most 10 minutes, with time to interrupt"
    for (name, _, on_gpu), (_, _, on_cpu) in zip(gpu["steps"], dry["steps"]):
        options = [{word.partition("=")[0] for word in command if word.startswith("--")} for command in (on_gpu,
                                                                                                          on_cpu)]
        assert options[0] <= options[1] and options[1] - options[0] <= DRY_ONLY, (name, options)
        scripts = [word for word in on_gpu if word.endswith(".py") or word.startswith((".ci/", "suites/", "tests/"))]
        assert scripts and all((ROOT / word.partition("::")[0]).exists() for word in scripts), (name, scripts)


def test_every_reference_engine_of_the_registry_is_in_the_session_and_the_gpu_job(plans):
    for found in plans:
        llama, windowed = found["engines suites"]
        assert set(llama) | set(windowed) == REFERENCE and not set(llama) & set(windowed)
        suites = next(command for name, _, command in found["steps"] if name == "suites")
        assert f"ENGINES={' '.join(llama)}" in suites and f"WINDOWED={' '.join(windowed)}" in suites
    listed = subprocess.run(["bash", str(GPU_JOB), "--list"], capture_output=True, text=True, check=True,
                            env={k: v for k, v in clean_env().items() if k not in ("ENGINES", "WINDOWED")}).stdout
    in_job = {engine for line in listed.splitlines() for engine in line.partition(": ")[2].split()}
    assert REFERENCE <= in_job, f".ci/gpu lacks {sorted(REFERENCE - in_job)}"


def test_the_benchmark_flags_the_session_passes_parse(plans):
    bench = import_benchmark("bench_strategies")
    for found in plans:
        for name, _, command in found["steps"]:
            if name != "anchors":
                continue
            argv = command[command.index("benchmarks/bench_strategies.py") + 1:]
            argv[argv.index("--device") + 1] = "cpu"  # parse_args refuses cuda where there is none
            args = bench.parse_args(argv)
            assert {e for e in args.engines.split(",")} <= set(bench.REFERENCE)
            assert args.sections <= {"speed", "kvshared"} and args.families in ("llama", "gemma4")


def test_a_step_name_not_known_is_refused():
    result = subprocess.run(["bash", str(SESSION), "--plan"], capture_output=True, text=True, cwd=ROOT,
                            env={**clean_env(), "STEPS": "anchors typo"})
    assert result.returncode == 2 and "no step 'typo'" in result.stderr


# --- the report: what each step's files say ------------------------------------------------------------------------
LATENCY_OK = """\
engine 'ref-static-cudagraph' on model 'llama' (cuda, float32) is over its latency budget:
  decode median 0.052 ms/token > budget 0.001 ms/token
  (medians of 5 repeats timed with cuda-events, prompt of 32 tokens, decode over 8 tokens; see ...)
PASSED benchmarks/gpu_latency_budgets.py::test_within_budget[ref-static-cudagraph-llama]
FAILED benchmarks/gpu_latency_budgets.py::test_twin_misses_budget[ref-static-cudagraph-llama]
========================= 1 failed, 1 passed in 48.61s =========================
[rc=1 after 50 s, at 70 s of the session]
"""


def test_the_report_tells_the_latency_twin_failing_from_budgets_not_enforced(tmp_path):
    (tmp_path / "latency.txt").write_text(LATENCY_OK)
    assert report.latency(tmp_path, "gpu").status == "OK"
    assert report.latency(tmp_path, "dry").status == "FINDING"  # the CPU timer is perf_counter
    (tmp_path / "latency.txt").write_text(LATENCY_OK.replace("FAILED benchmarks/gpu_latency_budgets.py::test_twin",
                                                             "PASSED benchmarks/gpu_latency_budgets.py::test_twin")
                                          .replace("[rc=1", "[rc=0"))
    verdict = report.latency(tmp_path, "gpu")
    assert verdict.status == "FINDING" and "NOT enforced" in verdict.summary
    (tmp_path / "latency.txt").write_text(LATENCY_OK.replace("[rc=1", "[rc=124"))
    assert report.latency(tmp_path, "gpu").status == "CUT"
    (tmp_path / "latency.txt").unlink()
    assert report.latency(tmp_path, "gpu").status == "ERROR"


def test_the_report_names_the_engines_a_cut_suite_run_did_not_reach(tmp_path):
    (tmp_path / "suites").mkdir()
    log = tmp_path / "suites" / "gpu-bfloat16-llama.log"
    log.write_text("PASS  ref-static: 9 passed (1 model)\n3 passed, 2 failed in 9.0s\n[rc=124]\n")
    verdict = report.suites(tmp_path, ["bfloat16"], {"llama": ["ref-static", "ref-tova"], "windowed": []}, "gpu")
    assert verdict.status == "CUT"
    assert verdict.details == ["bfloat16 ref-static: PASS: 9 passed (1 model)", "bfloat16 ref-tova: not reached"]
    verdict = report.suites(tmp_path, ["bfloat16"], {"llama": ["ref-static"], "windowed": ["ref-kv-shared"]}, "gpu")
    assert verdict.status == "ERROR" and "gpu-bfloat16-windowed.log was not written" in verdict.details[-1]


def test_an_engine_nothing_was_checked_on_is_a_finding_unless_it_is_cuda_only_in_the_dry_run(tmp_path):
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "gpu-bfloat16-llama.log").write_text(
        "ref-static-cudagraph / llama: engine 'ref-static-cudagraph' does not declare device 'cpu' (declares "
        "devices=['cuda'])\nNOT CHECKED  ref-static-cudagraph: 1 skipped (1 model)\nPASS         ref-static: 1 passed "
        "(1 model)\n1 passed, 1 skipped in 9.0s\n[rc=0]\n")
    groups = {"llama": ["ref-static-cudagraph", "ref-static"], "windowed": []}
    assert report.suites(tmp_path, ["bfloat16"], groups, "dry").status == "OK"
    verdict = report.suites(tmp_path, ["bfloat16"], groups, "gpu")
    assert verdict.status == "FINDING" and "bfloat16 llama: nothing checked on ref-static-cudagraph" in verdict.details


def test_the_report_wants_every_anchor_of_the_gpu_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for family, letters in (("llama", "ac"), ("gemma4", "b")):
        anchors = [{"anchor": x, "what": "w", "model": family, "shape": "s", "measured": "m"} for x in letters]
        (tmp_path / f"bench-{family}.json").write_text(json.dumps({"command": "c", "anchors": anchors}))
        (tmp_path / f"bench-{family}.log").write_text("[rc=0 after 1 s]\n")
    assert report.anchors(tmp_path, out, "gpu").status == "OK"
    assert set(json.loads((out / "bench.json").read_text())) == {"llama", "gemma4"}
    (tmp_path / "bench-llama.json").write_text(json.dumps({
        "command": "c", "anchors": [], "skipped": [{"what": "llama-large", "why": "--time-budget spent"}]}))
    verdict = report.anchors(tmp_path, out, "gpu")
    assert verdict.status == "CUT" and "llama: no anchor a, c" in verdict.details


def test_the_report_tells_a_scale_run_that_passed_from_one_that_measured_nothing_or_failed(tmp_path):
    """The scale step (bench_scale.py over the real shapes): OK only where every shape's token checks passed; its
    table joins bench.md; exit 0 with nothing measured is an ERROR, a failed check a FINDING."""
    shape = {"shape": "llama-3-8b", "dtype": "bfloat16", "parameters": 8_030_000_000, "exit": 0, "wall_s": 250.0,
             "peak_gib": 20.1, "engine_s": 9.0, "test_s": 200.0, "summary": "6 passed in 200.0s",
             "memory": "host: 3.1 GiB peak RSS in this process; device (torch's peak allocation in this process): "
                       "cuda:0 33.20 GiB"}
    (tmp_path / "scale.log").write_text("| shape | ... |\n[rc=0 after 260 s, at 270 s of the session]\n")
    (tmp_path / "scale.json").write_text(json.dumps([shape]))
    (tmp_path / "scale.md").write_text("| shape | parameters |\n")
    verdict = report.scale(tmp_path, tmp_path)
    assert verdict.status == "OK" and "cuda:0 33.20 GiB" in verdict.details[0] and "8,030M" in verdict.details[0]
    assert "# bench_scale.py" in (tmp_path / "bench.md").read_text()
    (tmp_path / "scale.json").write_text(json.dumps([{**shape, "exit": 1, "summary": "1 failed, 5 passed"}]))
    assert report.scale(tmp_path, tmp_path).status == "FINDING"
    (tmp_path / "scale.json").unlink()
    assert report.scale(tmp_path, tmp_path).status == "ERROR"  # exit 0, nothing measured
    (tmp_path / "scale.log").write_text("building...\n[rc=124 after 300 s]\n")
    assert report.scale(tmp_path, tmp_path).status == "CUT"
