"""The export engines (pytest_kvcompile/engines/export.py): declarations and the accepted-shape rule hold without
executorch; an export of the smallest zoo model generates the oracle's tokens, scores through the same calls, and a
call outside the exported shapes raises OutsideExportedShapes naming the accepted shapes and the call. The
ExecuTorch runtime engine (engines/executorch.py) is checked where executorch is installed (its own venv: its
RECIPE)."""

import re
import warnings

import pytest
import torch

from findings_scope import covers
from pytest_kvcompile.contract.engine import KVLayout, ModelSpec, declaration_of
from pytest_kvcompile.contract.registry import BUILTIN_ENGINES, _accepts_backend
from pytest_kvcompile.engines import executorch as et_adapter
from pytest_kvcompile.engines import export as adapter
from pytest_kvcompile.engines.export import ExportedShapes, OutsideExportedShapes
from pytest_kvcompile.memory.measure import expected_kv_bytes
from pytest_kvcompile.models import zoo
from pytest_kvcompile.oracles.hf import HFEagerOracle


def test_declarations():
    assert BUILTIN_ENGINES["hf-export"] == "pytest_kvcompile.engines.export:HFExport"
    assert BUILTIN_ENGINES["executorch"] == "pytest_kvcompile.engines.executorch:ExecuTorch"
    hf, et = declaration_of(adapter.HFExport), declaration_of(et_adapter.ExecuTorch)
    layout = KVLayout("static", max_cache_len=adapter.MAX_CACHE_LEN, rows=1, windowed=False)
    for decl in (hf, et):
        assert not decl.batching and decl.scoring and not decl.compiled  # no dynamo at run time
        assert decl.kv_layout == layout and decl.devices == ("cpu",)
    assert hf.kv_cache_bytes and not hf.requires
    assert not et.kv_cache_bytes and et.requires == (("executorch", "executorch==1.5.1"),)
    assert not _accepts_backend(adapter.HFExport) and not _accepts_backend(et_adapter.ExecuTorch)


@pytest.mark.parametrize(("test_id", "known"), [
    ("test_token_identity[executorch-gemma4-kvshared-len1]", True),
    ("test_token_identity[executorch-gemma4-kvshared-long250]", True),
    ("test_stale_state[executorch-gemma4-kvshared]", True),
    ("test_token_identity[executorch-gemma4-kvshared-W=8]", False),  # under the score tolerance: must pass
    ("test_token_identity[executorch-gemma3-hybrid-len1]", False),
    ("test_stale_state[executorch-llama]", False),
])
def test_executorch_findings_select_only_their_tests(test_id, known):
    assert covers(declaration_of(et_adapter.ExecuTorch).known_findings, "executorch", test_id) == known, test_id
    assert not declaration_of(adapter.HFExport).known_findings  # hf-export passes every check


SHAPES = ExportedShapes(batch=1, seq_min=1, seq_max=512, max_cache_len=512)


@pytest.mark.parametrize(("prompt_len", "fed", "problem"), [
    (7, 15, None),
    (512, 0, None),  # one new token: the prefill writes 0..511, nothing is fed back
    (500, 12, None),  # writes 0..511
    (500, 13, r"writes cache positions 0\.\.512, past the static cache's 512 positions \(at most 13 new tokens"),
    (513, 0, r"input_ids \[1, 513\] is outside 1 <= s <= 512"),
    (0, 3, r"input_ids \[1, 0\] is outside"),
])
def test_accepted_shapes(prompt_len, fed, problem):
    got = SHAPES.problem(prompt_len, fed)
    assert got is None if problem is None else re.search(problem, got), got


