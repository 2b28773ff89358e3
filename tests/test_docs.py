"""The README's and the docs site's facts against their sources, so that they cannot drift (issues 27, 45).

- CI: the docs' CI page is rendered (``<!-- kvcompile: ci -->``) from `.ci/run`'s job header lines
  (`echo "== NAME: ..."`) and `timed NAME` lines, with the seconds of `.ci/timings`, the record `.ci/run` writes;
  no page carries a hand-copied CI table.
- Options, fields, tables: every `--kv-NAME`, `Declaration` field and ``<!-- kvcompile: NAME -->`` directive a page
  names exists; the rendered option table (flags, ini keys, defaults) and each default stated in prose match the
  option table (`plugin.OPTIONS`) and the float32 constants; no page carries a hand-copied option table.
- The oracle self-check allowances quoted in the docs against `ORACLE_CHECK_TOLERANCE`.
- The torch and transformers floors in pyproject.toml against the versions `.ci/run` tests, and the docs' statement.
- Every repository path the docs name exists; README stays short; the site builds with ``mkdocs build --strict``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

from pytest_kvcompile import docs

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI_RUN = (ROOT / ".ci" / "run").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), ROOT / "examples" / "downstream" / "README.md"]
PAGES = ROOT / "docs"


def page(name: str) -> str:
    return (PAGES / name).read_text()


# --- CI jobs and times -----------------------------------------------------------------------------------------------

def ci_jobs(text: str = CI_RUN) -> list[str]:
    """`.ci/run`'s jobs in order, from its header lines: echo "== NAME: what it runs"."""
    return re.findall(r'^echo "== ([a-z0-9-]+): ', text, re.M)


def ci_timed(text: str = CI_RUN) -> list[str]:
    return re.findall(r"^timed ([a-z0-9-]+)$", text, re.M)


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table whose header line starts with `header`."""
    head = text.index(header)
    rows = []
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells, cell, code = [], "", False
        for i, char in enumerate(line.strip()[1:-1]):  # a pipe inside a code span or escaped is the cell's own
            code ^= char == "`"
            if char == "|" and not code and line.strip()[i] != "\\":
                cells, cell = [*cells, cell.strip()], ""
            else:
                cell += char
        rows.append([*cells, cell.strip()])
    return rows


def timings_record(text: str) -> dict[str, int]:
    """The record `.ci/run` writes ($KVCOMPILE_ARTIFACTS/ci-timings, committed as .ci/timings): NAME<TAB>SECONDS."""
    record = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith(("#", "slowest\t")):
            name, seconds = line.split("\t")
            record[name] = int(seconds)
    return record


def check_ci_table(rendered: str, jobs: list[str], record: dict[str, int]) -> list[str]:
    """The rendered CI table against .ci/run's jobs (in order) and the record's seconds ("-": not recorded)."""
    rows = table_rows(rendered, "| job | what it runs | seconds |")
    listed = [cells[0].strip("`") for cells in rows if cells[0] != "**total**"]
    problems = [] if listed == jobs else [f"the CI table lists jobs {listed}, .ci/run has {jobs}"]
    for cells in rows:
        name, seconds = cells[0].strip("`"), cells[-1]
        if name == "**total**":
            want = f"**{record['total']}** (about {round(record['total'] / 60)} min)" if "total" in record else "**-**"
        else:
            want = str(record[name]) if name in record else "-"
        if seconds != want:
            problems.append(f"the CI table gives '{name}' {seconds!r}, .ci/timings {want!r}")
    if not any(cells[0] == "**total**" for cells in rows):
        problems.append("the CI table has no total row")
    for name in set(record) - {"total"} - set(jobs):
        problems.append(f".ci/timings has '{name}', which is no job of .ci/run")
    return problems


def test_the_ci_page_renders_the_jobs_of_ci_run_in_order_with_the_recorded_seconds():
    jobs = ci_jobs()
    assert len(jobs) >= 8, f".ci/run's job headers are not found as 'echo \"== NAME: ...\"': {jobs}"
    assert ci_timed() == jobs, "every .ci/run job ends with 'timed NAME', in the order of the headers"
    assert "<!-- kvcompile: ci -->" in page("reference/ci.md")
    record = timings_record((ROOT / ".ci" / "timings").read_text())
    assert check_ci_table(docs.ci_table(), jobs, record) == []


def test_the_ci_page_shows_the_slowest_tests_the_record_has():
    """`.ci/slowest` appends each test job's 20 slowest tests to the record; the CI page lists them (issue 53)."""
    record = "# x\ntests\t10\nslowest\ttests\t7.5\ttests/test_a.py::test_b[x|y]\ntotal\t10\n"
    rendered = docs.ci_table(run='echo "== tests: the tests"\n', timings=record)
    assert docs.ci_timings(record) == {"tests": "10", "total": "10"}
    assert "| `tests` | `tests/test_a.py::test_b[x|y]` | 7.5 |" in rendered, rendered
    assert docs.ci_slowest() or "slowest" not in (ROOT / ".ci" / "timings").read_text()


