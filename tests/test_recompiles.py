"""The recompile recorder against real dynamo compiles (eager backend), and its torch adapter."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo.utils

from conftest import run_suites
from pytest_kvcompile.recompiles import hooks as dynamo_hooks
from pytest_kvcompile.recompiles.recorder import (
    CompileEvent,
    CompileRecorder,
    DynamoHooksBroken,
    RecompileError,
    expect_no_recompiles,
    explain,
    hints,
    reset_dynamo,
    verdict,
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts and ends with no compiled frames."""
    reset_dynamo()
    yield
    reset_dynamo()


def eager(fn, **options):
    return torch.compile(fn, backend="eager", **options)


def double(x):
    return x * 2


def times(x, n):
    return x * n


def with_break(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


def test_planted_recompile_is_seen_with_its_guard():
    f = eager(double)
    with CompileRecorder() as rec:
        f(torch.ones(3))
        f(torch.ones(4))
    first, second = rec.events
    assert (first.is_recompile, second.is_recompile) == (False, True)
    assert second.frame.startswith("double (") and "test_recompiles.py:" in second.frame
    assert second.guard_failures == ("tensor 'x' size mismatch at index 0. expected 3, actual 4",)
    assert "torch._dynamo.mark_dynamic(tensor, 0)" in explain(rec.events[1:])


def test_mark_dynamic_sees_no_recompile():
    f = eager(double)
    x = torch.ones(3)
    torch._dynamo.mark_dynamic(x, 0)
    with expect_no_recompiles(warmup=True) as rec:
        f(x)
        rec.mark_warmup_done()
        for n in (4, 7, 9):
            f(torch.ones(n))
    assert [e.is_recompile for e in rec.events] == [False]


def test_graph_break_is_seen_with_its_reason_and_frame():
    f = eager(with_break)
    with pytest.raises(RecompileError) as failure:
        with expect_no_recompiles(allow_graph_breaks=False, warmup=True) as rec:
            f(torch.ones(2))
            rec.mark_warmup_done()
    (brk,) = rec.graph_breaks
    assert "test_recompiles.py:" in brk and "Call to `torch._dynamo.graph_break()`" in brk
    assert "Traceback" not in brk
    assert rec.events[0].frame.startswith("with_break (") and rec.events[0].graph_breaks == (brk,)
    assert str(failure.value).splitlines()[0] == "1 graph break(s), none allowed"
    assert "during warmup:" in str(failure.value)


@pytest.mark.parametrize("fail_on_hit", [False, True], ids=["silent-eager-fallback", "fail_on_recompile_limit_hit"])
def test_recompile_limit_hit_is_a_failure(fail_on_hit):
    f = eager(times, dynamic=False)  # every new n recompiles
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=fail_on_hit):
        with pytest.raises(RecompileError) as failure:
            with expect_no_recompiles(max_recompiles=100) as rec:
                for n in range(4):
                    try:
                        f(torch.ones(2), n)
                    except torch._dynamo.exc.FailOnRecompileLimitHit:
                        assert fail_on_hit
    hit = [e for e in rec.events if e.limit_hit]
    assert hit and hit[0].limit_hit.startswith("recompile_limit=2") and hit[0].frame.startswith("times (")
    message = str(failure.value)
    assert message.startswith("dynamo hit recompile_limit=2") and " compiling times (" in message.splitlines()[0]
    assert "reset_dynamo()" in message


def test_post_warmup_compiles_are_counted_against_the_budget():
    f = eager(times, dynamic=False)
    with expect_no_recompiles(max_recompiles=1, warmup=True) as rec:
        f(torch.ones(2), 0)
        rec.mark_warmup_done()
        f(torch.ones(2), 1)
    assert (len(rec.warmup_events), len(rec.post_warmup_events)) == (1, 1)
    with pytest.raises(RecompileError, match=r"^2 dynamo compile\(s\) after warmup, 1 allowed"):
        with expect_no_recompiles(max_recompiles=1):
            f(torch.ones(2), 2)
            f(torch.ones(2), 3)


def test_without_warmup_a_first_compile_counts():
    with pytest.raises(RecompileError) as failure:
        with expect_no_recompiles():
            eager(double)(torch.ones(2))
    assert "#1 first compile" in str(failure.value) and "extend the warmup" in str(failure.value)


