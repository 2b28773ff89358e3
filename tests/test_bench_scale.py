"""benchmarks/bench_scale.py (issue 54): its shapes are the real checkpoints' (parameter counts as published), its
parameter count is the built model's, and one run on the zoo's Llama measures what the table shows (wall, the
processes' peak memory, the engine's generate() seconds of the tests' own). Never the speed: it depends on the
machine (docs/performance.md has the measured table)."""

import pytest
import torch
import transformers

from conftest import import_benchmark

bench = import_benchmark("bench_scale")


@pytest.mark.parametrize(("shape", "published"), [("smollm-135m", 134.5e6), ("qwen2.5-0.5b", 494e6),
                                                   ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-3b", 3.09e9),
                                                   ("tinyllama-1.1b", 1.100e9), ("llama-3-8b", 8.030e9)])
def test_the_shapes_are_the_real_checkpoints(shape, published):
    kind, fields = bench.SHAPES[shape]
    config = getattr(transformers, kind)(**{"tie_word_embeddings": True, **fields})
    assert bench.parameters(config) == pytest.approx(published, rel=0.005)


@pytest.mark.parametrize(("kind", "tied"), [("LlamaConfig", True), ("Qwen2Config", True), ("LlamaConfig", False)])
def test_the_parameter_count_is_the_built_models(kind, tied):
    config = getattr(transformers, kind)(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                         tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert bench.parameters(config) == sum(p.numel() for p in model.parameters())  # tied: counted once


def test_an_unknown_shape_is_an_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "llama-70b"])
    assert "unknown shape(s) llama-70b; known: smollm-135m, qwen2.5-0.5b" in capsys.readouterr().err


@pytest.mark.full  # the benchmark end to end: a pytest run of its own
def test_one_run_measures_wall_memory_and_the_engines_share(zoo_cache):
    from pytest_kvcompile.models import zoo

    path = zoo.checkpoint("llama", zoo_cache / "zoo")
    found = bench.run("llama", "float32", path, "hf-eager", "test_token_identity and not batched", [])
    assert found.exit == 0, found.summary
    assert found.parameters > 0 and found.wall_s > 0 and 0.1 < found.peak_gib < 8
    assert 0 < found.engine_s < found.test_s <= found.wall_s, found  # the engine's share is a share of the tests
    assert "passed" in found.summary and "| llama | " in bench.markdown([found])
    assert torch.get_default_dtype() == torch.float32


def test_the_floor_is_transformers_alone_and_converts_the_engines_seconds_to_steps(zoo_cache):
    """`--floor`: transformers' own generate() on the checkpoint, in a process of its own; the table reads the run's
    engine seconds in such decode steps."""
    from pytest_kvcompile.models import zoo

    ms = bench.floor_ms(zoo.checkpoint("llama", zoo_cache / "zoo"), "float32")
    assert 0 < ms < 1000
    row = bench.Measured("llama", "float32", 1, 0, 10.0, 1.0, engine_s=2 * ms / 1000 * 300, test_s=9.0, summary="ok",
                         floor_ms=ms)
    assert f"| {ms:g} ms (600 steps) |" in bench.markdown([row])