def test_the_ci_table_check_fails_on_drift():
    record = timings_record((ROOT / ".ci" / "timings").read_text())
    rendered, jobs = docs.ci_table(), ci_jobs()
    assert check_ci_table(rendered, jobs, {**record, "tests": record["tests"] + 1})
    assert check_ci_table(rendered, jobs, {**record, "total": record.get("total", 0) + 120})
    # another job's seconds (or seconds where the table says "-": a job the record had skipped)
    assert check_ci_table(rendered, jobs, {**record, "newest-transformers": record.get("newest-transformers", 0) + 3})
    assert check_ci_table(rendered, [*jobs, "new-job"], record)
    reordered = CI_RUN.replace('echo "== lint:', 'echo "== lint-moved:')
    assert check_ci_table(docs.ci_table(run=reordered), jobs, record)


def test_no_page_carries_a_hand_copied_ci_or_option_table():
    """CI seconds and option defaults live in one place each (.ci/timings, the option table): pages render them."""
    copied = [f"{path.relative_to(ROOT)}: {header}" for path in DOCS for header in
              ("| job | what it runs | seconds |", "| option | ini") if header in path.read_text()]
    assert not copied
    assert ".ci/timings" not in README and not re.search(r"\b\d[\d,]* s\*\* \(about \d+ min", README)


def test_ci_run_writes_the_record_format_that_the_check_reads(tmp_path):
    """`.ci/run`'s timed() and its total line, run as they are, write what timings_record() reads."""
    import subprocess

    start = CI_RUN.index('TIMINGS="$KVCOMPILE_ARTIFACTS/ci-timings"')
    end = CI_RUN.index("\n}\n", CI_RUN.index("timed() {")) + 3
    total = re.search(r"^printf 'total.*$", CI_RUN, re.M).group(0)
    script = (f"set -euo pipefail\nSECONDS=0\nKVCOMPILE_ARTIFACTS={tmp_path}\n{CI_RUN[start:end]}"
              f'echo "== a: x"\ntimed a\necho "== b: y"\ntimed b\n{total}\n')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^   a: \d+s \(total \d+s\)$", out, re.M), out
    assert list(timings_record((tmp_path / "ci-timings").read_text())) == ["a", "b", "total"]


def test_docs_quote_the_fuzz_budget_ci_passes():
    budgets = set(re.findall(r"--kv-fuzz-budget=(\d+)", CI_RUN))
    fuzzing = (ROOT / "docs" / "fuzzing.md").read_text()
    stated = re.search(r"`\.ci/run`\s+now passes `--kv-fuzz-budget=(\d+)`", fuzzing)
    assert stated is not None and budgets == {stated.group(1)}, (budgets, stated)


# --- options ---------------------------------------------------------------------------------------------------------

def option_table():
    from pytest_kvcompile.plugin import OPTIONS  # every feature's options, as the plugin registers them

    return {o.flag: o for o in OPTIONS}


FLAG = r"--kv-[a-z0-9]+(?:-[a-z0-9]+)*"


