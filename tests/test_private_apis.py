"""Every private torch/transformers name is used in pytest_kvcompile/recompiles/hooks.py only, and listed there.

Rule (issue 27): a name with a leading underscore anywhere in a torch or transformers path (``torch._C``,
``from torch._dynamo.decorators import ...``, ``importlib.import_module("torch.export._trace")``,
``getattr(torch._C, "_x")``, ``CompileConfig._compile_all_devices``) appears in no module of pytest_kvcompile/
or reference_impls/ but the adapter, whose lists (`PRIVATE_APIS`, `CUDA_PRIVATE_APIS`,
`TRANSFORMERS_PRIVATE_APIS`, `IMPORTED_ON_USE`) name every one it uses; `check_private_apis()` resolves them when
a recording starts. Static (ast), so a new offender fails here, with its file:line, before any torch upgrade.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from pytest_kvcompile.recompiles import hooks

REPO = Path(__file__).resolve().parents[1]
ADAPTER = REPO / "pytest_kvcompile" / "recompiles" / "hooks.py"
SCANNED = [path for root in ("pytest_kvcompile", "reference_impls") for path in sorted((REPO / root).rglob("*.py"))]
LIBRARIES = ("torch", "transformers")
LISTED = (*hooks.PRIVATE_APIS, *hooks.CUDA_PRIVATE_APIS, *hooks.TRANSFORMERS_PRIVATE_APIS, *hooks.IMPORTED_ON_USE)
#: Private attributes of other libraries' objects (an object's type is not known statically: its attribute's name is
#: checked against the names this project defines). name -> whose it is.
OTHER_LIBRARIES = {
    "_ctx": "llama_cpp.Llama (engines/llamacpp.py: the logits of the last position)",
    "_hypothesis_internal_add_digest": "hypothesis (run/fuzz.py: one database entry per engine)",
    "_hypothesis_internal_use_seed": "hypothesis (run/fuzz.py: --kv-fuzz-seed)",
    "_getframe": "sys",
}
PRIVATE_ATTRIBUTE = "private attribute"


def _private(path: str) -> bool:
    """A dotted path under torch/transformers with a leading underscore past its root (dunders are public)."""
    root, *rest = path.split(".")
    return root in LIBRARIES and any(p.startswith("_") and not p.endswith("__") for p in rest)


def _defined(tree: ast.AST) -> set[str]:
    """Names a module defines (functions, classes, assignments, attributes of self/cls, arguments, imports)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls") or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def private_uses(source: str, own_names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch/transformers access in `source`; `own_names`: names the project
    defines (a private attribute with any other name, on an object of unknown type, is reported too)."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the torch/transformers path it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in LIBRARIES:  # `import torch.nn.functional as F` binds F; `import torch.nn` binds torch
                    bound[alias.asname or root] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in LIBRARIES:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def path_of(node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in bound:
            return ".".join([bound[node.id], *reversed(parts)])
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant)):
            return ".".join([str(node.args[0].value), *reversed(parts)])
        return None

    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}  # one report per chain
    found = []
    for node in ast.walk(tree):
        paths: list[str] = []
        if isinstance(node, ast.Import):
            paths = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            paths = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            path = path_of(node)
            if path:
                paths = [path] if id(node) not in inner else []
            elif node.attr.startswith("_") and not node.attr.endswith("__") and not _is_self(node.value) and (
                    node.attr not in own_names and node.attr not in OTHER_LIBRARIES):
                found.append((node.lineno, f"{PRIVATE_ATTRIBUTE} .{node.attr} of {ast.unparse(node.value)}: if torch's "
                                           f"or transformers', use it through recompiles/hooks.py; if another "
                                           f"library's, add it to OTHER_LIBRARIES in {Path(__file__).name}"))
        elif isinstance(node, ast.Call) and node.args:
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            first, *rest = node.args
            if name in ("import_module", "__import__", "resolve") and isinstance(first, ast.Constant):
                paths = [str(first.value)]
            elif name in ("getattr", "setattr", "hasattr", "delattr") and rest and isinstance(rest[0], ast.Constant):
                base = path_of(first)
                paths = [f"{base}.{rest[0].value}"] if base else []
        found += [(node.lineno, path) for path in paths if _private(path)]
    return sorted(set(found))


