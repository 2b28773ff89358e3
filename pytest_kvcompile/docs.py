"""The documentation site's reference pages, rendered from the code's own tables (never copied by hand).

A page asks for a table with a line of its own, ``<!-- kvcompile: NAME -->``; ``docs/hooks.py`` (the MkDocs hook)
replaces it with ``render(NAME)`` when the site is built, so a page can never name an option, marker, fixture, field
or engine the code does not have with a table that says otherwise. NAME is one of `TABLES`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path

DIRECTIVE = re.compile(r"^<!-- kvcompile: ([a-z-]+) -->$", re.M)
ROOT = Path(__file__).resolve().parents[1]


def _cell(text: object) -> str:
    """One table cell: one line, its pipes escaped except inside code spans (Python-Markdown's tables skip those)."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def _table(header: tuple[str, ...], rows: list[tuple[object, ...]], right: tuple[int, ...] = ()) -> str:
    """A Markdown table; `right`: the columns aligned right (numbers)."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
    lines = ["| " + " | ".join(header) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows])


def all_options() -> list:
    """Every option the plugin adds (plugin.py's OPTIONS: the core's, the fuzzer's, latency's, the reports')."""
    from pytest_kvcompile import reports
    from pytest_kvcompile.config import options
    from pytest_kvcompile.latency import marker as latency_marker
    from pytest_kvcompile.run import fuzz

    return [*options.OPTIONS, *fuzz.OPTIONS, *latency_marker.OPTIONS, *reports.OPTIONS]


def options_table() -> str:
    def default(option) -> str:
        if option.ini_type == "bool":
            return "off"
        value = option.default
        return f"`{value}`" if value not in ("", None, []) else "none"

    return _table(("option", "ini key", "default", "what it does"),
                  [(f"`{o.flag}{'=' + o.metavar if o.metavar else ''}`", f"`{o.ini}`", default(o), o.help)
                   for o in all_options()])


def _pytest_lines(flag: str) -> list[str]:
    """What ``pytest FLAG`` prints with only this plugin's entry point loaded, run from an empty directory."""
    out = subprocess.run([sys.executable, "-m", "pytest", flag, "-p", "no:cacheprovider", "-p", "no:benchmark",
                          "-p", "no:xdist", "-p", "no:hypothesispytest", "--rootdir", "/", "-c", "/dev/null"],
                         capture_output=True, text=True, cwd="/", check=False).stdout
    return out.splitlines()


def markers_table() -> str:
    """The kvcompile markers as ``pytest --markers`` shows them (the ini ``markers`` lines the plugin registers)."""
    rows = []
    for line in _pytest_lines("--markers"):
        found = re.match(r"@pytest\.mark\.((?:no_recompile|limit_memory|latency_budget|kv_requires)\b[^:]*): (.*)",
                         line)
        if found:
            rows.append((f"`@pytest.mark.{found.group(1)}`", found.group(2)))
    return _table(("marker", "what it checks"), rows)


def fixtures_table() -> str:
    """The ``kv_*`` fixtures with their docstrings' first paragraph (``pytest --fixtures``)."""
    from pytest_kvcompile.run import fixtures

    rows = []
    for name, obj in sorted(vars(fixtures).items()):
        if name.startswith("kv_") and callable(obj):  # pytest >= 8.4 wraps a fixture: unwrap reaches the function
            rows.append((f"`{name}`", (inspect.getdoc(inspect.unwrap(obj)) or "").split("\n\n")[0]))
    return _table(("fixture", "what it gives"), rows)


def _field_docs(cls: type) -> dict[str, str]:
    """field -> its description: the ``- `field`: text`` bullets of the class docstring (continuation lines joined)."""
    found: dict[str, str] = {}
    current = None
    for line in (inspect.getdoc(cls) or "").splitlines():
        bullet = re.match(r"- ((?:`\w+`(?:, )?)+):?\s*(.*)", line.strip())
        if bullet:
            current = re.findall(r"`(\w+)`", bullet.group(1))
            for name in current:
                found[name] = bullet.group(2)
        elif current and line.startswith("  ") and line.strip():
            for name in current:
                found[name] += " " + line.strip()
        elif not line.strip():
            current = None
    return found


FIELD_HEADER = ("field", "type", "default", "meaning")


def _field_rows(cls: type) -> dict[str, tuple[object, ...]]:
    """field -> its row: name, type, default and the description its docstring gives."""
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    rows = {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        default = ("required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   else f"`{f.default!r}`" if f.default is not dataclasses.MISSING else "`" + repr(f.default_factory())
                   + "`")
        type_name = _type_name(hints.get(f.name, f.type))
        rows[f.name] = (f"`{f.name}`", f"`{type_name}`", default, docs.get(f.name, ""))
    return rows


def _renamed_note(cls: type) -> str:
    """The deprecated spellings `cls` still accepts (contract/engine.py: renamed_keywords), or ''."""
    renamed = getattr(cls, "RENAMED", {})
    spelled = ", ".join(f"`{old}=` (write `{new}=`)" for old, new in renamed.items())
    return f"\n\nDeprecated spellings, still accepted with a warning: {spelled}." if renamed else ""


def dataclass_table(cls: type) -> str:
    """Fields of a contract dataclass: name, type, default and the description its docstring gives."""
    summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    return (f"### `{cls.__name__}`\n\n{summary}\n\n" + _table(FIELD_HEADER, list(_field_rows(cls).values()))
            + _renamed_note(cls))


def group_problems(cls: type, groups: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    """What keeps `groups` from naming each field of `cls` exactly once: a field in no group, a name no field has, a
    field in two groups."""
    fields = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    named = [name for _, names in groups for name in names]
    return ([f"field '{name}' is in no group" for name in fields if name not in named]
            + [f"group '{title}' names '{name}', not a field" for title, names in groups for name in names
               if name not in fields]
            + [f"field '{name}' is in {named.count(name)} groups" for name in dict.fromkeys(named)
               if named.count(name) > 1])


def grouped_table(cls: type, groups: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """`cls`'s fields as one table per group (Declaration: contract/engine.py's DECLARATION_GROUPS), each under its
    heading and the lead its docstring gives the group (a paragraph ``**Title.** lead``)."""
    problems = group_problems(cls, groups)
    if problems:
        raise ValueError(f"{cls.__name__}'s field groups: {'; '.join(problems)}")
    doc, rows = inspect.getdoc(cls) or "", _field_rows(cls)
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    parts = [f"### `{cls.__name__}`", " ".join(paragraphs[0].split())]
    parts += [p for p in paragraphs[1:] if p and not p.startswith(("- ", "**"))][:1]  # the paragraph after it
    for title, names in groups:
        lead = next((p.removeprefix(f"**{title}.**").strip() for p in paragraphs if p.startswith(f"**{title}.**")),
                    "")
        parts += [f"#### {title}", *([lead] if lead else []), _table(FIELD_HEADER, [rows[n] for n in names])]
    return "\n\n".join(parts) + _renamed_note(cls)


def contract_tables() -> str:
    from pytest_kvcompile.contract import engine

    classes = [getattr(engine, name) for name in ("Declaration", "KVLayout", "Bounds", "PrefixCache", "Strategy")
               if hasattr(engine, name)]
    return "\n\n".join(grouped_table(cls, engine.DECLARATION_GROUPS) if cls is engine.Declaration
                       else dataclass_table(cls) for cls in classes)


def engines_table() -> str:
    """Every built-in engine: its NAME, where it lives, its declaration's summary and description."""
    from pytest_kvcompile.contract.engine import declaration_of
    from pytest_kvcompile.contract.registry import BUILTIN_ENGINES, _import_target

    rows = []
    for name, target in BUILTIN_ENGINES.items():
        declared = declaration_of(_import_target(name, target))
        needs = ", ".join(pip for _, pip in declared.requires) or "-"
        rows.append((f"`{name}`", f"`{target}`", declared.description, needs))
    return _table(("NAME", "factory", "what it is", "needs"), rows)


def zoo_table() -> str:
    from pytest_kvcompile.models import zoo

    return _table(("model", "what it is", "group (--kv-zoo=GROUP)", "in 'all'"),
                  [(f"`{m.name}`", m.description, f"`{m.group}`", "yes" if m.in_all else "named only")
                   for m in zoo.ZOO.values()])


def ci_jobs(run: str | None = None) -> list[tuple[str, str]]:
    """(name, what it runs) of `.ci/run`'s jobs, in order: its ``echo "== NAME: what"`` lines."""
    text = (ROOT / ".ci" / "run").read_text() if run is None else run
    return re.findall(r'^echo "== ([\w-]+): (.*)"$', text, re.M)


def ci_timings(timings: str | None = None) -> dict[str, str]:
    """job -> seconds from `.ci/timings` (the record .ci/run writes; committed after a fresh-clone run)."""
    text = (ROOT / ".ci" / "timings").read_text() if timings is None else timings
    found = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "slowest\t")) and "\t" in line:
            name, seconds = line.split("\t", 1)
            found[name] = seconds.strip()
    return found


def ci_slowest(timings: str | None = None) -> list[tuple[str, str, str]]:
    """(job, seconds, test) of the slowest tests `.ci/timings` recorded per test job (`.ci/slowest`'s lines)."""
    text = (ROOT / ".ci" / "timings").read_text() if timings is None else timings
    return [tuple(line.split("\t")[1:4]) for line in text.splitlines() if line.startswith("slowest\t")]


def ci_table(run: str | None = None, timings: str | None = None) -> str:
    """`.ci/run`'s jobs in order with the seconds `.ci/timings` recorded ("-": not recorded yet), and the total."""
    text = (ROOT / ".ci" / "timings").read_text() if timings is None else timings
    seconds = ci_timings(text)
    rows: list[tuple[object, ...]] = [(f"`{name}`", what, seconds.get(name, "-")) for name, what in ci_jobs(run)]
    total = seconds.get("total", "-")
    minutes = f" (about {round(int(total) / 60)} min)" if total.isdigit() else ""
    rows.append(("**total**", "", f"**{total}**{minutes}"))
    note = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    out = _table(("job", "what it runs", "seconds"), rows, right=(2,)) + f"\n\nThe record: {_cell(note)}"
    slowest = ci_slowest(text)
    if slowest:
        out += ("\n\nThe slowest tests of each test job in that run (seconds of the test itself; the jobs run two "
                "xdist workers, so a job takes about half the sum of its tests):\n\n"
                + _table(("job", "test", "seconds"), [(f"`{job}`", f"`{test}`", seconds)
                                                      for job, seconds, test in slowest], right=(2,)))
    return out


def schema_table() -> str:
    """The results JSON (``--kv-report-json``): its version, the versions read back, and every record's fields with
    their types and merge rules (the dataclasses of verdicts/rows.py, which write and read the file)."""
    from pytest_kvcompile.reports import json_file
    from pytest_kvcompile.verdicts import record as record_module
    from pytest_kvcompile.verdicts import rows as row_module

    reads = ", ".join(str(v) for v in json_file.READS)
    doc = (inspect.getdoc(json_file) or "").replace("::\n", ":\n")
    head = (f"`schema_version` **{json_file.SCHEMA_VERSION}** (files of versions {reads} are read back), "
            f"`kind` `{json_file.KIND}`.")
    parts, todo, seen = [head, doc], [row_module.Row], set()
    while todo:
        kind = todo.pop(0)
        if kind in seen:
            continue
        seen.add(kind)
        hints = typing.get_type_hints(kind)
        fields = [(f"`{f.name}`", f"`{_type_name(hints.get(f.name, f.type))}`",
                   record_module.rule_name(f.metadata["merge"])) for f in dataclasses.fields(kind)]
        todo += [f.metadata["record"] for f in dataclasses.fields(kind) if f.metadata["record"] is not None]
        summary = (inspect.getdoc(kind) or "").split("\n\n")[0].replace("\n", " ")
        parts += [f"**`{kind.__name__}`**: {summary}", _table(("field", "type", "merge"), fields)]
    return "\n\n".join(parts)


def _type_name(kind: object) -> str:
    return re.sub(r"\b(typing|pytest_kvcompile\.[\w.]+)\.", "", inspect.formatannotation(kind))


TABLES: dict[str, Callable[[], str]] = {
    "options": options_table,
    "markers": markers_table,
    "fixtures": fixtures_table,
    "contract": contract_tables,
    "engines": engines_table,
    "zoo": zoo_table,
    "ci": ci_table,
    "schema": schema_table,
}


def render(name: str) -> str:
    if name not in TABLES:
        raise KeyError(f"<!-- kvcompile: {name} -->: no such table; choose from {', '.join(TABLES)}")
    return TABLES[name]()


def expand(markdown: str) -> str:
    """`markdown` with each ``<!-- kvcompile: NAME -->`` line replaced by its table."""
    return DIRECTIVE.sub(lambda m: render(m.group(1)), markdown)
