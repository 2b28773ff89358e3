"""Run results and reports: files written by real runs (pytester subprocesses, also under -n 2), the
baseline comparison, corrupt result files, rendering, and ``kvcompile merge``.

Engines: kv_test_engines:Greedy (correct, runs the tiny Llama), and kv_test_engines_latency:Instant
(answers zeros at once: token identity fails on it) and Sleepy (sleeps per token)."""

import dataclasses
import json

import pytest

from conftest import run_suites
from pytest_kvcompile import cli
from pytest_kvcompile.reports import baseline, html, json_file, markdown
from pytest_kvcompile.reports.json_file import SCHEMA_VERSION, ResultsFileError
from pytest_kvcompile.verdicts.collect import Collector
from pytest_kvcompile.verdicts.failures import Kind, Problem
from pytest_kvcompile.verdicts.record import MergeError, Record
from pytest_kvcompile.verdicts.results import Results, merge
from pytest_kvcompile.verdicts.rows import SHOWN, Compiles, FailureEntry, Row, RunInfo

GREEDY = "kv_test_engines:Greedy"
INSTANT = "kv_test_engines_latency:Instant"
SLEEPY = "kv_test_engines_latency:Sleepy"
OPTS = ("-p", "no:benchmark", "--kv-latency-repeats=3")
LATENCY = "test_latency and not benchmark"
FAIL_ON = "--kv-fail-on=latency:10%,memory:5%,recompiles:0"


def _rows(path):
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == json_file.KIND
    return data, {row["engine"]: row for row in data["rows"]}


