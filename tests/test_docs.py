"""The README's and docs' numbers against their sources, so that they cannot drift (issue 27).

- CI: README's job table against `.ci/run`'s job header lines (`echo "== NAME: ..."`) and `timed NAME` lines, and its
  seconds against `.ci/timings`, the record `.ci/run` writes (copied from a fresh-clone run).
- Options: every `--kv-NAME` the docs mention is a registered option; README's option table (flags, ini keys,
  defaults) and each default stated in prose against the option table (`plugin.OPTIONS`) and the float32 constants.
- The oracle self-check allowances quoted in README and docs/precision.md against `ORACLE_CHECK_TOLERANCE`.
- The torch and transformers floors in pyproject.toml against the versions `.ci/run` tests, and README's statement.
- Every repository path the docs name exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI_RUN = (ROOT / ".ci" / "run").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), ROOT / "examples" / "downstream" / "README.md"]


# --- CI jobs and times -----------------------------------------------------------------------------------------------

def ci_jobs(text: str = CI_RUN) -> list[str]:
    """`.ci/run`'s jobs in order, from its header lines: echo "== NAME: what it runs"."""
    return re.findall(r'^echo "== ([a-z0-9-]+): ', text, re.M)


def ci_timed(text: str = CI_RUN) -> list[str]:
    return re.findall(r"^timed ([a-z0-9-]+)$", text, re.M)


def readme_ci_table(text: str = README) -> list[tuple[str, str]]:
    """(job, seconds cell) per row of README's CI table."""
    head = text.index("| job | what it runs | seconds |")
    rows = []
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[-1]))
    return rows


def timings_record(text: str) -> dict[str, int]:
    """The record `.ci/run` writes ($KVCOMPILE_ARTIFACTS/ci-timings, committed as .ci/timings): NAME<TAB>SECONDS."""
    record = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, seconds = line.split("\t")
            record[name] = int(seconds)
    return record


def check_ci_times(readme: str, record: dict[str, int]) -> list[str]:
    problems = []
    jobs = dict(readme_ci_table(readme))
    for name in record:
        if name != "total" and name not in jobs:
            problems.append(f".ci/timings has '{name}', which is no job of README's table")
    for name, cell in jobs.items():
        want = str(record[name]) if name in record else "-"
        if cell.replace(",", "") != want:
            problems.append(f"README gives job '{name}' {cell!r} seconds, .ci/timings {want!r}")
    total = re.search(r"^Total: \*\*([0-9,]+) s\*\* \(about (\d+) min", readme, re.M)
    if total is None:
        problems.append("README's CI section has no 'Total: **N s** (about M min' line")
    elif "total" not in record:
        problems.append(".ci/timings has no total")
    else:
        seconds, minutes = int(total.group(1).replace(",", "")), int(total.group(2))
        if seconds != record["total"]:
            problems.append(f"README's CI total is {seconds} s, .ci/timings says {record['total']} s")
        if minutes != round(record["total"] / 60):
            problems.append(f"README says about {minutes} min for {record['total']} s")
    return problems


def test_readme_lists_the_ci_jobs_of_ci_run_in_order():
    jobs = ci_jobs()
    assert len(jobs) >= 8, f".ci/run's job headers are not found as 'echo \"== NAME: ...\"': {jobs}"
    assert [name for name, _ in readme_ci_table()] == jobs
    assert ci_timed() == jobs, "every .ci/run job ends with 'timed NAME', in the order of the headers"


def test_readme_ci_times_are_the_recorded_ones():
    record = timings_record((ROOT / ".ci" / "timings").read_text())
    assert set(record) - {"total"} <= set(ci_jobs()), "the record names jobs .ci/run does not have"
    assert check_ci_times(README, record) == []


def test_the_ci_times_check_fails_on_drift():
    record = timings_record((ROOT / ".ci" / "timings").read_text())
    assert check_ci_times(README, {**record, "tests": record["tests"] + 1})
    assert check_ci_times(README, {**record, "total": record["total"] + 120})
    assert check_ci_times(README, {**record, "lint": 3})  # a newly recorded job the README still shows as "-"


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


def test_every_kv_option_the_docs_name_exists(pytestconfig):
    unknown = set()
    for path in [*DOCS, ROOT / ".ci" / "run"]:
        for flag in set(re.findall(FLAG, path.read_text())):
            try:
                pytestconfig.getoption(flag)
            except ValueError:
                unknown.add(f"{path.relative_to(ROOT)}: {flag}")
    assert not unknown, "the docs name options that do not exist"


def readme_option_rows(text: str = README) -> dict[str, tuple[str, str]]:
    """flag -> (ini cell, default cell) from README's Options table."""
    head = text.index("| option | ini | default | meaning |")
    rows = {}
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        rows[re.match(r"`(" + FLAG + ")", cells[0]).group(1)] = (cells[1], cells[2])
    return rows


