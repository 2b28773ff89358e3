"""Renamed spellings (issue 27: one name per concept) keep working, with a deprecation warning naming the new one.

- ``no_recompile(graph_breaks=...)`` is ``no_recompile(allow_graph_breaks=...)``, the keyword of
  ``expect_no_recompiles`` and ``--kv-allow-graph-breaks``; the old one warns with a PytestDeprecationWarning.
- ``recompiles.recorder.isolate()`` / ``kv_engine.isolate_compiles()`` reset dynamo: they are ``reset_dynamo()``
  now ("isolate" is only ``--kv-isolate``'s process of its own).
- ``Declaration(kv_dtype=...)`` is ``Declaration(kv_cache_dtype=...)``: the KV cache's storage format, vLLM's name;
  ``kv_dtype`` stays the run's model dtype (``--kv-dtype``, ini ``kv_dtype``), which ``Declaration.dtypes`` lists.
- ``KVLayout(kind=...)`` is ``KVLayout(allocation=...)``: "kind" is the failure kind (verdicts/failures.py).
  Both old keywords, and reading ``decl.kv_dtype`` / ``layout.kind``, warn with a DeprecationWarning.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFTEST = """
from pytest_kvcompile.recompiles import marker as recompile_marker


def pytest_configure(config):
    recompile_marker.register(config)
"""
OPTS = ("-p", "no:kvcompile", "-p", "no:cacheprovider", "-p", "no:benchmark", "-v")


def cases(keyword: str) -> str:
    """Two tests that graph-break (and may compile): one allows breaks, one does not: `keyword` spells the rule."""
    return f'''
import pytest
import torch


def breaks(x):
    torch._dynamo.graph_break()
    return x * 2


@pytest.mark.no_recompile(max_recompiles=9, {keyword}=True)
def test_allowed():
    torch.compile(lambda x: breaks(x + 1), backend="eager")(torch.ones(2))


@pytest.mark.no_recompile(max_recompiles=9, {keyword}=False)
def test_refused():
    torch.compile(lambda x: breaks(x + 2), backend="eager")(torch.ones(2))
'''


@pytest.fixture
def tester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(REPO), prepend=":")
    pytester.makeconftest(CONFTEST)
    return pytester


def test_marker_graph_breaks_still_works_and_warns(tester):
    tester.makepyfile(test_old=cases("graph_breaks"))
    result = tester.runpytest_subprocess(*OPTS)
    result.assert_outcomes(passed=1, failed=1, warnings=2)
    result.stdout.fnmatch_lines(["*test_old.py::test_allowed PASSED*", "*test_old.py::test_refused FAILED*"])
    result.stdout.fnmatch_lines([
        "*PytestDeprecationWarning: @pytest.mark.no_recompile(max_recompiles=9, graph_breaks=True): "
        "graph_breaks= is deprecated, write allow_graph_breaks=",
        "*PytestDeprecationWarning: @pytest.mark.no_recompile(max_recompiles=9, graph_breaks=False): "
        "graph_breaks= is deprecated, write allow_graph_breaks=",
    ])
    result.stdout.fnmatch_lines(["*no_recompile: 1 graph break(s), none allowed*"])


def test_marker_allow_graph_breaks_works_without_warning(tester):
    tester.makepyfile(test_new=cases("allow_graph_breaks"))
    result = tester.runpytest_subprocess(*OPTS, "-W", "error::pytest.PytestDeprecationWarning")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_new.py::test_allowed PASSED*", "*test_new.py::test_refused FAILED*"])
    result.stdout.no_fnmatch_line("*Deprecat*")


def test_marker_both_spellings_is_an_error_naming_the_one(tester):
    tester.makepyfile(test_both="""
import pytest

@pytest.mark.no_recompile(graph_breaks=True, allow_graph_breaks=True)
def test_x():
    pass
