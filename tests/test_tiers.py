"""The two tiers of the project's tests (issue 53), decided by markers, never by file names.

- The fast tier, the README's test command (``python -m pytest -n 2``): every test not marked ``full``.
- The full tier adds the tests marked ``@pytest.mark.full`` (``python -m pytest -n 2 -m full``; CI runs both): the
  other dtypes of the 16-bit twins, the 16-bit eviction tolerance measured, inductor runs, the same verdicts under
  xdist or in another order, the benchmarks' scripts, real venvs.

Every engine of the test modules (tests/kv_test_engines*.py, tests/kv_own_model.py) has a declared role at the end of
its module (MUST_FAIL: a twin carrying a bug; MUST_PASS: a correct engine; MUST_SKIP: a named skip; HELPERS: no
engine), and every one with a role is run by at least one test of the fast tier: a twin that exists is never in no
tier, and a twin moved to the full tier alone fails here. The twin servers' bugs (tests/kv_test_servers.py: BUGS) too.
Found by reading the tests' source (a test's strings and names, those of the module-level names and fixtures it uses,
transitively), so it runs in a second. ``python tests/test_tiers.py`` prints the counts.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ENGINE_MODULES = sorted(p.stem for p in TESTS.glob("kv_test_engines*.py")) + ["kv_own_model"]
ROLES = ("MUST_FAIL", "MUST_PASS", "MUST_SKIP", "HELPERS")


def _is_full_mark(node: ast.AST) -> bool:
    """`pytest.mark.full` (or a list/tuple holding it)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_full_mark(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "full" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "mark"


def _full_param(node: ast.AST) -> bool:
    """`pytest.param(..., marks=pytest.mark.full)`."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param" and any(
        k.arg == "marks" and _is_full_mark(k.value) for k in node.keywords)


def _words(node: ast.AST) -> tuple[set[str], set[str]]:
    """The string constants and the identifiers under `node`, leaving out full-tier parameters."""
    strings, names = set(), set()
    todo = [node]
    while todo:
        item = todo.pop()
        if _full_param(item):
            continue
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            strings.add(item.value)
        elif isinstance(item, ast.Name):
            names.add(item.id)
        elif isinstance(item, ast.Attribute):
            names.add(item.attr)
        elif isinstance(item, ast.arg):
            names.add(item.arg)
        todo.extend(ast.iter_child_nodes(item))
    return strings, names


@dataclass
class SourceFile:
    """One tests/test_*.py: per test function, the strings and names it reaches, and its tier."""

    path: Path
    text: str
    tests: dict[str, tuple[bool, set[str], set[str]]] = field(default_factory=dict)  # name -> (full, strings, names)

    @classmethod
    def read(cls, path: Path) -> SourceFile:
        text = path.read_text()
        tree = ast.parse(text)
        found = cls(path, text)
        module_full = False
        top: dict[str, ast.AST] = {}  # module-level names, helper functions and fixtures
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            top[name.id] = node
                            if name.id == "pytestmark" and _is_full_mark(node.value):
                                module_full = True
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("test_"):
                top[node.name] = node
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            full = module_full or any(_is_full_mark(d) for d in node.decorator_list)
            strings, names = _words(node)
            seen: set[str] = set()
            todo = [n for n in names if n in top]
            while todo:  # the module-level names it uses, transitively
                name = todo.pop()
                if name in seen:
                    continue
                seen.add(name)
                more_strings, more_names = _words(top[name])
                strings |= more_strings
                names |= more_names
                todo += [n for n in more_names if n in top and n not in seen]
            found.tests[node.name] = (full, strings, names)
        return found


def _test_files() -> list[SourceFile]:
    return [SourceFile.read(p) for p in sorted(TESTS.glob("test_*.py"))]


def _roles(module: str) -> dict[str, str]:
    """name -> role, as the module declares it."""
    sys.path.insert(0, str(TESTS))
    try:
        loaded = importlib.import_module(module)
    finally:
        sys.path.remove(str(TESTS))
    return {name: role for role in ROLES for name in getattr(loaded, role, ())}


def _public(module: str) -> set[str]:
    """The public classes and functions a module defines at its top level."""
    tree = ast.parse((TESTS / f"{module}.py").read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and not n.name.startswith("_")}


def _runs(files: list[SourceFile], module: str, name: str, tier: str) -> list[str]:
    """The tests (file::test) of `tier` ("fast", "full" or "any") that run engine `module:name`."""
    qualified = f"{module}:{name}"
    word = re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])")
    found = []
    for file in files:
        mentions_module = module in file.text
        for test, (full, strings, names) in file.tests.items():
            if (tier == "fast" and full) or (tier == "full" and not full):
                continue
            if any(qualified in s for s in strings) or (mentions_module and (
                    name in names or any(word.search(s) for s in strings))):
                found.append(f"{file.path.name}::{test}")
    return found


@dataclass(frozen=True)
class Inventory:
    """Every engine with a role, and the tests of each tier that run it."""

    roles: dict[str, str]  # "module:name" -> role
    fast: dict[str, list[str]]
    full: dict[str, list[str]]

    def count(self, role: str, tier: str = "fast") -> int:
        runs = self.fast if tier == "fast" else {k: self.fast[k] + self.full[k] for k in self.fast}
        return sum(1 for engine, r in self.roles.items() if r == role and runs[engine])


def inventory() -> Inventory:
    files = _test_files()
    roles = {f"{m}:{name}": role for m in ENGINE_MODULES for name, role in _roles(m).items()}
    engines = [e for e, role in roles.items() if role != "HELPERS"]
    return Inventory(roles, {e: _runs(files, *e.split(":"), "fast") for e in engines},
                     {e: _runs(files, *e.split(":"), "full") for e in engines})


def test_every_engine_of_the_test_modules_has_a_role():
    for module in ENGINE_MODULES:
        roles = _roles(module)
        public = _public(module)
        unknown = sorted(public - set(roles))
        assert not unknown, f"tests/{module}.py: no role for {unknown}: add each to one of {ROLES} at its end"
        assert not (set(roles) - public), f"tests/{module}.py: roles name what it does not define: " \
                                          f"{sorted(set(roles) - public)}"


def test_every_engine_with_a_role_runs_in_the_fast_tier():
    found = inventory()
    missing = {e: found.full[e] for e, runs in found.fast.items() if not runs}
    assert not missing, ("engines no test of the fast tier runs (the README's command; `@pytest.mark.full` tests are "
                         "not in it): " + "; ".join(f"{e} ({'full tier only: ' + ', '.join(t) if t else 'no test'})"
                                                    for e, t in missing.items()))


def test_every_twin_servers_bug_runs_in_the_fast_tier():
    sys.path.insert(0, str(TESTS))
    try:
        bugs = importlib.import_module("kv_test_servers").BUGS
    finally:
        sys.path.remove(str(TESTS))
    strings = set()
    for file in _test_files():
        if "kv_test_servers" in file.text:
            for full, found, _ in file.tests.values():
                strings |= set() if full else found
    assert not [b for b in bugs if b not in strings], f"twin server bugs no fast test runs: " \
                                                      f"{[b for b in bugs if b not in strings]}"


def test_the_tier_marker_is_registered_and_deselected_by_default():
    import tomllib

    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("full:") for m in ini["markers"])
    assert "not full" in ini["addopts"]


def test_the_reader_sees_marks_on_functions_params_and_modules(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text(
        "import pytest\n"
        "E = '--kv-engine=kv_test_engines:'\n"
        "def test_a():\n    run(E + 'Greedy')\n"
        "@pytest.mark.full\ndef test_b():\n    run(E + 'Flaky')\n"
        "@pytest.mark.parametrize('d', ['bfloat16', pytest.param('kv_test_engines:StaleCache', "
        "marks=pytest.mark.full)])\ndef test_c(d):\n    pass\n")
    files = [SourceFile.read(path)]
    assert _runs(files, "kv_test_engines", "Greedy", "fast") == ["test_x.py::test_a"]
    assert _runs(files, "kv_test_engines", "Flaky", "fast") == []
    assert _runs(files, "kv_test_engines", "Flaky", "full") == ["test_x.py::test_b"]
    assert _runs(files, "kv_test_engines", "StaleCache", "fast") == []
    path.write_text("import pytest\npytestmark = [pytest.mark.full]\n"
                    "def test_a():\n    run('kv_test_engines:Greedy')\n")
    assert _runs([SourceFile.read(path)], "kv_test_engines", "Greedy", "fast") == []


if __name__ == "__main__":
    counts = inventory()
    for role in ROLES[:3]:
        total = sum(1 for r in counts.roles.values() if r == role)
        print(f"{role}: {total} engines, {counts.count(role)} run in the fast tier, "
              f"{counts.count(role, 'full')} in either tier")