def test_reports_are_written(kvtester):
    out = kvtester.path
    result = run_suites(kvtester, f"--kv-engine={GREEDY}", f"--kv-engine={INSTANT}", *OPTS,
                        "-k", f"({LATENCY}) or (test_token_identity and short7)",
                        f"--kv-report-json={out / 'r.json'}", f"--kv-report-md={out / 'r.md'}",
                        f"--kv-report-html={out / 'r.html'}")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*kvcompile: results per engine and model*", "engine * model * device * tests*",
                                 f"{GREEDY} * llama * cpu float32 * 2 passed * 1/1 *"])
    data, rows = _rows(out / "r.json")
    run = data["runs"][0]
    assert run["engines"] == [GREEDY, INSTANT] and run["device"] == "cpu" and run["torch"] and run["transformers"]
    greedy, instant = rows[GREEDY], rows[INSTANT]
    assert greedy["tests"]["passed"] == 2 and greedy["tokens"]["identical"] == 1 and greedy["kv_bytes"] is None
    assert instant["tests"] == {**instant["tests"], "passed": 1, "failed": 1} and instant["tokens"]["mismatch"] == 1
    assert "TokenMismatch" in instant["failures"][0]["message"]
    typed = instant["failures"][0]  # schema 2: the verdict as data, its kind and fields (verdicts/failures.py)
    assert typed["kind"] == "mismatch" and typed["failure"]["kind"] == "mismatch"
    assert (typed["failure"]["engine"], typed["failure"]["model"], typed["failure"]["step"]) == (INSTANT, "llama", 0)
    assert typed["failure"]["hint"].startswith("step 0 is decided by prefill alone") and data["problems"] == []
    counted = {k: v for k, v in instant["checks"]["test_token_identity"].items() if k not in ("seconds", "engine_s")}
    assert counted == {"ran": 1, "failed": 1, "xfailed": 0, "skipped": 0, "reason": ""}
    for row in (greedy, instant):  # each check's time, of it the engine's: the row's generate() time is theirs
        checks = row["checks"].values()
        assert all(c["seconds"] >= c["engine_s"] >= 0 for c in checks), row["checks"]
        assert sum(c["engine_s"] for c in checks) == pytest.approx(row["generate_s"], abs=1e-3)
    assert cli.main(["matrix", str(out / "r.json"), "-o", str(out / "m.md")]) == 0  # the conformance matrix of it
    table = (out / "m.md").read_text()
    verdict = {line.split("]")[0][3:]: line.split(" | ")[1] for line in table.splitlines() if line.startswith("| [")}
    assert (verdict[GREEDY], verdict[INSTANT]) == ("PASS", "FAIL")
    note = next(line for line in table.splitlines() if line.startswith("| token_identity | ✗ fail | llama | "))
    assert f"engine '{INSTANT}' diverges from the oracle" in note
    kv = instant["kv_bytes"]  # the latency probe records what kv_cache_bytes() reported, nothing expected
    assert (kv["expected"], kv["measured"], kv["layers"]) == (None, (32 + 1 + 8) * 64, [])
    for row in (greedy, instant):
        assert len(row["latency"]["prefill_ms"]) == 3 and set(row["latency"]["decode"]) == {"median", "p90"}
    result.stdout.fnmatch_lines(["*kvcompile: verdict per engine*", f"FAIL  {INSTANT}: 1 passed, 1 failed (1 model)",
                                 f"PASS  {GREEDY}: 2 passed (1 model)"], consecutive=False)
    result.stdout.fnmatch_lines([f"kvcompile: {GREEDY} / llama: built in * s", "*kvcompile: slowest engine builds (2)*",
                                 f"* s  {GREEDY} / llama"])
    result.stdout.fnmatch_lines(["*kvcompile: time in the engines vs the harness*", "* s  * / llama in generate()",
                                 "engines * s of the tests' * s (*%; every worker's), the harness * s (*%: oracle, "
                                 "checks, * s of engine builds, pytest)",
                                 "the slowest checks (every engine and model):", "* s  test_* (engines * s)"])
    assert greedy["generate_s"] > 0 and instant["generate_s"] > 0  # every generate() call's seconds
    md = (out / "r.md").read_text().splitlines()
    assert md[0] == "## pytest-kvcompile results"
    assert f"- :x: **FAIL** `{INSTANT}`: 1 passed, 1 failed (1 model)" in md
    assert f"- :white_check_mark: **PASS** `{GREEDY}`: 2 passed (1 model)" in md
    assert any(line.startswith(f"| {GREEDY} | llama | cpu float32 | 2 passed | 1/1 |") for line in md)
    assert any(line.startswith(f"| {INSTANT} | llama | cpu float32 | 1 passed, 1 failed | 0/1 |") for line in md)
    page = (out / "r.html").read_text()
    verdicts = page.split('<ul class="verdicts">')[1].split("</ul>")[0]
    assert f'<span class="verdict v-FAIL">FAIL</span> <a href="#engine-{INSTANT}">{INSTANT}</a>' in verdicts
    assert f'<span class="verdict v-PASS">PASS</span> <a href="#engine-{GREEDY}">{GREEDY}</a>' in verdicts
    for engine in (GREEDY, INSTANT):
        section = page.split(f'<section class="engine" id="engine-{engine}">')[1].split("</section>")[0]
        assert "<table>" in section and section.count("<svg") == 4, engine  # medians, and every repeat


def test_progress_lines_are_quiet_under_q_and_known_findings_show_in_the_verdict(kvtester):
    result = run_suites(kvtester, f"--kv-engine={INSTANT}", "-q", "-k",
                        "test_token_identity and short7 and not batched",
                        f"--kv-known-finding={INSTANT} | test_token_identity | mismatch | answers zeros")
    result.assert_outcomes(xfailed=1)
    assert "built in" not in result.stdout.str()
    result.stdout.fnmatch_lines([f"PASS with known findings  {INSTANT}: 1 xfailed (1 model)"])


