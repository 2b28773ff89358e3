"""@pytest.mark.no_recompile in real pytest runs (pytester subprocesses; eager backend).

One inner test file covers the cases, run once plain and once under xdist, so torch is
imported a few times rather than once per case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFTEST = """
from pytest_kvcompile.recompiles import marker as recompile_marker


def pytest_configure(config):
    recompile_marker.register(config)
"""
OPTS = ("-p", "no:kvcompile", "-p", "no:cacheprovider", "-p", "no:benchmark", "-v")

CASES = '''
import pytest
import torch


def double(x):
    return x * 2


def times(x, n):
    return x * n


def with_break(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


@pytest.fixture
def warm_double():
    f = torch.compile(double, backend="eager")
    x = torch.ones(1, 5)
    torch._dynamo.mark_dynamic(x, 1)
    f(x)  # compiled during setup: never counted
    return f


@pytest.mark.no_recompile(warmup=True)
def test_dynamic_seq_passes(kv_compile_recorder):
    f = torch.compile(double, backend="eager")
    x = torch.ones(1, 5)
    torch._dynamo.mark_dynamic(x, 1)
    f(x)
    kv_compile_recorder.mark_warmup_done()
    for n in (6, 7, 9):
        f(torch.ones(1, n))


@pytest.mark.no_recompile(warmup=True)
def test_static_seq_fails(kv_compile_recorder):
    f = torch.compile(double, backend="eager")
    f(torch.ones(1, 5))
    kv_compile_recorder.mark_warmup_done()
    for n in (6, 7, 9):
        f(torch.ones(1, n))


@pytest.mark.no_recompile
def test_fixture_warmup_passes(warm_double):
    warm_double(torch.ones(1, 8))


@pytest.mark.no_recompile(max_recompiles=1, warmup=True)
def test_within_budget_passes(kv_compile_recorder):
    f = torch.compile(times, backend="eager", dynamic=False)
    f(torch.ones(2), 0)
    kv_compile_recorder.mark_warmup_done()
    f(torch.ones(2), 1)


@pytest.mark.no_recompile(max_recompiles=1, warmup=True)
def test_over_budget_fails(kv_compile_recorder):
    f = torch.compile(times, backend="eager", dynamic=False)
    f(torch.ones(2), 0)
    kv_compile_recorder.mark_warmup_done()
    f(torch.ones(2), 1)
    f(torch.ones(2), 2)


@pytest.mark.no_recompile(allow_graph_breaks=True, warmup=True)
def test_graph_break_allowed_passes(kv_compile_recorder):
    f = torch.compile(with_break, backend="eager")
    f(torch.ones(2))
    kv_compile_recorder.mark_warmup_done()
    f(torch.ones(2))


@pytest.mark.no_recompile(warmup=True)
def test_graph_break_forbidden_fails(kv_compile_recorder):
    f = torch.compile(with_break, backend="eager")
    f(torch.ones(2))
    kv_compile_recorder.mark_warmup_done()


@pytest.mark.no_recompile(warmup=True)
def test_warmup_never_marked_fails(kv_compile_recorder):
    torch.compile(double, backend="eager")(torch.ones(2))


@pytest.mark.no_recompile(max_recompiles=50, warmup=True)
def test_recompile_limit_fails(kv_compile_recorder):
    kv_compile_recorder.mark_warmup_done()
    f = torch.compile(times, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(4):
            f(torch.ones(2), n)


def test_fixture_alone_only_records(kv_compile_recorder):
    torch.compile(double, backend="eager")(torch.ones(3))
    assert [e.is_recompile for e in kv_compile_recorder.events] == [False]
'''

OUTCOMES = {
    "test_dynamic_seq_passes": "PASSED", "test_static_seq_fails": "FAILED", "test_fixture_warmup_passes": "PASSED",
    "test_within_budget_passes": "PASSED", "test_over_budget_fails": "FAILED",
    "test_graph_break_allowed_passes": "PASSED",
    "test_graph_break_forbidden_fails": "FAILED", "test_warmup_never_marked_fails": "FAILED",
    "test_recompile_limit_fails": "FAILED", "test_fixture_alone_only_records": "PASSED",
}

STATIC_SEQ_FAILURE = [  # the failure of test_static_seq_fails, line by line
    "no_recompile: 1 dynamo compile(s) after warmup, 0 allowed",
    "*- no_recompile: compiles after warmup -*",
    "#1 recompile */1 of double (*test_cases.py:*)",
    "  guard failed: tensor 'x' size mismatch at index 1. expected 5, actual 6",
    "  HINT: dim 1 of x was compiled static (5) and changed to 6: call torch._dynamo.mark_dynamic(tensor, 1)*",
]


@pytest.fixture
def tester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(REPO), prepend=":")
    pytester.makeconftest(CONFTEST)
    return pytester


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """test name -> PASSED/FAILED from ``-v`` lines, plain or xdist."""
    found = {}
    for line in result.outlines:
        for outcome in ("PASSED", "FAILED"):
            if "::" in line and f" {outcome}" in line:
                found[line.split("::")[1].split()[0]] = outcome
    return found


def test_marker_passes_and_fails_with_the_reason(tester):
    tester.makepyfile(test_cases=CASES)
    result = tester.runpytest_subprocess(*OPTS)
    assert outcomes(result) == OUTCOMES
    result.stdout.fnmatch_lines(STATIC_SEQ_FAILURE, consecutive=True)
    result.stdout.fnmatch_lines([
        "*_ test_over_budget_fails _*", "no_recompile: 2 dynamo compile(s) after warmup, 1 allowed",
        "*_ test_graph_break_forbidden_fails _*", "no_recompile: 1 graph break(s), none allowed",
        "during warmup:", "#1 first compile */0 of with_break (*test_cases.py:*)",
        "  graph break at *test_cases.py:*: Call to `torch._dynamo.graph_break()`",
        "*_ test_warmup_never_marked_fails _*", "no_recompile: warmup=True but mark_warmup_done() was never called*",
        "*_ test_recompile_limit_fails _*",
        "no_recompile: dynamo hit recompile_limit=2 compiling times (*test_cases.py:*) and fell back to eager",
        "*HINT: dynamo hit recompile_limit=2 on times *reset_dynamo()*",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.full  # the marker's failure again, under xdist
def test_marker_failure_under_xdist(tester):
    tester.makepyfile(test_cases=CASES)
    result = tester.runpytest_subprocess(*OPTS, "-n", "2", "-k", "static_seq or dynamic_seq")
    assert outcomes(result) == {"test_dynamic_seq_passes": "PASSED", "test_static_seq_fails": "FAILED"}
    result.stdout.fnmatch_lines(STATIC_SEQ_FAILURE, consecutive=True)


BAD_MARKERS = {  # marker -> the collection error naming the fix
    "no_recompile(max_recompile=1)": "got an unexpected keyword argument 'max_recompile'; write @pytest.mark."
                                     "no_recompile(max_recompiles=0, allow_graph_breaks=False, warmup=False)",
    "no_recompile(1)": "too many positional arguments; write *",
    "no_recompile(max_recompiles=-1)": "max_recompiles must be an int >= 0, got -1; *",
    "no_recompile(max_recompiles=True)": "max_recompiles must be an int >= 0, got True; *",
    "no_recompile(allow_graph_breaks='no')": "allow_graph_breaks must be True or False, got 'no'; *",
    "no_recompile(warmup=True)": "warmup=True needs the kv_compile_recorder fixture: add it to the test's arguments *",
}


def test_bad_marker_arguments_fail_collection(tester):
    for i, marker in enumerate(BAD_MARKERS):
        tester.makepyfile(**{f"test_bad{i}": f"import pytest\n\n@pytest.mark.{marker}\ndef test_x():\n    pass\n"})
    result = tester.runpytest_subprocess(*OPTS)
    for i, (marker, fix) in enumerate(BAD_MARKERS.items()):
        result.stdout.fnmatch_lines([f"*ERROR collecting test_bad{i}.py*",
                                     f"test_bad{i}.py::test_x: @pytest.mark.{marker}: {fix}"])
    result.stdout.fnmatch_lines([f"*Interrupted: {len(BAD_MARKERS)} errors during collection*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED
