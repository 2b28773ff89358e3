"""``kvcompile matrix``: engines x checks from result files (reports/matrix.py), each cell from what the reports
say of that check: pass, fail (linking the findings page), known finding, skip (with the reason), or not run."""

import json
from pathlib import Path

import pytest

from pytest_kvcompile import cli
from pytest_kvcompile.reports import json_file, matrix
from pytest_kvcompile.verdicts.collect import Collector
from pytest_kvcompile.verdicts.failures import Kind, Problem
from pytest_kvcompile.verdicts.results import merge
from pytest_kvcompile.verdicts.rows import Check, RunInfo
from pytest_kvcompile.verdicts.suite_index import FAMILIES, SuiteIndex, index

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


SUITES = SuiteIndex("v2", {"test_token_identity": "tokens", "test_recompiles": "recompiles",
                           "test_kv_memory": "memory", "test_prefix_new": "prefix caches"})


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
    assert cells["eng-compile", "test_kv_memory"] == matrix.Cell("n/a", "declares no kv_cache_bytes", ("llama",))
    assert cells["eng", "test_recompiles"].status == "fail"
    assert cells["eng-compile", matrix.RULES].status == "fail" and ("eng", matrix.RULES) not in cells
    eng = engines[0]
    assert (eng.verdict, eng.date, eng.where, eng.page) == ("FAIL", "2026-11-24", "cpu float32", "../pages/eng.md")
    assert eng.versions == ("eng==1.2", "transformers==5.23.0", "torch==2.13.0", "pytest-kvcompile==0.1.0")
    assert engines[1].verdict == "FAIL"  # its run rule fails it


def test_currency_not_run_is_not_new_is_not_not_applicable_is_not_skipped():
    """A check the file's suites did not have is NEW; one they had but the run did not select has no cell (not run);
    a skip for an undeclared capability is N/A; any other skip is SKIP; the summary counts them per family."""
    results = _results()
    results.runs = [RunInfo(**{**RUN, "engines": ["eng", "eng-compile"], "suites": "v1",
                               "checks": ["test_token_identity", "test_recompiles", "test_kv_memory"]})]
    engines, checks, cells = matrix.build(results, None, None, (), SUITES)
    assert cells["eng", "test_prefix_new"] == matrix.Cell("new", matrix.WORDS["new"], ())
    assert ("eng", "test_kv_memory") not in cells  # its suites had it, the run did not select it: not run
    assert cells["eng", "test_recompiles"].status == "fail"
    eng, compiled = engines
    assert eng.families == {"tokens": {"pass": 1}, "recompiles": {"fail": 1}, "prefix caches": {"new": 1}}
    assert compiled.families["memory"] == {"n/a": 1}
    assert matrix.summary({"pass": 3, "fail": 1, "known": 2}) == "✗\u00a01 !\u00a02 ✓\u00a03"
    assert eng.suites == "v1" and matrix.basis(results, SUITES).version == "v1"  # the page: its files' newest suites
    md = matrix.markdown(results, ["a.json"], None, None, (), SUITES)
    row = "| [eng](#eng) | FAIL | 2026-11-24 cpu float32 | older | ✓ 1 | ✗ 1 |  | new 1 |"
    assert row.replace(" 1", "\u00a01") in md  # the table says older; the engine's section, which version
    assert "Run 2026-11-24 on cpu float32, suites v1 (older);" in md
    results.runs[0].suites = "v2"
    assert "| 2026-11-24 cpu float32 | newest |" in matrix.markdown(results, ["a.json"], None, None, (), SUITES)
    results.runs[0].suites = "v1"
    stale = matrix.stale([("a.json", results)], SUITES)
    assert stale == ["a.json (eng, eng-compile) predates 1 check(s) the suites now have (prefix_new); re-run it"]
    results.runs[0].checks = []
    assert "records no list of its suites' checks" in matrix.stale([("a.json", results)], SUITES)[0]


def test_every_suite_file_has_a_family():
    """A new suite file picks its family (verdicts/suite_index.py FAMILIES): the matrix counts checks per family."""
    suites = Path(__file__).parents[1] / "suites"
    assert sorted(p.stem.removeprefix("test_") for p in suites.glob("test_*.py")) == sorted(FAMILIES)
    assert "other" not in set(index(suites).checks.values())