def _own_names() -> set[str]:
    """Names the scanned modules define, the adapter's excepted (its private helpers share torch's names)."""
    return set().union(*(_defined(ast.parse(path.read_text())) for path in SCANNED if path != ADAPTER))


def test_no_private_torch_or_transformers_api_outside_the_adapter():
    own = _own_names()
    offenders = [f"{path.relative_to(REPO)}:{line}: {what}" for path in SCANNED if path != ADAPTER
                 for line, what in private_uses(path.read_text(), own)]
    assert not offenders, (
        "private torch/transformers APIs outside pytest_kvcompile/recompiles/hooks.py: add a function (or name) "
        "there, list the private path in its PRIVATE_APIS (TRANSFORMERS_PRIVATE_APIS, CUDA_PRIVATE_APIS), and "
        "use that:\n" + "\n".join(offenders))


def test_the_adapter_lists_every_private_name_it_uses():
    used = [(line, what) for line, what in private_uses(ADAPTER.read_text(), _own_names())
            if not what.startswith(PRIVATE_ATTRIBUTE)]  # its own objects' private attributes: see the docstring
    unlisted = [f"hooks.py:{line}: {what}" for line, what in used
                if not any(entry == what or entry.startswith(what + ".") for entry in LISTED)]
    assert not unlisted, ("private names recompiles/hooks.py uses but does not list (add them to PRIVATE_APIS, or "
                          "TRANSFORMERS_PRIVATE_APIS / CUDA_PRIVATE_APIS / IMPORTED_ON_USE):\n" + "\n".join(unlisted))


def test_every_listed_name_resolves():
    import transformers  # noqa: F401  (check_private_apis() tries transformers' names once it is imported)

    hooks.check_private_apis()
    for path in (*hooks.PRIVATE_APIS, *hooks.TRANSFORMERS_PRIVATE_APIS):
        hooks.resolve(path)
    for path in hooks.IMPORTED_ON_USE:  # found, not imported (inductor's import costs seconds)
        assert importlib.util.find_spec(path) is not None, path


@pytest.mark.parametrize("listing", ["PRIVATE_APIS", "TRANSFORMERS_PRIVATE_APIS"])
def test_a_moved_name_fails_the_start_up_check_naming_it(monkeypatch, listing):
    import transformers  # noqa: F401

    library = listing.partition("_")[0].lower() if listing != "PRIVATE_APIS" else "torch"
    monkeypatch.setattr(hooks, listing, (*getattr(hooks, listing), f"{library}._gone_in_the_next_release"))
    with pytest.raises(hooks.DynamoHooksBroken, match=rf"{library}\._gone_in_the_next_release is missing \({library} "
                                                      r".*recompiles/hooks\.py must be updated for this " + library):
        hooks.check_private_apis()


OFFENDERS = {  # source -> what the scan reports
    "import torch\ntorch._C._cuda_clearCublasWorkspaces()": "torch._C._cuda_clearCublasWorkspaces",
    "from torch._dynamo.decorators import mark_unbacked": "torch._dynamo.decorators.mark_unbacked",
    "import torch._dynamo.config": "torch._dynamo.config",
    "from torch import _C": "torch._C",
    "import torch as t\nt._check(True)": "torch._check",
    "import importlib\nimportlib.import_module('torch.export._trace')": "torch.export._trace",
    "import torch\ngetattr(torch.cuda, '_lazy_init')()": "torch.cuda._lazy_init",
    "from transformers import CompileConfig\nCompileConfig._compile_all_devices = True":
        "transformers.CompileConfig._compile_all_devices",
    "def f(config):\n    config.compile_config._compile_all_devices = True": "private attribute ._compile_all_devices",
}


@pytest.mark.parametrize("source", OFFENDERS)
def test_the_scan_finds_each_kind_of_private_access(source):
    assert [what for _, what in private_uses(source, set())][0].startswith(OFFENDERS[source])


def test_the_scan_passes_public_names_and_the_projects_own_private_ones():
    source = ("import torch\nimport sys\nfrom torch.nn.attention import SDPBackend\ntorch.compile(f)\n"
              "torch.__version__\nclass A:\n    def _step(self):\n        self._x = 1\n        super()._generate()\n"
              "a._step()\nsys._getframe(1)\n")
    assert private_uses(source, {"_step"}) == []