@pytest.mark.parametrize(("warmup", "mark", "message"), [
    (True, False, "warmup=True but mark_warmup_done() was never called"),
    (False, True, "mark_warmup_done() was called but warmup=False"),
])
def test_warmup_declaration_must_match_use(warmup, mark, message):
    with pytest.raises(RecompileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with expect_no_recompiles(warmup=warmup) as rec:
            if mark:
                rec.mark_warmup_done()


@pytest.mark.parametrize("kwargs", [{"max_recompiles": -1}, {"max_recompiles": True}, {"warmup": "yes"},
                                    {"allow_graph_breaks": 0}])
def test_bad_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError):
        with expect_no_recompiles(**kwargs):
            pass


def test_reset_dynamo_forgets_compiled_frames():
    f = eager(double)
    f(torch.ones(2))
    reset_dynamo()
    with CompileRecorder() as rec:
        f(torch.ones(2))
    assert [e.is_recompile for e in rec.events] == [False]


def test_no_event_lost_when_torch_keeps_fewer():
    """torch's own record is a bounded deque (64); the recorder must not be."""
    torch._dynamo.utils.set_compilation_metrics_limit(2)
    try:
        f = eager(times, dynamic=False)
        with CompileRecorder() as rec:
            for n in range(5):
                f(torch.ones(2), n)
    finally:
        torch._dynamo.utils.set_compilation_metrics_limit(torch._dynamo.utils.DEFAULT_COMPILATION_METRICS_LIMIT)
    assert [e.compile_id.split("/")[1] for e in rec.events] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(("guard", "expected"), [
    ("tensor 'kwargs['input_ids']' size mismatch at index 1. expected 17, actual 33",
     "dim 1 of kwargs['input_ids'] was compiled static (17) and changed to 33: "
     "call torch._dynamo.mark_dynamic(tensor, 1)"),
    ("tensor 'x' size mismatch at index 0. expected 1, actual 2", "torch._dynamo.decorators.mark_unbacked(tensor, 0)"),
    ("2 <= x.size()[0] <= 4096  # if x.shape[0] > W:", "sliding-window boundary"),
    ("cache.cumulative_length == 17     # c.pos += 1  # cache.py:3 in update", "keep it in a tensor"),
    ("___check_obj_id(L['past_key_values'], 140234)", "keep it in a tensor"),
    ("tensor 'x' stride mismatch at index 0. expected 4, actual 1", ".contiguous()"),
    ("something torch never said before", "TORCH_LOGS=recompiles_verbose"),
])
def test_hints_name_the_fix(guard, expected):
    event = CompileEvent(frame="f (a.py:1)", compile_id="0/1", is_recompile=True, guard_failures=(guard,))
    assert any(expected in hint for hint in hints(event)), hints(event)


def test_explain_lists_each_compile_with_frame_guard_and_hint():
    events = [
        CompileEvent("f (a.py:1)", "0/1", True, ("tensor 'x' size mismatch at index 1. expected 5, actual 6",)),
        CompileEvent("wrapper (generic.py:9)", "1/8", True,
                     ("tensor 'w' size mismatch at index 0. expected 2, actual 3",),
                     limit_hit="recompile_limit=8"),
    ]
    pytest.LineMatcher(explain(events, max_recompiles=1).splitlines()).fnmatch_lines([
        "dynamo hit recompile_limit=8 compiling wrapper (generic.py:9) and fell back to eager; "
        "2 dynamo compile(s) after warmup, 1 allowed",
        "",
        "#1 recompile 0/1 of f (a.py:1)",
        "  guard failed: tensor 'x' size mismatch at index 1. expected 5, actual 6",
        "  HINT: dim 1 of x was compiled static (5) and changed to 6: *mark_dynamic*",
        "",
        "#2 recompile 1/8 of wrapper (generic.py:9)",
        "  hit recompile_limit=8: dynamo stopped compiling this frame *",
        "  guard failed: *",
        "  HINT: dynamo hit recompile_limit=8 on wrapper (generic.py:9) *reset_dynamo()*",
    ])


def test_private_apis_resolve():
    dynamo_hooks.check_private_apis()
    assert "recompile_limit=8" in dynamo_hooks.limits()


def test_a_missing_private_api_breaks_loudly(monkeypatch):
    monkeypatch.setattr(dynamo_hooks, "PRIVATE_APIS",
                        (*dynamo_hooks.PRIVATE_APIS, "torch._dynamo.utils.gone_in_torch_3"))
    with pytest.raises(DynamoHooksBroken,
                       match=r"torch\._dynamo\.utils\.gone_in_torch_3 is missing .*recompiles/hooks\.py"):
        with CompileRecorder():
            pass