def test_xdist_workers_merge_and_baseline_regression_fails_the_run(kvtester):
    out = kvtester.path
    old = json.loads(json_file.dumps(_hand_made_baseline()))
    (out / "baseline.json").write_text(json.dumps(old))
    result = run_suites(kvtester, f"--kv-engine={SLEEPY}", f"--kv-engine={INSTANT}", *OPTS, "-n", "2", "-k", LATENCY,
                        f"--kv-report-json={out / 'r.json'}",
                        f"--kv-baseline={out / 'baseline.json'}", FAIL_ON)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # every test passed: the regressions fail the run
    result.stdout.fnmatch_lines([
        "*kvcompile: 3 regression(s) vs baseline *baseline.json (3 number(s) compared)*",
        f"memory: {INSTANT} / llama / cpu / float32: KV-cache bytes 1 -> 2624 (+262300.0%, allowed +5%)",
        f"latency: {SLEEPY} / llama / cpu / float32: decode median ms/token 1e-06 -> * (+*%, allowed +10%)",
        f"latency: {SLEEPY} / llama / cpu / float32: prefill median ms 1e-06 -> * (+*%, allowed +10%)",
        "not compared: gone-engine / llama / cpu / float32: only in the baseline",
    ])
    _, rows = _rows(out / "r.json")  # the controller merged what the workers measured
    assert sorted(rows) == [INSTANT, SLEEPY]
    assert all(row["tests"]["passed"] == 1 and len(row["latency"]["prefill_ms"]) == 3 for row in rows.values())


def test_corrupt_baseline_is_a_usage_error(kvtester):
    bad = kvtester.path / "bad.json"
    bad.write_text('{"schema_version": 1,')
    result = run_suites(kvtester, f"--kv-engine={INSTANT}", f"--kv-baseline={bad}", FAIL_ON)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --kv-baseline: {bad}: not valid JSON (*); "
                                 f"give a file written by --kv-report-json"])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def _collector(device="cpu", scale=1.0):
    found = Collector(device, "float32")
    latency = {"prompt_len": 32, "decode_tokens": 8, "timer": "perf_counter"}
    found.add("hf-eager", "llama", tests={"passed": 3}, tokens={"identical": 3},
              latency={**latency, "prefill_ms": [2.0 * scale], "decode_ms_per_token": [1.0 * scale]})
    found.add("my-engine", "llama", tests={"passed": 2, "failed": 1}, tokens={"identical": 1, "near_tie": 1},
              near_tie_tokens=1,
              near_ties=["my-engine / llama / short7 (alone): near tie at step 2"],
              failures=[{"test": "suites/test_recompiles.py::x", "kind": "recompile",
                         "message": "recompiled after warmup", "failure": None}],
              compiles={"warmup": 2, "after_warmup": 1,
                        "reasons": ["recompile 0/1 of forward: guard failed: L['x'].size()[1] == 7"]},
              kv_bytes={"expected": 4096, "measured": 8192},
              latency={**latency, "prefill_ms": [3.0 * scale], "decode_ms_per_token": [0.5 * scale]})
    return Results([RunInfo(device=device, engines=["hf-eager", "my-engine"])], found.results().rows)


def _hand_made_baseline():
    """A baseline in which Sleepy was impossibly fast and Instant's KV cache tiny."""
    found = Collector("cpu", "float32")
    found.add(SLEEPY, "llama", latency={"prompt_len": 32, "decode_tokens": 8, "timer": "perf_counter",
                                        "prefill_ms": [1e-6], "decode_ms_per_token": [1e-6]})
    found.add(INSTANT, "llama", kv_bytes={"expected": None, "measured": 1})
    found.add("gone-engine", "llama", compiles={"warmup": 1, "after_warmup": 0, "reasons": []})
    return found.results()


def test_markdown_and_html_show_every_column():
    results = _collector()
    md = markdown.render(results)
    assert "| my-engine | llama | cpu float32 | 2 passed, 1 failed | 1/2 | 1 | 0 / 2 / 1 | 4.0 KiB / 8.0 KiB " \
           "| 3.000 (3.000) | 0.500 (0.500) | 2000.0 | 1.50 / 0.50 |" in md
    assert "- recompile 0/1 of forward: guard failed: L['x'].size()[1] == 7" not in md  # listed with the engine
    assert "- my-engine / llama: recompile 0/1 of forward: guard failed: L['x'].size()[1] == 7" in md
    page = html.render(results)
    assert page.count('<section class="engine"') == 2 and page.count("<svg") == 2 * 2 + 1  # + decode by engine
    assert "guard failed: L[&#x27;x&#x27;].size()[1] == 7" in page