def documented_default(option) -> str:
    """How README's table writes an option's default: a value in backticks, 'off' for a flag, 'none' for an empty
    repeatable option, nothing for an empty string."""
    if option.kind == "bool":
        return "off" if option.default is False else "on"
    if option.kind == "linelist":
        return "none" if not option.default else ", ".join(f"`{d}`" for d in option.default)
    return f"`{option.default}`" if option.default != "" else ""


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


def check_option_table(readme: str) -> list[str]:
    table, problems = option_table(), []
    rows = readme_option_rows(readme)
    for flag in sorted(set(table) - set(rows)):
        problems.append(f"{flag} is missing from README's option table")
    autos = float32_autos()
    for flag, (ini, default) in rows.items():
        option = table.get(flag)
        if option is None:
            continue  # not an Option (--kv-list-engines): test_every_kv_option_the_docs_name_exists checks it exists
        if ini != f"`{option.ini}`":
            problems.append(f"{flag}: README's ini key {ini}, the option's {option.ini}")
        want = documented_default(option)
        if flag == "--kv-oracle":  # no entry: every engine against the hf oracle, as the option's help says
            assert "'hf' (default" in option.help
            want = "`hf`"
        if flag == "--kv-cache-dir":  # empty: $KVCOMPILE_CACHE_DIR, else ~/.cache/pytest-kvcompile (the help says so)
            from pytest_kvcompile.config.options import CACHE_DIR_ENV

            want = f"`${CACHE_DIR_ENV}` or `~/.cache/pytest-kvcompile`"
            assert f"${CACHE_DIR_ENV} or ~/.cache/pytest-kvcompile" in option.help
        if default.split(" (")[0] != want:
            problems.append(f"{flag}: README's default {default!r}, the option's {want!r}")
        if flag in autos:
            stated = re.match(r"`auto` \(([0-9.e%-]+) float32;", default)
            if stated is None or number(stated.group(1)) != autos[flag]:
                problems.append(f"{flag}: README's float32 auto value {default!r}, the constant {autos[flag]}")
    return problems


def test_readme_option_table_matches_the_options():
    assert check_option_table(README) == []


def test_the_option_table_check_fails_on_drift():
    assert check_option_table(README.replace("| `kv_fuzz_budget` | `240` |", "| `kv_fuzz_budget` | `120` |"))
    assert check_option_table(README.replace("| `auto` (1e-3 float32;", "| `auto` (1e-2 float32;"))
    assert check_option_table(README.replace("| `kv_latency_repeats` |", "| `kv_repeats` |"))
    assert check_option_table(re.sub(r"^\| `--kv-fresh-engine` .*\n", "", README, flags=re.M))


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

def paragraph(text: str, start: str) -> str:
    at = text.index(start)
    return text[at:text.index("\n\n", at)]


def stated_self_check(text: str) -> dict[str, float]:
    """dtype -> allowance from README's "The oracle checks itself." paragraph."""
    part = paragraph(text, "**The oracle checks itself.**")
    stated = {dtype: float(v) for v, dtype in re.findall(r"([0-9][0-9.e-]*)\s+(float32|bfloat16|float16)\b", part)}
    for value in re.findall(r"([0-9][0-9.e-]*)\s+for the\s+float64 truth", part):
        stated["float64"] = float(value)
    return stated


def test_the_oracle_self_check_allowances_are_the_constants():
    from pytest_kvcompile.oracles.store import ORACLE_CHECK_TOLERANCE

    assert stated_self_check(README) == ORACLE_CHECK_TOLERANCE
    precision = (ROOT / "docs" / "precision.md").read_text()
    assert float(re.search(r"float64 recompute without a cache, ([0-9.e-]+)\)", precision).group(1)) == (
        ORACLE_CHECK_TOLERANCE["float64"])
    drifted = README.replace("1.0 bfloat16", "0.5 bfloat16")
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
    for stated in (f"**torch {torch_ci[0]}**", f"`torch>={torch_floor}`", f"**transformers {transformers_ci[0]}**",
                   f"`transformers>={transformers_floor}`"):
        assert stated in README, f"README's 'Versions tested' does not say {stated}"


# --- packages ---------------------------------------------------------------------------------------------------------

def package_dirs() -> set[str]:
    found = {"pytest_kvcompile.suites", "reference_impls"}  # suites/ is installed as pytest_kvcompile.suites
    for init in (ROOT / "pytest_kvcompile").glob("**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_pyproject_lists_every_package():
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    assert set(re.findall(r'"([\w.]+)"', listed)) == package_dirs()


def test_readme_describes_every_subpackage():
    described = set(re.findall(r"^\| `([a-z_]+)/` \|", README, re.M))
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
