"""``kvcompile matrix``: engines x checks from result files (reports/matrix.py), each cell from what the reports
say of that check: pass, fail (linking the findings page), known finding, skip (with the reason), or not run."""

import json

import pytest

from pytest_kvcompile import cli
from pytest_kvcompile.reports import json_file, matrix
from pytest_kvcompile.verdicts.collect import Collector
from pytest_kvcompile.verdicts.failures import Kind, Problem
from pytest_kvcompile.verdicts.results import merge
from pytest_kvcompile.verdicts.rows import Check, RunInfo

RUN = {"started": "2026-11-24T10:00:00+00:00", "torch": "2.13.0", "pytest_kvcompile": "0.1.0"}


def _check(ran=0, failed=0, xfailed=0, skipped=0, reason=""):
    return {"ran": ran, "failed": failed, "xfailed": xfailed, "skipped": skipped, "reason": reason}


def _results():
    found = Collector("cpu", "float32")
    found.add("eng", "llama", tests={"passed": 1, "failed": 1}, versions=["eng==1.2", "transformers==5.23.0"],
              checks={"test_token_identity": _check(ran=1), "test_recompiles": _check(ran=1, failed=1)},
              failures=[{"test": "suites/test_recompiles.py::test_recompiles[eng-llama]", "kind": "recompile",
                         "message": "no_recompile: 2 compiles after warmup\nmore", "failure": None}])
    found.add("eng", "mistral-sw", tests={"passed": 1, "skipped": 1},
              checks={"test_token_identity": _check(ran=1), "test_recompiles": _check(skipped=1, reason="not here")})
    found.add("eng-compile", "llama", tests={"xfailed": 1, "skipped": 1},
              checks={"test_token_identity": _check(ran=1, xfailed=1),
                      "test_kv_memory": _check(skipped=1, reason="declares no kv_cache_bytes")})
    results = found.results()
    results.runs = [RunInfo(**{**RUN, "engines": ["eng", "eng-compile"]})]
    results.problems = [Problem(Kind.VACUOUS, "eng-compile", "cpu", "float32", "no token verified", "llama")]
    return results


def test_each_cell_says_what_the_reports_say_of_that_check(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "eng.md").write_text("# eng findings\n")
    engines, checks, cells = matrix.build(_results(), pages, tmp_path / "out" / "m.md")
    assert [e.name for e in engines] == ["eng", "eng-compile"]  # both match eng.md: NAME and NAME-*
    assert checks == ["test_kv_memory", "test_recompiles", "test_token_identity", matrix.RULES]
    assert cells["eng", "test_recompiles"] == matrix.Cell("fail", "no_recompile: 2 compiles after warmup",
                                                          ("llama", "mistral-sw"))  # failed on one model: FAIL
    assert cells["eng", "test_token_identity"].status == "pass"
    assert ("eng", "test_kv_memory") not in cells  # not run: an empty cell
    assert cells["eng-compile", "test_token_identity"].status == "known"
    assert cells["eng-compile", "test_kv_memory"] == matrix.Cell("skip", "declares no kv_cache_bytes", ("llama",))
    assert cells["eng-compile", matrix.RULES].status == "fail" and ("eng", matrix.RULES) not in cells
    eng = engines[0]
    assert (eng.verdict, eng.date, eng.where, eng.page) == ("FAIL", "2026-11-24", "cpu float32", "../pages/eng.md")
    assert eng.versions == ("eng==1.2", "transformers==5.23.0", "torch==2.13.0", "pytest-kvcompile==0.1.0")
    assert engines[1].verdict == "FAIL"  # its run rule fails it


def test_the_markdown_and_html_pages(tmp_path):
    (tmp_path / "eng.md").write_text("# eng findings\n")
    md = matrix.markdown(_results(), ["a.json"], tmp_path, tmp_path / "m.md")
    assert "| engine | verdict | run | versions | kv_memory | recompiles | token_identity | run rules |" in md
    assert "| [eng](eng.md) | FAIL | 2026-11-24 cpu float32 | eng==1.2, transformers==5.23.0, torch==2.13.0, " in md
    assert "| ✅ |" in md and "[❌ 1](eng.md)" in md
    assert "1. eng / recompiles (llama, mistral-sw): no_recompile: 2 compiles after warmup" in md
    assert "eng-compile / kv_memory (llama): declares no kv_cache_bytes" in md
    page = matrix.html(_results(), ["a.json"], tmp_path, tmp_path / "m.html")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert 'class="fail" title="fail: no_recompile: 2 compiles after warmup (llama, mistral-sw)"' in page
    assert 'class="skip" title="skip: declares no kv_cache_bytes (llama)"' in page


def test_kvcompile_matrix_reads_result_files_old_and_new(tmp_path, capsys):
    new = tmp_path / "new.json"
    new.write_text(json_file.dumps(_results()))
    old = tmp_path / "old.json"  # schema 1: no per-check failure counts: the failures list says it
    old.write_text(json.dumps({"schema_version": 1, "kind": json_file.KIND, "runs": [{**RUN, "engines": ["v1"]}],
                               "rows": [{"engine": "v1", "model": "llama", "device": "cpu", "dtype": "float32",
                                         "tests": {"passed": 0, "failed": 1, "skipped": 0, "xfailed": 0, "xpassed": 0,
                                                   "error": 0},
                                         "tokens": {"identical": 0, "near_tie": 0, "mismatch": 1}, "near_ties": [],
                                         "checks": {"test_token_identity": {"ran": 1, "skipped": 0, "reason": ""}},
                                         "failures": [{"test": "s.py::test_token_identity[v1-llama-short7]",
                                                       "message": "TokenMismatch: diverges"}]}]}))
    out = tmp_path / "m.md"
    assert cli.main(["matrix", str(new), str(old), "-o", str(out), "--pages", str(tmp_path)]) == 0
    assert "matrix of 3 engine(s) from 2 file(s)" in capsys.readouterr().out
    text = out.read_text()
    assert "| v1 | FAIL |" in text and "v1 / token_identity (llama): TokenMismatch: diverges" in text
    assert "| hf-eager | NO REPORT |" in text  # every engine the project adapts has a row: what is not covered shows
    with pytest.raises(SystemExit):
        cli.main(["matrix", str(new), "-o", str(tmp_path / "m.txt")])
    assert "unknown matrix format '.txt'; end the name in one of .md, .html, .htm" in capsys.readouterr().err


def test_merge_sums_the_per_check_outcomes():
    a, b = _results(), _results()
    row = next(r for r in merge([a, b]).rows if r.engine == "eng" and r.model == "llama")
    assert row.checks["test_recompiles"] == Check(**_check(ran=2, failed=2))
    assert row.versions == ["eng==1.2", "transformers==5.23.0"]