@pytest.mark.parametrize("spec", ["latency:10", "memory:-5%", "recompiles:1%", "speed:10%", "latency"])
def test_bad_fail_on_names_the_syntax(spec):
    with pytest.raises(ValueError, match="latency:10%,memory:5%,recompiles:0"):
        baseline.parse_fail_on(spec)


def test_baseline_compare_lists_moved_numbers():
    old, new = _collector(), _collector(scale=1.2)
    new.rows[1].compiles.after_warmup = 3
    changes, notes = baseline.compare(old, new, baseline.parse_fail_on("latency:25%,recompiles:1"))
    assert [c.line() for c in changes if c.regressed] == [
        "recompiles: my-engine / llama / cpu / float32: compiles after warmup 1 -> 3 (+2, allowed +1)"]
    assert len(changes) == 6 and sum(c.checked for c in changes) == 5 and notes == []  # memory: shown, not checked
    assert [c.line() for c in changes if not c.checked] == [
        "memory: my-engine / llama / cpu / float32: KV-cache bytes 8192 -> 8192 (+0.0%, not checked)"]


@pytest.mark.parametrize(("content", "problem"), [
    ("not json", "not valid JSON"),
    ('{"kind": "pytest-kvcompile-results", "schema_version": 99, "runs": [], "rows": []}',
     "schema_version 99 is not supported"),
    ('{"kind": "pytest-kvcompile-results", "schema_version": 1, "runs": []}', "missing key 'rows'"),
    ('{"kind": "pytest-kvcompile-results", "schema_version": 1, "runs": [], "rows": [{"engine": "e"}]}',
     "rows\\[0\\]: missing key 'model'"),
    ('{"schema_version": 1}', "not a pytest-kvcompile results file"),
])
def test_corrupt_results_files_name_the_file_and_problem(tmp_path, capsys, content, problem):
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(ResultsFileError, match=f"{path}: {problem}"):
        json_file.load(path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["merge", str(path), "-o", str(tmp_path / "out.html")])
    assert exc.value.code == 2
    assert f"kvcompile: error: {path}: " in capsys.readouterr().err


def test_merge_cli_joins_a_cpu_and_a_gpu_job(tmp_path, capsys):
    cpu, gpu, again = tmp_path / "cpu.json", tmp_path / "gpu.json", tmp_path / "again.json"
    cpu.write_text(json_file.dumps(_collector("cpu")))
    gpu.write_text(json_file.dumps(_collector("cuda:0", scale=0.1)))
    again.write_text(json_file.dumps(_collector("cpu", scale=3)))
    for name in ("report.html", "report.md", "report.json"):
        assert cli.main(["merge", str(cpu), str(gpu), str(again), "-o", str(tmp_path / name)]) == 0
    merged = json_file.load(tmp_path / "report.json")
    assert len(merged.runs) == 3 and len(merged.rows) == 4  # 2 engines x (cpu, cuda:0)
    cpu_row = next(r for r in merged.rows if r.engine == "my-engine" and r.device == "cpu")
    assert cpu_row.tests.passed == 4 and cpu_row.latency.prefill_ms == [3.0, 9.0]  # samples pooled
    assert "| my-engine | llama | cuda:0 float32 |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "report.html").read_text().count('<section class="engine"') == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["merge", str(cpu), "-o", str(tmp_path / "report.txt")])
    assert exc.value.code == 2 and "unknown report format '.txt'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0 and "merge" in capsys.readouterr().out


def test_merging_different_latency_protocols_is_refused():
    a, b = _collector(), _collector()
    b.rows[0].latency.prompt_len = 64
    with pytest.raises(ValueError, match="hf-eager / llama / cpu / float32: latency measured with different protocols"):
        merge([a, b])


