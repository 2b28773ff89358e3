"""The plugin's house rules (issue 13): one wiring point, no import circles, nothing heavy at import.

- Importing the entry point (every pytest run where the package is installed) imports neither torch nor
  transformers; a run that uses no kvcompile feature never loads them; ``kvcompile merge`` never does.
- No module-level import cycle inside ``pytest_kvcompile``; no module imports ``pytest_kvcompile.plugin``.
- Options the pytest-benchmark way: a bad value is a usage error for the command line and the ini alike.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_kvcompile"
HEAVY = ("torch", "transformers")


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1].replace("'", '"')))


def test_the_entry_point_imports_neither_torch_nor_transformers():
    assert _loaded_after("import pytest_kvcompile.plugin, pytest_kvcompile") == set()


def test_kvcompile_merge_never_imports_torch(tmp_path):
    from pytest_kvcompile.reports import json_file

    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json_file.dumps({"runs": [], "rows": []}))
    code = (f"from pytest_kvcompile import cli\nassert cli.main(['merge', {str(tmp_path / 'a.json')!r}, "
            f"{str(tmp_path / 'b.json')!r}, '-o', {str(tmp_path / 'm.md')!r}]) == 0")
    assert _loaded_after(code) == set()
    assert (tmp_path / "m.md").is_file()


def test_a_run_without_kvcompile_features_loads_no_torch(pytester: pytest.Pytester):
    pytester.makeconftest("""
        import sys

        def pytest_unconfigure(config):
            print("HEAVY:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    pytester.makepyfile("def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HEAVY: []"])


def _module_imports(path: Path) -> set[str]:
    """pytest_kvcompile modules imported at module level (not in functions, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("pytest_kvcompile"):
                found.add(sub.module)
                found.update(f"{sub.module}.{a.name}" for a in sub.names)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names if a.name.startswith("pytest_kvcompile"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return {name: {m for m in _module_imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_module_level_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_nothing_imports_the_plugin_back():
    importers = [name for name, deps in _graph().items() if "pytest_kvcompile.plugin" in deps]
    lazily = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
              if p.name != "plugin.py" and "pytest_kvcompile.plugin" in p.read_text()]
    assert importers == [] and lazily == []


@pytest.mark.parametrize(("ini", "message"), [
    ("kv_dtype = float64", "*ini kv_dtype / --kv-dtype='float64': choose one of float32, bfloat16, float16*"),
    ("kv_latency_repeats = 0", "*ini kv_latency_repeats / --kv-latency-repeats='0': give a whole number >= 1*"),
    ("kv_fuzz_budget = -3", "*ini kv_fuzz_budget / --kv-fuzz-budget='-3': give seconds > 0*"),
])
def test_a_bad_ini_value_is_a_usage_error_naming_the_key(pytester: pytest.Pytester, ini, message):
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_a_bad_command_line_value_is_a_usage_error_at_parse_time(pytester: pytest.Pytester):
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--kv-max-near-tie-rate=2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --kv-max-near-tie-rate: --kv-max-near-tie-rate='2': give 'auto' or a "
                                 "fraction of verified tokens in [[]0, 1[]]*"])
