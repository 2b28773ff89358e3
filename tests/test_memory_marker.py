"""@pytest.mark.limit_memory in real pytest runs (pytester subprocesses with the kvcompile plugin, which
registers the marker), and its size parser and measures in process."""

from __future__ import annotations

import pytest

from pytest_kvcompile.memory import marker as memory_marker
from pytest_kvcompile.memory.marker import parse_size

OPTS = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-v")

# Allocations of 64 MiB and more: above glibc's largest mmap threshold (32 MiB), so each one is fresh pages.
CASES = '''
import pytest
import torch

MiB = 1 << 20


def fill(n_bytes):
    return torch.ones(n_bytes // 4)  # touches every page


@pytest.fixture
def big_setup():
    return fill(128 * MiB)  # allocated during setup: never counted


@pytest.mark.limit_memory("64 MiB")  # device="auto": cpu here, cuda where torch sees a GPU
def test_small_passes():
    fill(8 * MiB)


@pytest.mark.limit_memory("32 MB", device="cpu")
def test_big_fails():
    kept = fill(96 * MiB)


@pytest.mark.limit_memory("32MiB", device="cpu")
def test_peak_counts_even_if_freed():
    for _ in range(2):
        fill(96 * MiB)


@pytest.mark.limit_memory("32 MiB", device="cpu")
def test_setup_is_not_counted(big_setup):
    big_setup.add_(1)


@pytest.mark.limit_memory("1 GiB", device="cuda")
def test_cuda():
    torch.ones(1024, device="cuda")


def test_unmarked_is_not_measured():
    fill(96 * MiB)
'''

BIG_FAILURE = [  # the failure of test_big_fails, line by line
    "limit_memory: test allocated * B (* MiB), limit 32 MB (33,554,432 B)",  # (96 MiB + the peak RSS noise)
    "*- limit_memory: memory report -*",
    "device: cpu",
    "measure: process peak RSS (VmHWM) over RSS at the call's start",
    "at the call's start: * B (*)",
    "peak during the call: * B (*)",
    "growth: * B (9?.? MiB)",
    "limit: 33,554,432 B (32.0 MiB) ('32 MB')",
    "over by: * B (6?.? MiB)",
]


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """test name -> PASSED/FAILED/SKIPPED from ``-v`` lines, plain or xdist."""
    found = {}
    for line in result.outlines:
        for outcome in ("PASSED", "FAILED", "SKIPPED"):
            if "::" in line and f" {outcome}" in line:
                found[line.split("::")[1].split()[0]] = outcome
    return found


@pytest.fixture
def tester(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_cases=CASES)
    return pytester


@pytest.mark.skipif(memory_marker._CpuPeak.unavailable() is not None, reason="the CPU measure needs Linux /proc")
def test_marker_passes_fails_and_skips(tester):
    result = tester.runpytest_subprocess(*OPTS, "-rs")
    import torch

    cuda = "PASSED" if torch.cuda.is_available() else "SKIPPED"
    assert outcomes(result) == {
        "test_small_passes": "PASSED", "test_big_fails": "FAILED", "test_peak_counts_even_if_freed": "FAILED",
        "test_setup_is_not_counted": "PASSED", "test_cuda": cuda, "test_unmarked_is_not_measured": "PASSED",
    }
    result.stdout.fnmatch_lines(BIG_FAILURE, consecutive=True)
    result.stdout.fnmatch_lines(["*_ test_peak_counts_even_if_freed _*",
                                 "limit_memory: test allocated * B (9?.? MiB), limit 32MiB (33,554,432 B)"])
    if cuda == "SKIPPED":
        result.stdout.fnmatch_lines(["SKIPPED * limit_memory: cannot measure cuda memory here: "
                                     "torch sees no CUDA device"])


@pytest.mark.full  # the marker's failure again, under xdist
@pytest.mark.skipif(memory_marker._CpuPeak.unavailable() is not None, reason="the CPU measure needs Linux /proc")
def test_marker_failure_under_xdist(tester):
    result = tester.runpytest_subprocess(*OPTS, "-n", "2", "-k", "small or big")
    assert outcomes(result) == {"test_small_passes": "PASSED", "test_big_fails": "FAILED"}
    result.stdout.fnmatch_lines(BIG_FAILURE, consecutive=True)


BAD_MARKERS = {  # marker -> the collection error naming the fix
    "limit_memory()": "missing a required argument: 'limit'; "
                      "write @pytest.mark.limit_memory(\"64 MiB\", device=\"auto\")",
    "limit_memory('64')": "'64' is not a size: write a number and a unit, e.g. \"64 MiB\" (units B, KB, MB, GB, TB *",
    "limit_memory(64)": "64 is not a size: *",
    "limit_memory('64 MiBs')": "'64 MiBs' is not a size: *",
    "limit_memory('1 GB', device='gpu')": "device must be one of 'auto', 'cpu', 'cuda', got 'gpu'",
    "limit_memory('1 GB', 'cpu')": "too many positional arguments; write *",
}


def test_bad_marker_arguments_fail_collection_and_help_shows(pytester):
    for i, marker in enumerate(BAD_MARKERS):
        pytester.makepyfile(**{f"test_bad{i}": f"import pytest\n\n@pytest.mark.{marker}\ndef test_x():\n    pass\n"})
    result = pytester.runpytest_subprocess(*OPTS)
    for i, (marker, fix) in enumerate(BAD_MARKERS.items()):
        result.stdout.fnmatch_lines([f"*ERROR collecting test_bad{i}.py*",
                                     f"test_bad{i}.py::test_x: @pytest.mark.{marker}: {fix}"])
    result.stdout.fnmatch_lines([f"*Interrupted: {len(BAD_MARKERS)} errors during collection*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED
    help_text = pytester.runpytest_subprocess("--markers", "-p", "no:cacheprovider")
    help_text.stdout.fnmatch_lines(['@pytest.mark.limit_memory("64 MiB", device="auto"): fail the test if its call '
                                    'allocates more than limit ("64 MiB"; units B, KB, MB, GB, TB or KiB, *'])


@pytest.mark.parametrize(("text", "expected"), [
    ("64 MiB", 64 << 20), ("64MB", 64 << 20), ("1.5 gib", 3 << 29), ("100 B", 100), ("2 KB", 2048), (" 3 kib ", 3072),
    ("1 TB", 1 << 40), (".5 KB", 512),
])
def test_parse_size_like_pytest_memray(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["64", "MiB", "64 MiBs", "-1 MB", "1e3 MB", "64 Mi", None])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="is not a size: write a number and a unit"):
        parse_size(text)


def test_cpu_measure_unavailable_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_marker, "STATUS", tmp_path / "status")
    assert memory_marker._CpuPeak.unavailable() == f"{tmp_path / 'status'} does not exist (the CPU measure needs Linux)"
    monkeypatch.setattr(memory_marker, "STATUS", tmp_path)
    monkeypatch.setattr(memory_marker, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    assert memory_marker._CpuPeak.unavailable().startswith(
        f"cannot reset the peak RSS through {tmp_path}/missing/clear_refs (")
