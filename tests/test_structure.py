"""The plugin's house rules (issue 13): one wiring point, no import circles, nothing heavy at import.

- Importing the entry point (every pytest run where the package is installed) imports neither torch nor
  transformers; a run that uses no kvcompile feature never loads them; ``kvcompile merge`` never does.
- Layers (`LAYERS`, lowest first): every import inside ``pytest_kvcompile`` (module level or in a function;
  not under TYPE_CHECKING) goes to the same or a lower layer, and no import circle exists at all; no module
  imports ``pytest_kvcompile.plugin``.
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
    from pytest_kvcompile.verdicts.results import Results

    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json_file.dumps(Results()))
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


#: The layers of ``pytest_kvcompile``, lowest first: a module may import (at module level or inside a function; not
#: under ``if TYPE_CHECKING:``) only modules of its own layer or a lower one, and no import circle exists at all.
#: A layer is a set of top-level packages/modules; ``__init__`` is the package root (its lazy public names count).
LAYERS: list[tuple[str, ...]] = [
    ("errors",),                                # exception types
    ("config",),                                # option and marker tables, Settings, float32 tolerances
    ("verdicts",),                              # typed failure kinds, result rows, the collector
    ("contract", "recompiles"),                 # the engine contract (KVLayout included); the compile recorder
    ("models",),                                # the zoo, checkpoints, prompts
    ("memory",),                                # held bytes, KV footprints, limit_memory
    ("oracles", "engines", "latency"),          # what is right; the built-in engines; timings
    ("run",),                                   # session, harness, isolation, fixtures, fuzzer
    ("reports",),                               # JSON/Markdown/HTML reports, baselines, the terminal table
    ("check_engine", "cli", "docs", "__init__"),  # the commands, the docs site's tables, the public names
    ("plugin",),                                # the pytest hooks: wires everything, imported by nothing
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """pytest_kvcompile modules `name` imports, at module level or in a function, not under TYPE_CHECKING
    (``from package import module`` counts as the module; the root's lazy public names as imports)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(path):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    if name == "pytest_kvcompile":
        import pytest_kvcompile

        found.update(pytest_kvcompile._PUBLIC.values())
    return {m for m in found if m in modules and m != name}


def _runtime_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module that run (at module level or in a function), not under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped = {id(sub) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for stmt in node.body for sub in ast.walk(stmt)}
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_module_is_in_a_layer():
    assert sorted({_layer(m) for m in _modules()} - set(LAYER_OF)) == []


def test_imports_go_to_the_same_or_a_lower_layer():
    upward = [f"{importer} -> {imported} (layer {_layer(imported)} above layer {_layer(importer)})"
              for importer, deps in sorted(_graph().items()) for imported in sorted(deps)
              if LAYER_OF[_layer(imported)] > LAYER_OF[_layer(importer)]]
    if upward:
        pytest.fail("imports into a higher layer (tests/test_structure.py LAYERS):\n" + "\n".join(upward))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(nxt):], nxt]))
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


#: The plugin's shell: the modules that may import pytest (issue 55). The hooks, the fixtures, the markers' hooks and
#: fixtures, the xdist scheduler and the terminal summary; and errors.py, which gives the core its outcomes as pytest's
#: own exception types (`fail`, `skip`, `UsageError`), so that nothing else of the core imports pytest.
PYTEST_SHELL = {"plugin", "run.fixtures", "run.grouping", "config.markers", "recompiles.marker", "latency.marker",
                "memory.marker", "reports", "errors"}
MAX_LINES = 600  # one job per module: none longer


def test_only_the_plugins_shell_imports_pytest():
    importers = sorted(name.removeprefix("pytest_kvcompile.") for name, path in _modules().items()
                       if any(a.name.split(".")[0] in ("pytest", "_pytest") for node in _runtime_imports(path)
                              for a in node.names if isinstance(node, ast.Import))
                       or any(isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
                              in ("pytest", "_pytest") for node in _runtime_imports(path)))
    assert set(importers) - PYTEST_SHELL == set(), (
        "core modules import pytest (raise through pytest_kvcompile.errors: fail, skip, UsageError; annotate pytest's "
        f"types under TYPE_CHECKING): {sorted(set(importers) - PYTEST_SHELL)}")


def test_no_module_is_longer_than_one_job():
    long = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


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