def test_markdown_fits_a_github_summary_and_says_what_was_cut():
    row = Collector("cpu", "float32").row("engine", "llama")
    row.tests.failed = 5000
    row.failures = [FailureEntry(f"test_x[{i}]", Kind.MISMATCH, "TokenMismatch: " + "x" * 80) for i in range(5000)]
    text = markdown.render(Results(rows=[row]))
    assert len(text) <= markdown.LIMIT
    assert "**FAIL** `engine`: 5000 failed (1 model)" in text
    assert "<summary>failures (5000)</summary>" in text
    assert "more not shown (the report is kept under 65,000 characters for GitHub" in text
    small = markdown.render(Results(rows=[Collector("cpu", "float32").row("engine", "llama")]))
    assert "more not shown" not in small


V1_ROW = {"engine": "e", "model": "llama", "device": "cpu", "dtype": "float32",
          "tests": {"passed": 1, "failed": 2, "skipped": 0, "xfailed": 0, "xpassed": 0, "error": 0},
          "tokens": {"identical": 1, "near_tie": 0, "mismatch": 1}, "near_ties": [],
          "failures": [{"test": "t::recompiles", "message": "no_recompile: 2 compiles after warmup"},
                       {"test": "t::tokens", "message": "TokenMismatch: ...",
                        "diff": {"prompt": "prompt 'short7'", "where": "index 1 of a batch of lengths [7, 48]",
                                 "prompt_tail": [1, 2], "prompt_length": 7, "oracle": [1, 2, 3], "engine": [1, 9, 3],
                                 "step": 1, "gap": 2.5, "tolerance": 0.001, "top3": [[2, 4.0], [9, 1.5]],
                                 "near_ties": [], "kind": "mismatch", "hint": "prefill was right; ..."}}],
          "compiles": None, "kv_bytes": None, "latency": None}


def test_a_schema_1_file_is_read_and_upgraded_to_typed_verdicts(tmp_path):
    """Baselines and merge inputs written before typed verdicts keep working (issue 27)."""
    old = tmp_path / "v1.json"
    old.write_text(json.dumps({"schema_version": 1, "kind": json_file.KIND, "runs": [], "rows": [V1_ROW]}))
    found = json_file.load(old)
    plain, token = found.rows[0].failures
    assert (plain.kind, plain.failure) == (Kind.OTHER, None) and found.problems == []
    assert token.kind == Kind.MISMATCH and token.failure.hint.startswith("prefill was right; decode step 1")
    assert (token.failure.step, token.failure.gap, token.failure.tokens) == (1, 2.5, (1, 9, 3))
    assert token.failure.where.note == "index 1 of a batch of lengths [7, 48]"
    again = tmp_path / "v3.json"
    again.write_text(json_file.dumps(found))
    assert json.loads(again.read_text())["schema_version"] == SCHEMA_VERSION == 3
    assert json_file.load(again).rows[0].failures == found.rows[0].failures
    assert "token-diff" in html.render(found, None)  # the old diff still draws
    changes, notes = baseline.compare(found, found, {"recompiles": 0})
    assert notes == [] and not any(c.regressed for c in changes)


def test_an_unknown_failure_kind_is_refused_naming_the_kinds(tmp_path):
    row = {**V1_ROW, "failures": [{"test": "t", "kind": "mystery", "message": "", "failure": None}]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 2, "kind": json_file.KIND, "runs": [], "rows": [row]}))
    with pytest.raises(ResultsFileError,
                       match=r"rows\[0\].failures\[0\].kind: unknown kind 'mystery' \(one of mismatch, "):
        json_file.load(bad)


def test_a_run_rule_fails_the_engine_it_names_in_its_field_not_in_its_words():
    from pytest_kvcompile.reports.table import verdict_lines

    found = Collector("cpu", "float32")
    for engine in ("a", "b"):
        found.add(engine, "llama", tests={"passed": 1})
    rule = Problem(Kind.VACUOUS, "a", "cpu", "float32", "no token verified (compare engine 'b')", "llama")
    lines = verdict_lines(found.results().rows, [rule])
    assert lines == ["FAIL  a: 1 passed, 1 run rule(s) failed (1 model)", "PASS  b: 1 passed (1 model)"]
    assert rule.line == "engine 'a' on model 'llama' (cpu, float32): no token verified (compare engine 'b')"
    assert Problem.from_dict(rule.to_dict()) == rule
    results = Results(rows=found.results().rows, problems=[rule])
    assert f"- :x: run rule (vacuous): {rule.line}" in markdown.render(results)
    assert "run rule (vacuous): engine &#x27;a&#x27; on model" in html.render(results, None)