def unknown_options(text: str, pytestconfig) -> set[str]:
    unknown = set()
    for flag in set(re.findall(FLAG, text)):
        try:
            pytestconfig.getoption(flag)
        except ValueError:
            unknown.add(flag)
    return unknown


def test_every_kv_option_the_docs_name_exists(pytestconfig):
    unknown = {f"{path.relative_to(ROOT)}: {flag}" for path in [*DOCS, ROOT / ".ci" / "run"]
               for flag in unknown_options(path.read_text(), pytestconfig)}
    assert not unknown, "the docs name options that do not exist"
    assert unknown_options("run it with `--kv-fuzz-rounds=3`", pytestconfig) == {"--kv-fuzz-rounds"}


def contract_fields() -> dict[str, set[str]]:
    """The contract dataclasses an engine author spells out (Declaration and what it holds) -> their fields."""
    import dataclasses

    from pytest_kvcompile.contract import engine

    names = ("Declaration", "KVLayout", "Bounds", "PrefixCache", "Strategy", "Speculative")
    return {name: {f.name for f in dataclasses.fields(getattr(engine, name))} for name in names
            if dataclasses.is_dataclass(getattr(engine, name, None))}


def unknown_fields(text: str, fields: dict[str, set[str]]) -> set[str]:
    """`Declaration.X` anywhere; `Declaration(X=...)` in a python block or an inline code span: X not a field."""
    import ast
    import textwrap

    found = {(cls, name) for cls, name in re.findall(r"\b(" + "|".join(fields) + r")\.([a-z_]\w*)\b", text)
             if name != "of"}  # Strategy.of(...), a constructor
    code = [textwrap.dedent(block) for block in re.findall(r"```python\n(.*?)```", text, re.S)]
    code += re.findall(r"`(\b(?:" + "|".join(fields) + r")\([^`]*\))`", text)
    for snippet in code:
        try:
            tree = ast.parse(snippet)
        except SyntaxError:  # an inline span such as `Bounds(max_prompt=, ...)`: its names, without nesting
            found |= {(snippet.split("(")[0], name) for name in re.findall(r"(?<![\w.])([a-z_]\w*)=", snippet)
                      if "(" not in snippet[snippet.index("(") + 1:]}
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                called = getattr(node.func, "id", getattr(node.func, "attr", ""))
                found |= {(called, k.arg) for k in node.keywords if called in fields and k.arg}
    return {f"{cls}.{name}" for cls, name in found if name not in fields[cls]}


RECORDED = {PAGES / "conformance-matrix.md"}  # generated from recorded reports: it quotes their runs' messages


def with_renamed(fields: dict[str, set[str]]) -> dict[str, set[str]]:
    """`fields` and each class's deprecated spellings (contract/engine.py: renamed_keywords, still accepted)."""
    from pytest_kvcompile.contract import engine

    return {cls: names | set(getattr(getattr(engine, cls), "RENAMED", {})) for cls, names in fields.items()}


def test_every_declaration_field_the_docs_name_exists():
    """Hand-written pages use the current names; a recorded report may quote a message naming a deprecated one."""
    fields = contract_fields()
    assert {"Declaration", "KVLayout", "Bounds"} <= set(fields)
    unknown = {f"{path.relative_to(ROOT)}: {name}" for path in DOCS
               for name in unknown_fields(path.read_text(), with_renamed(fields) if path in RECORDED else fields)}
    assert not unknown, "the docs name Declaration (or KVLayout, Bounds, ...) fields the code does not have"
    # the twins: each spelling of a field that does not exist is caught
    assert unknown_fields("set `Declaration.batched` to", fields) == {"Declaration.batched"}
    assert unknown_fields("```python\nkv_declaration = Declaration(batching=True, cache_bytes=True)\n```",
                          fields) == {"Declaration.cache_bytes"}
    assert unknown_fields('declare `Declaration(eager_name="vllm")`', fields) == {"Declaration.eager_name"}
    assert unknown_fields("`Bounds(max_prompt=8, max_len=9)`", fields) == {"Bounds.max_len"}
    assert unknown_fields("`Bounds(max_prompt=, max_len=)`", fields) == {"Bounds.max_len"}
    assert not unknown_fields('`Declaration(kv_layout=KVLayout("static", max_cache_len=512))`', fields)
    old = '`Declaration(kv_dtype="int8", kv_layout=KVLayout(kind="static", max_cache_len=8))`'  # renamed spellings
    assert unknown_fields(old, fields) == {"Declaration.kv_dtype", "KVLayout.kind"}
    assert not unknown_fields(old, with_renamed(fields))


