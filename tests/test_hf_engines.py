"""The built-in transformers engines on a tiny random Llama (compiled ones on the eager backend)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from pytest_kvcompile.contract.engine import ModelSpec, declaration_of
from pytest_kvcompile.engines.hf import HFAssisted, HFDynamicCompile, HFEager, HFStaticCompile
from pytest_kvcompile.recompiles.recorder import reset_dynamo

ENGINES = [HFEager, HFStaticCompile, HFDynamicCompile]
PROMPTS = [[5, 17, 200], [9, 3, 3, 140, 77, 21, 60], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 8


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """A tiny Llama whose checkpoint generation_config would stop at any token and penalise repeats."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(eos_token_id=list(range(256)), repetition_penalty=2.0,
                     no_repeat_ngram_size=1).save_pretrained(path)
    return ModelSpec("tiny-llama", path, config)


@pytest.fixture(scope="module")
def greedy(spec):
    """A hand-written greedy loop: a full forward over the whole sequence per token, no cache."""
    model = AutoModelForCausalLM.from_pretrained(spec.path).eval()

    @torch.inference_mode()
    def run(prompt, steps):
        ids = list(prompt)
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    return run


def build(cls, spec, **kwargs):
    if declaration_of(cls).compiled:
        reset_dynamo()  # a fresh dynamo, so this engine's own compiles are what its check sees
        kwargs.setdefault("compile_backend", "eager")
    return cls(spec, **kwargs)


@pytest.fixture(scope="module", params=ENGINES, ids=lambda cls: cls.__name__)
def engine(request, spec):
    return build(request.param, spec)


def test_declarations():
    for cls in ENGINES:
        decl = declaration_of(cls)
        assert decl.batching and decl.scoring and decl.kv_cache_bytes and decl.description
        assert decl.compiled == (cls is not HFEager)


def test_tokens_equal_greedy_loop(engine, greedy):
    assert [engine.generate([p], NEW)[0] for p in PROMPTS] == [greedy(p, NEW) for p in PROMPTS]


def test_batch_equals_one_by_one(engine):
    assert engine.generate(PROMPTS, NEW) == [engine.generate([p], NEW)[0] for p in PROMPTS]


def test_score_follows_own_tokens(engine):
    prompt = PROMPTS[1]
    tokens = engine.generate([prompt], NEW)[0]
    logits = engine.score(prompt, tokens)
    assert logits.shape == (NEW, 256)
    assert logits.argmax(-1).tolist() == tokens


def test_score_equals_full_forward(engine, spec):
    prompt, continuation = PROMPTS[0], [7, 7, 100, 3]
    model = AutoModelForCausalLM.from_pretrained(spec.path).eval()
    with torch.inference_mode():
        full = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(engine.score(prompt, continuation), full, atol=1e-4, rtol=1e-4)


def test_kv_cache_bytes(engine):
    engine.generate([PROMPTS[2]], NEW)
    per_position = 2 * 2 * 2 * 16 * 4  # layers * (k, v) * kv heads * head_dim * fp32 bytes
    held = 512 * 4 if isinstance(engine, HFStaticCompile) else len(PROMPTS[2]) + NEW - 1  # static: 512 slots x 4 rows
    assert engine.kv_cache_bytes() == held * per_position


def test_static_compile_keeps_one_cache_and_resets_it(spec):
    """One StaticCache (fixed tensors, so CUDA graphs replay instead of re-recording), reset per call: no state
    leaks from a long prompt into a short one, and a batch larger than max_batch_size runs in chunks."""
    engine = HFStaticCompile(spec, compile_backend="eager")
    alone = [engine.generate([p], NEW)[0] for p in PROMPTS]
    cache = engine.cache
    keys = [layer.keys for layer in cache.layers]
    assert engine.generate(PROMPTS[::-1] * 2, NEW) == (alone[::-1] * 2)  # 6 prompts: chunks of 4 and 2
    assert engine.cache is cache and all(layer.keys is k for layer, k in zip(cache.layers, keys))  # same tensors


def test_static_cache_overflow_raises(spec):
    engine = build(HFStaticCompile, spec, max_cache_len=16)
    with pytest.raises(ValueError, match="exceeds max_cache_len=16"):
        engine.generate([list(range(10))], 7)


def test_static_raises_when_transformers_skips_compile(spec, monkeypatch):
    engine = build(HFStaticCompile, spec)
    monkeypatch.setattr(engine.compile_config, "_compile_all_devices", None)
    with pytest.raises(RuntimeError, match="compiled no frame"):
        engine.generate([PROMPTS[0]], 4)


def test_dynamic_raises_when_nothing_compiles(spec, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    engine = build(HFDynamicCompile, spec)
    with pytest.raises(RuntimeError, match="compiled no frame"):
        engine.generate([PROMPTS[0]], 4)


def test_assisted_declaration():
    decl = declaration_of(HFAssisted)
    assert not decl.batching and not decl.scoring and not decl.compiled and decl.kv_released
    assert decl.strategy.kind == "exact"


def test_assisted_equals_greedy_and_rejects_drafts(spec, greedy, monkeypatch):
    """Greedy assisted decoding equals plain greedy, with a draft that is really rejected (crops happen)."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    rounds = []
    update = AssistedCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        rounds.append((int(num_matches), scores.shape[1] - 1))  # (accepted, proposed)
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", record)
    engine = HFAssisted(spec)
    assert engine.generate(PROMPTS[1:], 12) == [greedy(p, 12) for p in PROMPTS[1:]]
    assert any(accepted < proposed for accepted, proposed in rounds), rounds
    # acceptance(), read from the target's forwards, is what transformers' candidate generator was told
    assert [step for row in engine.acceptance() for step in row] == [(p, a) for a, p in rounds]


def test_assisted_rounds_on_a_hybrid_model_are_read_from_an_attention_layer(tmp_path, monkeypatch):
    """On a model whose first layer is recurrent (bamba: Mamba2 at layer 0), acceptance() still says what the candidate
    generator was told: the positions cached are read from the first K/V layer (a linear-attention layer's count is
    not one: read there, acceptance() held tensors and accepted counts of -1). Tokens are not compared here: on such
    models transformers 5.25's own rollback is wrong (docs/findings.md)."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    from pytest_kvcompile.models import zoo

    rounds = []
    update = AssistedCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        rounds.append((int(num_matches), scores.shape[1] - 1))
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", record)
    bamba = ModelSpec("bamba", zoo.checkpoint("bamba", tmp_path), zoo.ZOO["bamba"].build_config())
    engine = HFAssisted(bamba)
    engine.generate([PROMPTS[1]], 12)
    steps = [step for row in engine.acceptance() for step in row]
    assert steps == [(p, a) for a, p in rounds] and all(type(x) is int for step in steps for x in step), steps