""")
    result = tester.runpytest_subprocess(*OPTS)
    result.stdout.fnmatch_lines(["*got an unexpected keyword argument 'graph_breaks'; write "
                                 "@pytest.mark.no_recompile(max_recompiles=0, allow_graph_breaks=False, warmup=False)"])
    assert result.ret == pytest.ExitCode.INTERRUPTED


def test_recorder_isolate_is_reset_dynamo_with_a_warning():
    from pytest_kvcompile.recompiles import recorder

    with pytest.warns(DeprecationWarning, match=r"isolate\(\) is deprecated: call reset_dynamo\(\)"):
        old = recorder.isolate
    assert old is recorder.reset_dynamo
    with pytest.raises(AttributeError, match="no attribute 'isolated'"):
        recorder.isolated  # noqa: B018  (only the renamed name is an alias)


def test_engine_isolate_compiles_is_reset_dynamo_with_a_warning():
    from pytest_kvcompile.run.harness import EngineUnderTest

    calls = []
    engine = types.SimpleNamespace(reset_dynamo=lambda: calls.append("reset"))
    with pytest.warns(DeprecationWarning, match=r"isolate_compiles\(\) is deprecated: call kv_engine\.reset_dynamo"):
        EngineUnderTest.isolate_compiles(engine)
    assert calls == ["reset"]


def test_declaration_kv_dtype_is_kv_cache_dtype_with_a_warning():
    import dataclasses

    from pytest_kvcompile import Declaration
    from pytest_kvcompile.contract.engine import with_declaration

    fix = r"Declaration\(kv_dtype=\.\.\.\) is deprecated: write Declaration\(kv_cache_dtype=\.\.\.\)"
    with pytest.warns(DeprecationWarning, match=fix) as caught:
        old = Declaration(kv_dtype="float16", batching=True)
    assert [w.filename for w in caught] == [__file__]  # once, pointing at the declaration
    new = Declaration(kv_cache_dtype="float16", batching=True)
    assert old == new and hash(old) == hash(new) and old.kv_cache_dtype == "float16"
    assert dataclasses.replace(old, kv_cache_dtype="int8") == Declaration(kv_cache_dtype="int8", batching=True)
    with pytest.warns(DeprecationWarning, match=r"Declaration\.kv_dtype is deprecated: read Declaration\.kv_cache_dt"):
        assert old.kv_dtype == "float16"
    with pytest.warns(DeprecationWarning, match=fix), pytest.raises(ValueError, match="kv_cache_dtype='q4': one of"):
        Declaration(kv_dtype="q4")  # validated as the field it names
    with pytest.raises(TypeError, match="got both kv_dtype= and kv_cache_dtype=: write kv_cache_dtype= only"):
        Declaration(kv_dtype="int8", kv_cache_dtype="int8")

    def factory(spec):
        raise NotImplementedError

    with pytest.warns(DeprecationWarning, match=fix):
        with_declaration(factory, kv_dtype="int8")
    assert factory.kv_declaration == Declaration(kv_cache_dtype="int8")


def test_kvlayout_kind_is_allocation_with_a_warning():
    from pytest_kvcompile import KVLayout

    with pytest.warns(DeprecationWarning, match=r"KVLayout\(kind=\.\.\.\) is deprecated: write KVLayout\(allocation="):
        old = KVLayout(kind="static", max_cache_len=64)
    assert old == KVLayout("static", max_cache_len=64) == KVLayout(allocation="static", max_cache_len=64)
    with pytest.warns(DeprecationWarning, match=r"KVLayout\.kind is deprecated: read KVLayout\.allocation"):
        assert old.kind == "static"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="KVLayout allocation 'paged' is unknown"):
        KVLayout(kind="paged")


def test_the_new_spellings_do_not_warn():
    import warnings

    from pytest_kvcompile import Declaration, KVLayout

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = KVLayout(allocation="budget", budget=8)
        assert Declaration(kv_cache_dtype="int8", kv_layout=layout).kv_layout.allocation == "budget"


def test_no_built_in_engine_declares_with_a_deprecated_spelling():
    """Every built-in engine module whose imports succeed here, imported with the renamed spellings' warnings as
    errors (a module whose runtime is not installed is left out: its import fails before its declarations)."""
    import os
    import subprocess
    import sys

    code = """
import importlib, warnings
from pytest_kvcompile.contract.registry import BUILTIN_ENGINES
warnings.filterwarnings("error", message=r"(Declaration|KVLayout)[(.]", category=DeprecationWarning)
imported = 0
for module in sorted({target.partition(":")[0] for target in BUILTIN_ENGINES.values()}):
    try:
        importlib.import_module(module)
    except ImportError:
        continue
    imported += 1
print("imported", imported)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 3  # hf, reference engines, ... at least