def _records(kind=Row, seen=None):
    """Every Record type reachable from `kind` through its fields."""
    seen = seen if seen is not None else {}
    seen[kind.__name__] = kind
    for f in dataclasses.fields(kind):
        nested = f.metadata.get("record")
        if nested is not None and nested.__name__ not in seen:
            _records(nested, seen)
    return seen


def test_every_field_of_every_record_has_a_merge_rule_and_survives_json():
    """A field declared without its rule (verdicts/record.py: rule) would be dropped by a merge or the JSON."""
    kinds = _records()
    assert {"Row", "Compiles", "TimelineCall", "Compile", "KVBytes", "LayerBytes", "Timings", "Speculation",
            "OracleFacts", "Round", "Check", "FailureEntry", "Outcomes", "Tokens"} <= set(kinds)
    for name, kind in kinds.items():
        assert issubclass(kind, Record), name
        for f in dataclasses.fields(kind):
            assert "merge" in f.metadata, f"{name}.{f.name} has no merge rule"


def _full_row(scale=1):
    """A row with every field set away from its default."""
    return Row(
        "e", "m", "cpu", "float32", tests={"passed": 2 * scale, "failed": 1}, tokens={"identical": scale},
        near_ties=[f"tie {scale}"], verified_tokens=5, near_tie_tokens=1, token_checks=1, evicting=1, evictions=3,
        builds=1, build_s=0.5, generate_s=0.25, declared_skips=[f"why {scale}"], excluded_ids=[2], excluded_tokens=1,
        oracle_errors=["bad"], checks={"test_x": {"ran": 1, "reason": ""}}, versions=["x==1"],
        failures=[FailureEntry(f"t{scale}", Kind.MEMORY, "grew")],
        compiles={"build": 1, "warmup": 2, "after_warmup": scale, "reasons": [f"r{scale}"], "graph_breaks": ["b"],
                  "eager_runs": 1, "cuda_graph_captures": {"build": scale},
                  "timeline": [{"phase": "build", "call": "the factory",
                                "compiles": [{"id": "0/0", "frame": "f", "recompile": False, "guards": ["g"],
                                              "graph_breaks": 0}]}]},
        kv_bytes={"expected": 8, "measured": 8 * scale, "held": 8, "layout": "static", "call": "c",
                  "layers": [{"layer": 0, "kind": "full", "positions": 4, "why": "w", "bytes": 8}]},
        latency={"prompt_len": 32, "decode_tokens": 8, "timer": "t", "prefill_ms": [1.0 * scale],
                 "decode_ms_per_token": [0.5]},
        noise={"flip_rate": 0.1}, eviction_noise={"policy": "h2o"}, router_noise={"tolerance": 0.01 * scale},
        fuzz_coverage={"covered": scale, "calls": 3},
        speculation={"k": 4, "steps": 2, "drafted": 8, "accepted": 3, "lengths": {"1/4": 1, "2/4": 1}},
        oracle={"source": "s", "engine": True, "limitations": [f"l{scale}"]}, sequences={f"s{scale}": [4, 1]},
        scored={f"c{scale}": [3, 0]}, concurrency={"alone": {"identical": 1}})