def test_every_declaration_field_is_in_exactly_one_group():
    """The reference page shows Declaration by concern (contract/engine.py: DECLARATION_GROUPS): a new field must be
    given a group, and a group may name only fields."""
    import dataclasses

    from pytest_kvcompile.contract import engine

    assert docs.group_problems(engine.Declaration, engine.DECLARATION_GROUPS) == []
    rendered = docs.render("contract")
    assert all(f"#### {title}" in rendered for title, _ in engine.DECLARATION_GROUPS)
    # the twins: a field left out, a name that is no field, a field twice
    groups = dict(engine.DECLARATION_GROUPS)
    without = tuple((t, tuple(n for n in names if n != "eager")) for t, names in groups.items())
    assert docs.group_problems(engine.Declaration, without) == ["field 'eager' is in no group"]
    extra = (*engine.DECLARATION_GROUPS, ("Typos", ("batched", "scoring")))
    assert docs.group_problems(engine.Declaration, extra) == ["group 'Typos' names 'batched', not a field",
                                                              "field 'scoring' is in 2 groups"]
    with pytest.raises(ValueError, match="field 'eager' is in no group"):
        docs.grouped_table(engine.Declaration, without)
    assert len(dataclasses.fields(engine.Declaration)) == sum(len(names) for names in groups.values())


DIRECTIVE_LIKE = re.compile(r"<!--\s*kvcompile\b.*?-->")


def unknown_directives(text: str) -> list[str]:
    """``<!-- kvcompile: ... -->`` comments that are not a line of their own naming one of docs.TABLES."""
    return [found.group(0) for found in DIRECTIVE_LIKE.finditer(text)
            if not re.fullmatch(docs.DIRECTIVE.pattern.strip("^$"), found.group(0))
            or found.group(0).split(": ")[1][:-4] not in docs.TABLES
            or not re.search(r"^" + re.escape(found.group(0)) + "$", text, re.M)]


def test_every_directive_the_docs_use_exists_and_renders():
    used = set()
    for path in DOCS:
        text = path.read_text()
        assert unknown_directives(text) == [], f"{path.relative_to(ROOT)}: a directive the code does not render"
        used |= set(docs.DIRECTIVE.findall(text))
    assert used == set(docs.TABLES), "every table docs.py renders is on a page, and only those"
    assert unknown_directives("<!-- kvcompile: option -->") == ["<!-- kvcompile: option -->"]
    assert unknown_directives("<!--kvcompile: ci-->") and unknown_directives("text <!-- kvcompile: ci -->")
    with pytest.raises(KeyError, match="no such table"):
        docs.expand("<!-- kvcompile: option -->")


def rendered_option_rows(text: str) -> dict[str, tuple[str, str, str]]:
    """flag -> (ini cell, default cell, help cell) from the rendered option table."""
    return {re.match(r"`(" + FLAG + ")", cells[0]).group(1): (cells[1], cells[2], cells[3])
            for cells in table_rows(text, "| option | ini key | default | what it does |")}


def documented_default(option) -> str:
    """How the option table writes an option's default: a value in backticks, 'off' for a flag, 'none' for an empty
    one."""
    if option.ini_type == "bool":
        return "off"
    return f"`{option.default}`" if option.default not in ("", None, []) else "none"