def test_a_tap_that_goes_quiet_breaks_loudly(monkeypatch):
    """If torch stopped emitting the trace records, the count must not read zero."""
    monkeypatch.setattr(dynamo_hooks.CompileTap, "emit", lambda self, record: None)
    with pytest.raises(DynamoHooksBroken, match=r"torch recorded 1 frame compilation\(s\) .* saw 0"):
        with CompileRecorder():
            eager(double)(torch.ones(2))


def test_a_changed_trace_record_breaks_loudly():
    tap = dynamo_hooks.CompileTap()
    record = logging.LogRecord("torch.__trace", logging.DEBUG, __file__, 1, "", None, None)
    record.metadata = {dynamo_hooks.FRAME_COMPILE: {"compile_id": "0/0"}}
    tap.emit(record)
    with pytest.raises(DynamoHooksBroken, match="lacks some of"):
        tap.compiles()


def test_cuda_graph_captures_are_recorded_split_at_warmup_and_unhooked_after():
    """CPU stand-in for tests/test_gpu.py: capture_begin is patched only while recording (nested recorders
    included), each capture names the code that asked for it, and one after warmup fails the verdict."""
    graph_class = torch.cuda.graphs.CUDAGraph
    original = graph_class.capture_begin

    def capture():  # what an engine's torch.cuda.graph(...) does first
        graph_class.capture_begin(object())

    with CompileRecorder() as outer:
        assert graph_class.capture_begin is not original
        real, dynamo_hooks._CAPTURE_BEGIN = dynamo_hooks._CAPTURE_BEGIN, lambda *args, **kwargs: None
        try:
            capture()
            outer.mark_warmup_done()
            with CompileRecorder() as inner:
                capture()
            assert graph_class.capture_begin is not original  # the outer recorder still watches
        finally:
            dynamo_hooks._CAPTURE_BEGIN = real
    assert graph_class.capture_begin is original
    assert len(outer.captures) == 2 and len(inner.captures) == 1
    assert outer.captures[0].startswith("torch.cuda.CUDAGraph capture in "
                                        "test_cuda_graph_captures_are_recorded_split_at_"
                                        "warmup_and_unhooked_after.<locals>.capture (")
    assert "test_recompiles.py" in outer.captures[0]
    assert len(outer.post_warmup_captures) == 1
    message = verdict(outer, warmup=True)
    assert message.startswith("1 CUDA graph capture(s) after warmup, 0 allowed")
    assert "CUDA graph capture after warmup: torch.cuda.CUDAGraph capture in test_cuda_graph_captures" in message
    assert verdict(inner).startswith("1 CUDA graph capture(s) after warmup")  # no warmup: every capture counts


def test_a_torch_export_is_recorded_like_a_compile():
    # non-strict export runs no dynamo frame: without the watch, re-exporting per shape would be invisible
    class Head(torch.nn.Module):
        def forward(self, x):
            return x * 2

    with CompileRecorder() as recorder:
        torch.export.export(Head(), (torch.zeros(3),), strict=False)
        recorder.mark_warmup_done()
        torch.export.export(Head(), (torch.zeros(4),), strict=False)
    exports = [e for e in recorder.events if e.compile_id.startswith("export/")]
    assert [e.compile_id for e in exports] == ["export/0", "export/1"]
    assert [e.compile_id for e in recorder.post_warmup_events if e.compile_id.startswith("export/")] == ["export/1"]
    assert "torch.export of Head called from test_a_torch_export_is_recorded_like_a_compile" in exports[0].frame
    assert torch.export._trace._export.__module__ == "torch.export._trace"  # unpatched once no recorder listens


def test_reexporting_per_shape_fails_the_recompile_check_exporting_once_passes(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_export:ExportsOnce",
                        "--kv-engine=kv_test_engines_export:ReexportsPerLength", "-k",
                        "test_no_recompiles_after_warmup")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*engine 'kv_test_engines_export:ReexportsPerLength' on model 'llama': * dynamo compile(s) after warmup, 0 "
        "allowed*",
        "*torch.export of _Head called from *generate*",
        "FAILED *test_no_recompiles_after_warmup?kv_test_engines_export:ReexportsPerLength-llama*",
    ])