def test_static_seq_dim_rejects_every_other_length():
    """A seq-len dim exported static (torch.export's default) accepts one prompt length and no decode step."""
    static = ExportedShapes(batch=1, seq_min=5, seq_max=5, max_cache_len=64)
    assert "s = 5" in str(static)
    assert "outside 5 <= s <= 5" in static.problem(7, 0)
    assert "decode step's input_ids [1, 1] is outside s = 5" in static.problem(5, 1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    name = "llama"
    return ModelSpec(name, zoo.checkpoint(name, tmp_path_factory.mktemp("zoo")), zoo.ZOO[name].build_config())


@pytest.fixture(scope="module")
def engine(llama):
    """hf-export on the smallest zoo model with a 64-position cache (export ~2 s)."""
    return adapter.HFExport(llama, max_cache_len=64)


def test_shapes_are_read_from_the_program(engine):
    assert engine.shapes == ExportedShapes(batch=1, seq_min=1, seq_max=64, max_cache_len=64)


def test_generate_matches_the_oracle(engine, llama):
    oracle = HFEagerOracle(llama)
    prompts = [[5, 17, 200, 9, 3], [1], list(range(1, 20))]
    got = [engine.generate([p], 8)[0] for p in prompts]
    assert got == [list(oracle.reference(p, 8).tokens) for p in prompts]
    assert engine.generate(prompts, 8) == got  # one prompt at a time, the static cache reset by position
    assert engine.generate(prompts[:1], 0) == [[]]


def test_score_is_teacher_forced_through_the_same_calls(engine, llama):
    prompt, tokens = [5, 17, 200, 9, 3], engine.generate([[5, 17, 200, 9, 3]], 6)[0]
    rows = engine.score(prompt, tokens)
    torch.testing.assert_close(rows, HFEagerOracle(llama).teacher_forced(prompt, tokens), atol=1e-4, rtol=1e-4)
    assert rows.argmax(-1).tolist() == tokens


def test_kv_cache_bytes_match_the_declared_layout_shape(engine, llama):
    """Every layer holds max_cache_len positions (the export replaces sliding layers by full StaticLayers)."""
    engine.generate([[5, 17, 200]], 4)
    layout = KVLayout("static", max_cache_len=64, rows=1, windowed=False)
    assert engine.kv_cache_bytes() == expected_kv_bytes(layout, llama.config, torch.float32, 1, 3, 4).total == 32768


def test_call_outside_the_exported_shapes_is_a_clear_error(engine):
    accepted = r"Accepted: input_ids \[1, s\] and cache_position \[s\] with 1 <= s <= 64, cache positions 0\.\.63"
    with pytest.raises(OutsideExportedShapes, match=r"prompt 0 of 1: 65 tokens.*input_ids \[1, 65\] is outside "
                                                    r"1 <= s <= 64\. " + accepted + r".* never a recompile"):
        engine.generate([[1] * 65], 2)
    with pytest.raises(OutsideExportedShapes, match=r"60 tokens, then 9 one-token calls.*writes cache positions "
                                                    r"0\.\.68, past the static cache's 64 positions"):
        engine.generate([[1] * 60], 10)
    with pytest.raises(OutsideExportedShapes, match=r"score\(<60 tokens>, <10 tokens>\)"):
        engine.score([1] * 60, [2] * 10)
    # the program's own guard, reached without the pre-check, is rewrapped with the accepted shapes
    guard = (r"(AssertionError: Guard failed: input_ids.size\(\)\[1\] <= 64"
             r"|RuntimeError: Expected input at .*<= 64, but got 70)")
    with pytest.raises(OutsideExportedShapes, match=r"raised " + guard + r"\. " + accepted):
        engine._forward([1] * 70, 0, "a raw call")
    assert engine.generate([[5, 17, 200]], 3) == engine.generate([[5, 17, 200]], 3)  # still usable afterwards


def test_executorch_runtime_matches_the_exported_program(llama):
    pytest.importorskip("executorch", reason="the executorch engine needs executorch==1.5.1 (its own venv: "
                        "engines/executorch.py RECIPE)")
    engine = et_adapter.ExecuTorch(llama, max_cache_len=32)
    prompts = [[5, 17, 200, 9, 3], [1]]
    assert [engine.generate([p], 6)[0] for p in prompts] == adapter.HFExport(
        llama, max_cache_len=32).generate(prompts, 6)
    with pytest.raises(OutsideExportedShapes, match=r"input_ids \[1, 40\] is outside 1 <= s <= 32"):
        engine.generate([[1] * 40], 2)


def test_only_transformers_own_side_effect_is_silenced_at_export(llama):
    """The one side effect dynamo reports on every export of a transformers model (its output-capturing context
    variable) is filtered; a list naming any other source still warns."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        adapter.export_program(llama, max_cache_len=16)
    assert not [w for w in seen if "side effects" in str(w.message)], [str(w.message) for w in seen]
    ours = ("While compiling, we found certain side effects happened in the model.forward. Here are the list of "
            "potential sources you can double check: [\"G['__import_transformers_dot_utils_dot_output_capturing']"
            "._active_collector\"]")
    assert re.match(adapter._TRANSFORMERS_SIDE_EFFECT, ours, re.I)
    assert not re.match(adapter._TRANSFORMERS_SIDE_EFFECT, ours[:-1] + ", \"L['self'].cache\"]", re.I)
    kernels = ", \"G['__import_kernels_dot__internals_dot_layer_dot_layer']._ACTIVE_KERNEL_FUNCS\"]"  # 5.25
    assert re.match(adapter._TRANSFORMERS_SIDE_EFFECT, ours[:-1] + kernels, re.I)
    assert not re.match(adapter._TRANSFORMERS_SIDE_EFFECT, ours[:-1] + kernels[:-1] + ", \"L['self'].cache\"]", re.I)


def test_a_model_with_recurrent_states_is_a_named_skip_and_other_attribute_errors_are_not(tmp_path, monkeypatch):
    """transformers' export wrapper gives every layer K/V buffers (AttributeError on a Mamba2 layer): a named
    ModelNotSupported saying which layers hold states, where the model has them; on a model without them the same
    error is the engine's crash."""
    from pytest_kvcompile.contract.engine import ModelNotSupported

    name = "bamba"
    bamba = ModelSpec(name, zoo.checkpoint(name, tmp_path), zoo.ZOO[name].build_config())
    with pytest.raises(ModelNotSupported, match=r"has none for a recurrent state \(AttributeError: .*model 'bamba' "
                                                r"has layers 0, 2: mamba2"):
        adapter.HFExport(bamba)
    from transformers.integrations import executorch

    def broken(*args, **kwargs):
        raise AttributeError("simulated")

    monkeypatch.setattr(executorch, "TorchExportableModuleForDecoderOnlyLM", broken)
    name = "llama"
    llama = ModelSpec(name, zoo.checkpoint(name, tmp_path), zoo.ZOO[name].build_config())
    with pytest.raises(AttributeError, match="simulated"):
        adapter.HFExport(llama)