def float32_autos():
    from pytest_kvcompile.config.tolerances import (
        DEFAULT_MAX_NEAR_TIE_RATE,
        DEFAULT_MAX_NEAR_TIES,
        DEFAULT_TIE_TOLERANCE,
    )

    return {"--kv-tie-tolerance": DEFAULT_TIE_TOLERANCE["float32"],
            "--kv-max-near-ties": DEFAULT_MAX_NEAR_TIES["float32"],
            "--kv-max-near-tie-rate": DEFAULT_MAX_NEAR_TIE_RATE["float32"]}


def number(text: str) -> float:
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def check_option_table(rendered: str) -> list[str]:
    table, problems = option_table(), []
    rows = rendered_option_rows(rendered)
    for flag in sorted(set(table) - set(rows)):
        problems.append(f"{flag} is missing from the option table")
    autos = float32_autos()
    for flag, (ini, default, what) in rows.items():
        option = table.get(flag)
        if option is None:
            problems.append(f"the option table lists {flag}, which is no option")
            continue
        if ini != f"`{option.ini}`":
            problems.append(f"{flag}: the table's ini key {ini}, the option's {option.ini}")
        if default != documented_default(option):
            problems.append(f"{flag}: the table's default {default!r}, the option's {documented_default(option)!r}")
        if flag in autos:
            stated = re.search(r"'auto' = ([0-9.e%-]+) for float32", what)
            if stated is None or number(stated.group(1)) != autos[flag]:
                problems.append(f"{flag}: the table's float32 auto value ({what!r}), the constant {autos[flag]}")
    return problems


def test_the_option_table_matches_the_options():
    assert "<!-- kvcompile: options -->" in page("reference/options.md")
    assert check_option_table(docs.options_table()) == []


def test_the_option_table_check_fails_on_drift():
    rendered = docs.options_table()
    assert check_option_table(rendered.replace("| `kv_fuzz_budget` | `240` |", "| `kv_fuzz_budget` | `120` |"))
    assert check_option_table(rendered.replace("'auto' = 1e-3 for float32", "'auto' = 1e-2 for float32"))
    assert check_option_table(rendered.replace("| `kv_latency_repeats` |", "| `kv_repeats` |"))
    assert check_option_table(re.sub(r"^\| `--kv-fresh-engine` .*\n", "", rendered, flags=re.M))


# defaults stated in prose: "`--kv-X=V` (default)", "`--kv-X` (default `V`)", "`--kv-X=SECONDS` (default\n240)",
# "By default (`--kv-X=V`)", "`--kv-X=N` (off by default)", "`--kv-X`, `auto` = 1e-3", "`--kv-X` ... (`auto` = 2"
PROSE = [
    (re.compile(r"`(" + FLAG + r")=([^`]+)` \(default\)"), "value"),
    (re.compile(r"`(" + FLAG + r")(?:=[A-Z]+)?` \(default:?\s+`?([^`),;\s]+)`?\)"), "value"),
    (re.compile(r"[Bb]y default \(`(" + FLAG + r")=([^`]+)`\)"), "value"),
    (re.compile(r"(" + FLAG + r")(?:=[A-Z]+)?` \((off) by default\)"), "off"),
    (re.compile(r"`(" + FLAG + r")`[^`]{0,60}?`auto` = ([0-9.e%-]+)"), "auto"),
]


def prose_defaults(text: str) -> list[tuple[str, str, str]]:
    return [(m.group(1), m.group(2), kind) for pattern, kind in PROSE for m in pattern.finditer(text)]


def check_prose(text: str) -> list[str]:
    table, autos, problems = option_table(), float32_autos(), []
    for flag, value, kind in prose_defaults(text):
        option = table[flag]
        if kind == "auto":
            ok = option.default == "auto" and number(value) == autos[flag]
        elif kind == "off":
            ok = option.default in (False, "0", "")
        else:
            ok = value == str(option.default)
        if not ok:
            problems.append(f"{flag}: the docs say the default is {value!r}, the option's is {option.default!r}")
    return problems