def test_a_row_reads_back_field_by_field_and_merges_every_field():
    """The JSON schema is the dataclasses (verdicts/rows.py): what is written reads back equal; a merge keeps every
    field (a field written but never merged is a failure here)."""
    from pytest_kvcompile.verdicts.collect import _typed

    row = Row(**{f.name: _typed(f.name, getattr(_full_row(), f.name)) for f in dataclasses.fields(Row)})
    default = Row("e", "m", "cpu", "float32")
    assert [f.name for f in dataclasses.fields(Row)[4:] if getattr(row, f.name) == getattr(default, f.name)] == []
    text = json_file.dumps(Results(rows=[row]))
    assert json_file.loads(text).rows == [row]
    other = Row(**{f.name: _typed(f.name, getattr(_full_row(2), f.name)) for f in dataclasses.fields(Row)})
    merged = merge([Results(rows=[row]), Results(rows=[other])]).rows[0]
    assert merged.tests.passed == 6 and merged.compiles.after_warmup == 2 and merged.compiles.reasons == ["r1", "r2"]
    assert merged.latency.prefill_ms == [1.0, 2.0] and merged.speculation.steps == 4
    assert merged.concurrency["alone"].identical == 2 and merged.checks["test_x"].ran == 2
    assert merged.kv_bytes.measured == 16 and merged.oracle.limitations == ["l1", "l2"]
    assert set(merged.sequences) == {"s1", "s2"} and len(merged.failures) == 2


def test_every_row_field_is_shown_by_the_renderer_named_for_it():
    """SHOWN names, per field, the functions that read it: each must read it (a field nobody shows is a failure)."""
    import importlib
    import inspect

    assert set(SHOWN) == {f.name for f in dataclasses.fields(Row)}
    for name, places in SHOWN.items():
        for place in places:
            module, _, function = place.partition(":")
            target = importlib.import_module(f"pytest_kvcompile.{module}")
            for part in function.split("."):
                target = getattr(target, part)
            assert f".{name}" in inspect.getsource(target), f"{place} does not read row field {name!r}"


def test_a_record_given_as_a_dict_to_kv_record_names_a_wrong_key():
    """Downstream kv_record.metric calls may pass a dict for a record: its keys must be the record's fields."""
    found = Collector("cuda", "bfloat16")
    found.add("e", "m", compiles={"warmup": 1, "after_warmup": 0, "reasons": []})
    assert found.row("e", "m").compiles == Compiles(warmup=1)
    with pytest.raises(TypeError, match=r"compiles has keys \['cuda_graphs'\] that are no fields of Compiles"):
        found.add("e", "m", compiles={"warmup": 1, "cuda_graphs": 1})
    with pytest.raises(TypeError, match="'kv_byte' is not a field of a results row"):
        found.add("e", "m", kv_byte=1)
    with pytest.raises(MergeError, match="latency measured with different protocols"):
        found.add("e", "m", latency={"prompt_len": 1, "decode_tokens": 1, "timer": "t", "prefill_ms": [1.0],
                                     "decode_ms_per_token": [1.0]})
        found.add("e", "m", latency={"prompt_len": 2, "decode_tokens": 1, "timer": "t", "prefill_ms": [1.0],
                                     "decode_ms_per_token": [1.0]})


def test_no_report_field_is_read_or_written_by_string_key_outside_the_row_module():
    """The reports, the suites, the fixtures and the commands use the records' attributes (issue 45): a row field
    spelled as a string key outside verdicts/rows.py would be a field the dataclasses do not check."""
    import re
    from pathlib import Path

    import pytest_kvcompile

    names = {f.name for kind in _records().values() for f in dataclasses.fields(kind)}
    names |= {f.name for kind in (Results, RunInfo) for f in dataclasses.fields(kind)}
    package = Path(pytest_kvcompile.__file__).parent
    files = [*package.glob("reports/*.py"), package / "run" / "fixtures.py", package / "latency" / "marker.py",
             package / "cli.py", package / "check_engine.py", package / "plugin.py",
             *(package.parent / "suites").glob("*.py")]
    pattern = re.compile(r"""(?:\[|\.get\(|\.setdefault\()\s*["']([a-z_0-9]+)["']""")
    from pytest_kvcompile.latency import marker as latency_marker

    arguments = set(latency_marker.SPEC.signature.parameters)  # the marker's own arguments, read as it validates them
    found = [f"{path.relative_to(package.parent)}:{n}: {m.group(0)}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) for m in pattern.finditer(line)
             if m.group(1) in names and not (path.name == "marker.py" and m.group(1) in arguments)]
    assert found == []