def test_the_markdown_and_html_pages(tmp_path):
    (tmp_path / "eng.md").write_text("# eng findings\n")
    md = matrix.markdown(_results(), ["a.json"], tmp_path, tmp_path / "m.md", (), SUITES, "kvcompile matrix r -o m.md")
    assert "Regenerate: `kvcompile matrix r -o m.md`" in md
    assert "| engine | verdict | run | suites | tokens | recompiles | memory |\n" in md  # no family without a cell
    assert "| [eng](#eng) | FAIL | 2026-11-24 cpu float32 | ? | ✓\u00a01 | ✗\u00a01 |" in md  # no suites recorded: "?"
    assert "### eng\n" in md and "Findings: [eng](eng.md)" in md and "eng==1.2, transformers==5.23.0" in md
    assert "| recompiles | ✗ fail | llama, mistral-sw | no_recompile: 2 compiles after warmup |" in md
    assert "Not applicable (the engine does not declare what the check needs): kv_memory." in md
    for emoji in ("✅", "❌", "⚠️", "⏭️"):
        assert emoji not in md  # read without an emoji font
    page = matrix.html(_results(), ["a.json"], tmp_path, tmp_path / "m.html", (), SUITES)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert '<td class="fail">✗\u00a01</td>' in page and "no_recompile: 2 compiles after warmup" in page


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
    assert "| [v1](#v1) | FAIL |" in text and "| token_identity | ✗ fail | llama | TokenMismatch: diverges |" in text
    assert "| hf-eager | NO REPORT |" in text  # every engine the project adapts has a row: what is not covered shows
    with pytest.raises(SystemExit):
        cli.main(["matrix", str(new), "-o", str(tmp_path / "m.txt")])
    assert "unknown matrix format '.txt'; end the name in one of .md, .html, .htm" in capsys.readouterr().err


def test_merge_sums_the_per_check_outcomes():
    a, b = _results(), _results()
    row = next(r for r in merge([a, b]).rows if r.engine == "eng" and r.model == "llama")
    assert row.checks["test_recompiles"] == Check(**_check(ran=2, failed=2))
    assert row.versions == ["eng==1.2", "transformers==5.23.0"]


def test_a_kept_file_keeps_what_the_matrix_reads():
    """json_file.kept: failure messages cut to their first lines (the cut said), typed token failures and the live
    status dropped; the matrix of the kept file is the matrix of the full one."""
    full = _results()
    full.rows[0].failures[0].message = "\n".join(f"line {i}" for i in range(30))
    full.rows[0].near_ties = [f"tie {i}" for i in range(20)]
    kept = json_file.kept(full, lines=12)
    assert kept.rows[0].near_ties[-1] == "... (8 more in the full report)" and len(kept.rows[0].near_ties) == 13
    message = kept.rows[0].failures[0].message.splitlines()
    assert message[:12] == [f"line {i}" for i in range(12)] and message[12] == "... (18 more lines in the full report)"
    assert len(message) == 13 and full.rows[0].failures[0].message.count("\n") == 29  # the original is untouched
    assert matrix.build(kept, None, None, (), SUITES)[2] == matrix.build(full, None, None, (), SUITES)[2]
    assert json_file.dumps(json_file.kept(kept, lines=12)) == json_file.dumps(kept)  # keeping a kept file: the same


def test_a_model_the_engine_cannot_run_is_named_not_counted_where_others_ran_the_check():
    found = Collector("cpu", "float32")
    found.add("eng", "llama", tests={"passed": 1}, checks={"test_token_identity": _check(ran=1)})
    found.add("eng", "gpt2-abspos", tests={"skipped": 1}, checks={"test_token_identity": _check(skipped=1)},
              declared_skips=["engine 'eng' does not support model 'gpt2-abspos': Llama only"])
    found.add("gpu-eng", "llama", tests={"skipped": 1}, checks={"test_token_identity": _check(skipped=1)},
              declared_skips=["engine 'gpu-eng' does not declare device 'cpu' (declares devices=['cuda'])"])
    results = found.results()
    results.runs = [RunInfo(**{**RUN, "engines": ["eng", "gpu-eng"]})]
    engines, _, cells = matrix.build(results)
    assert cells["eng", "test_token_identity"] == matrix.Cell("pass", "1 passed", ("llama",))  # not gpt2-abspos
    assert cells["gpu-eng", "test_token_identity"] == matrix.Cell(
        "skip", "engine 'gpu-eng' does not declare device 'cpu' (declares devices=['cuda'])", ("llama",))
    assert engines[0].not_run == ("engine 'eng' does not support model 'gpt2-abspos': Llama only",)
    text = matrix.markdown(results, ["f.json"])
    assert "Not run (every check skipped there):\n\n- engine 'eng' does not support model 'gpt2-abspos': Llama only" \
        in text
    assert "not run: engine &#x27;gpu-eng&#x27; does not declare device" in matrix.html(results, ["f.json"])