def test_defaults_stated_in_prose_match_the_options():
    found = {flag for path in DOCS for flag, _, _ in prose_defaults(path.read_text())}
    # the statements README makes today: the patterns must keep finding them
    assert {"--kv-isolate", "--kv-compile-backend", "--kv-fuzz", "--kv-fuzz-profile", "--kv-fuzz-budget",
            "--kv-tie-tolerance", "--kv-max-near-ties", "--kv-max-near-tie-rate"} <= found
    assert [p for path in DOCS for p in check_prose(path.read_text())] == []


def test_the_prose_check_fails_on_drift():
    assert check_prose("`--kv-fuzz-budget=SECONDS` (default\n120)")
    assert check_prose("By default (`--kv-isolate=all`) every")
    assert check_prose("`--kv-max-near-ties` in one sequence (`auto` = 3 for float32)")
    assert check_prose("`--kv-compile-backend` (default `eager`)")
    assert not check_prose("`--kv-compile-backend` (default `inductor`)")


# --- the oracle's self-check -----------------------------------------------------------------------------------------

def section(text: str, heading: str) -> str:
    """The text under a Markdown heading, up to the next heading."""
    at = text.index(heading) + len(heading)
    found = re.search(r"^#", text[at:], re.M)
    return text[at:at + found.start()] if found else text[at:]


def stated_self_check(text: str) -> dict[str, float]:
    """dtype -> allowance from the "The oracle checks itself" section of How verdicts are decided."""
    part = section(text, "## The oracle checks itself")
    stated = {dtype: float(v) for v, dtype in re.findall(r"([0-9][0-9.e-]*)\s+(float32|bfloat16|float16)\b", part)}
    for value in re.findall(r"([0-9][0-9.e-]*)\s+for the\s+float64 truth", part):
        stated["float64"] = float(value)
    return stated


def test_the_oracle_self_check_allowances_are_the_constants():
    from pytest_kvcompile.oracles.store import ORACLE_CHECK_TOLERANCE

    verdicts = page("explanation/verdicts.md")
    assert stated_self_check(verdicts) == ORACLE_CHECK_TOLERANCE
    precision = page("precision.md")
    assert float(re.search(r"float64 recompute without a cache, ([0-9.e-]+)\)", precision).group(1)) == (
        ORACLE_CHECK_TOLERANCE["float64"])
    drifted = verdicts.replace("1.0 bfloat16", "0.5 bfloat16")
    assert stated_self_check(drifted) != ORACLE_CHECK_TOLERANCE


# --- versions --------------------------------------------------------------------------------------------------------

def floor(pyproject: str, package: str) -> str:
    return re.search(rf'"{package}>=([0-9.]+)"', pyproject).group(1)


def test_the_torch_and_transformers_floors_are_what_ci_tests():
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_ci = re.findall(r"pip install --quiet torch==([0-9.]+)", CI_RUN)
    transformers_ci = sorted(re.findall(r"pip install --quiet transformers==([0-9.]+)", CI_RUN), key=Version)
    assert len(torch_ci) == 1 and transformers_ci
    torch_floor, transformers_floor = floor(pyproject, "torch"), floor(pyproject, "transformers")
    assert Version(torch_floor) == Version(torch_ci[0]), "pyproject allows a torch CI does not test"
    assert Version(transformers_floor).release == Version(transformers_ci[0]).release[:len(
        Version(transformers_floor).release)], "pyproject allows a transformers CI does not test"
    downstream = (ROOT / "examples" / "downstream" / "pyproject.toml").read_text()
    assert floor(downstream, "torch") == torch_floor and floor(downstream, "transformers") == transformers_floor
    versions = page("reference/versions.md")
    for stated in (f"**torch {torch_ci[0]}**", f"`torch>={torch_floor}`", f"**transformers {transformers_ci[0]}**",
                   f"`transformers>={transformers_floor}`"):
        assert stated in versions, f"docs/reference/versions.md does not say {stated}"
    assert f"torch {torch_ci[0]}" in README and f"transformers from {transformers_ci[0]}" in README


# --- packages ---------------------------------------------------------------------------------------------------------

def package_dirs() -> set[str]:
    found = {"pytest_kvcompile.suites", "reference_impls"}  # suites/ is installed as pytest_kvcompile.suites
    for init in (ROOT / "pytest_kvcompile").glob("**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_pyproject_lists_every_package():
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    assert set(re.findall(r'"([\w.]+)"', listed)) == package_dirs()


def test_the_architecture_page_describes_every_subpackage():
    described = set(re.findall(r"^\| `([a-z_]+)/` \|", page("explanation/architecture.md"), re.M))
    assert described == {name.split(".")[1] for name in package_dirs() if name.count(".") == 1} - {"suites"}


# --- code blocks -----------------------------------------------------------------------------------------------------

def python_blocks():
    import textwrap

    for path in DOCS:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            yield path, textwrap.dedent(block)


def test_docs_python_blocks_compile_and_import_what_exists():
    import importlib.util

    problems, blocks = [], 0
    for path, code in python_blocks():
        blocks += 1
        compile(code, str(path), "exec")
        for module, names in re.findall(r"^from (pytest_kvcompile[\w.]*|reference_impls[\w.]*) import ([\w, ]+)$", code,
                                        re.M):
            found = importlib.import_module(module)
            problems += [f"{path.relative_to(ROOT)}: from {module} import {name}"
                         for name in map(str.strip, names.split(",")) if not hasattr(found, name)
                         and importlib.util.find_spec(f"{module}.{name}") is None]
    assert blocks >= 3
    assert not problems, "the docs' code imports names that do not exist"


# --- paths -----------------------------------------------------------------------------------------------------------

SUBPACKAGES = "contract|engines|latency|memory|models|oracles|recompiles|reports|run|config|verdicts"
PATH = re.compile(r"(?<![\w./$-])((?:\.ci|benchmarks|docs|examples|pytest_kvcompile|reference_impls|suites|tests|"
                  + SUBPACKAGES + r")/[\w./-]*\w)")


def repository_files():
    """The tracked tree (what a clean clone has), so a file lying only in this checkout does not count."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = set(listed.split())
    return files | {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}


def output_dirs():
    """The ignored output folders (.gitignore's `/reports/`): paths in them are what a command writes."""
    return {line.strip("/") for line in (ROOT / ".gitignore").read_text().split() if re.fullmatch(r"/[\w.-]+/", line)}


def test_every_repository_path_the_docs_name_exists():
    tracked, outputs, missing = repository_files(), output_dirs(), set()
    assert "reports" in outputs

    def exists(path):
        if tracked is None:
            return path.exists()
        return path.resolve().is_relative_to(ROOT) and str(path.resolve().relative_to(ROOT)) in tracked

    for path in DOCS:
        for name in PATH.findall(path.read_text()):
            if re.search(r"[A-Z]{2,}", name):  # a placeholder: reports/NAME.json
                continue
            bases = [ROOT, ROOT / "pytest_kvcompile", ROOT / "examples" / "downstream", path.parent]
            if any(exists(base / name) for base in bases):
                continue
            if name.split("/")[0] in outputs and not name.endswith(".py"):  # a report the command beside it writes
                continue
            missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "the docs name files that do not exist in the tracked tree"


# --- the README and the site ------------------------------------------------------------------------------------------

def test_the_readme_stays_short_and_points_to_the_site():
    lines = README.count("\n")
    assert lines <= 150, f"README.md has {lines} lines: move what a first read does not need to docs/"
    assert "mkdocs serve" in README
    for target in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"


def test_the_site_builds_strict_with_the_tables_rendered(tmp_path):
    """`mkdocs build --strict` (warnings are errors: a broken link, a page missing from nav, an unknown directive)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]' to build the "
                                           "site (.ci/run's docs job builds it)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    options = (tmp_path / "site" / "reference" / "options" / "index.html").read_text()
    assert "kvcompile:" not in options and all(flag in options for flag in option_table())
    ci = (tmp_path / "site" / "reference" / "ci" / "index.html").read_text()
    assert all(f"<code>{job}</code>" in ci for job in ci_jobs())
