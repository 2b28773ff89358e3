"""The reference compiled dynamic-cache engine (reference_impls/compiled_dynamic.py).

Checked against a hand-written transformers eager greedy loop (DynamicCache, fp32 CPU) on
the zoo's tiny Llama. The eager/aot_eager backends keep this fast; one test runs inductor
for the real numerics.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import inspect  # noqa: E402
import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, PhiConfig  # noqa: E402

from conftest import assert_matches_oracle  # noqa: E402
from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec, declaration_of  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.models.checkpoints import with_cache
from pytest_kvcompile.recompiles.recorder import CompileRecorder  # noqa: E402
from reference_impls.compiled_dynamic import CompiledDynamicCache  # noqa: E402
from reference_impls.model import UnsupportedModel  # noqa: E402

LENGTHS = (1, 2, 7, 33)
NEW = 8


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def spec_for(path) -> ModelSpec:
    return ModelSpec("llama", path, AutoConfig.from_pretrained(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> ModelSpec:
    return spec_for(zoo.checkpoint("llama", tmp_path_factory.mktemp("zoo")))


@pytest.fixture(scope="module")
def oracle(llama):
    """oracle(prompt, n) -> (tokens, logits [n, vocab]): eager greedy decoding with a DynamicCache."""
    model = AutoModelForCausalLM.from_pretrained(llama.path, attn_implementation="eager").eval()
    memo = {}

    @torch.no_grad()
    def run(prompt: list[int], n: int):
        key = (tuple(prompt), n)
        if key not in memo:
            cache, ids, tokens, rows = DynamicCache(config=model.config), torch.tensor([prompt]), [], []
            for _ in range(n):
                logits = model(input_ids=ids, **with_cache(cache), use_cache=True).logits[0, -1]
                rows.append(logits)
                tokens.append(int(logits.argmax()))
                ids = torch.tensor([[tokens[-1]]])
            memo[key] = tokens, torch.stack(rows)
        return memo[key]

    run.model = model
    return run


@pytest.fixture(scope="module")
def engine(llama):
    return CompiledDynamicCache(llama, compile_backend="eager")


# --------------------------------------------------------------------------- contract


def test_factory_signature_and_declaration():
    params = inspect.signature(CompiledDynamicCache).parameters
    assert list(params) == ["spec", "compile_backend"]
    assert params["compile_backend"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["compile_backend"].default == "inductor"
    decl = declaration_of(CompiledDynamicCache)
    assert isinstance(decl, Declaration)
    assert (decl.batching, decl.scoring, decl.kv_cache_bytes, decl.compiled) == (True, True, True, True)
    assert decl.strategy.kind == "exact" and decl.description


def test_unsupported_model_type_is_a_clear_error(tmp_path):
    config = PhiConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    with pytest.raises(UnsupportedModel,
                       match="does not support model_type .phi.*supported: llama, mistral, qwen2, gemma3_text"):
        CompiledDynamicCache(ModelSpec("phi", tmp_path, config))
    assert issubclass(UnsupportedModel, ModelNotSupported)  # the plugin skips the model, naming the reason


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_tokens_match_eager_transformers(engine, oracle, batch):
    """Every length of LENGTHS in batches of `batch` prompts; mixed lengths are left-padded."""
    for start in range(0, len(LENGTHS), batch):
        prompts = [prompt(LENGTHS[(start + i) % len(LENGTHS)], seed=10 * batch + start + i) for i in range(batch)]
        got = engine.generate(prompts, NEW)
        assert [len(g) for g in got] == [NEW] * batch
        for p, g in zip(prompts, got):
            assert_matches_oracle(oracle, p, g)


def test_batched_equals_each_prompt_alone(engine):
    prompts = [prompt(n, seed=7 + n) for n in (33, 1, 7, 2)]
    assert engine.generate(prompts, NEW) == [engine.generate([p], NEW)[0] for p in prompts]


def test_exact_token_count_and_edge_counts(engine):
    assert engine.generate([prompt(3, 1)], 1) == [[engine.generate([prompt(3, 1)], 5)[0][0]]]
    assert engine.generate([prompt(3, 1), prompt(1, 2)], 0) == [[], []]
    assert engine.generate([], 3) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], 3)


def test_score_is_teacher_forced(engine, oracle):
    p, cont = prompt(7, 3), prompt(6, 4)  # an arbitrary continuation, not the greedy one
    with torch.no_grad():  # one full forward over prompt + continuation
        full = oracle.model(input_ids=torch.tensor([p + cont])).logits[0]
    scores = engine.score(p, cont)
    assert scores.shape == (len(cont), 256)
    torch.testing.assert_close(scores, full[len(p) - 1 : -1], atol=1e-4, rtol=1e-4)
    greedy, logits = oracle(p, 5)
    torch.testing.assert_close(engine.score(p, greedy), logits, atol=1e-4, rtol=1e-4)
    assert engine.score(p, []).shape == (0, 256)


def test_kv_cache_bytes_grow_with_prompt_and_generated_tokens(engine, llama):
    c = llama.config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4  # K and V, fp32
    for lengths, n in [((5,), 1), ((5,), 9), ((33, 2), 4)]:
        engine.generate([prompt(k, k) for k in lengths], n)
        # the last new token is returned, never fed back: prompt + n - 1 cached positions per row
        assert engine.kv_cache_bytes() == len(lengths) * (max(lengths) + n - 1) * per_token
    engine.score(prompt(50, 0), prompt(3, 0))  # scoring keeps its own cache
    assert engine.kv_cache_bytes() == 2 * (33 + 4 - 1) * per_token


def test_tied_lm_head(tmp_path):
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=True,
        rope_theta=500.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    p = prompt(9, 5)
    with torch.no_grad():
        want = hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 9:].tolist()
    assert CompiledDynamicCache(spec_for(tmp_path), compile_backend="eager").generate([p], 6) == [want]


# --------------------------------------------------------------------------- compiles


def shapes_after_warmup():
    """Batch sizes 1..4 x prompt lengths never seen in warmup, up to 256, plus scoring."""
    for batch, length in itertools.product((4, 1, 3, 2), (256, 1, 17)):
        yield [prompt(max(1, length - 3 * i), seed=length + i) for i in range(batch)]


def test_two_compiles_then_zero(llama):
    """Warmup on batch 1, prompt 1 (the sizes dynamo would specialise), then no compile ever."""
    with CompileRecorder() as rec:
        engine = CompiledDynamicCache(llama, compile_backend="aot_eager")
        engine.generate([[5]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompts in shapes_after_warmup():
                engine.generate(prompts, 3)
            engine.score(prompt(40, 1), prompt(5, 2))
            for caller_mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
                with caller_mode():
                    engine.generate([[5]], 3)
    assert [e.frame.split(" ")[0] for e in rec.warmup_events] == ["prefill", "decode"]
    assert not any(e.is_recompile for e in rec.warmup_events)
    assert rec.post_warmup_events == [], "\n".join(e.describe() for e in rec.post_warmup_events)
    assert rec.graph_breaks == []


def test_engines_do_not_share_compiled_code(llama, tmp_path):
    """Each engine owns its frames: a second model (other shapes, tied head) is a first compile, not a recompile."""
    config = AutoConfig.from_pretrained(llama.path)
    config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings = 32, 1, True
    config.head_dim = 8
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with CompileRecorder() as rec:
        for spec in (llama, spec_for(tmp_path)):
            CompiledDynamicCache(spec, compile_backend="eager").generate([prompt(4, 0), prompt(2, 1)], 2)
    assert len(rec.events) == 4 and not any(e.is_recompile for e in rec.events)


@pytest.mark.full  # inductor (CI's inductor job compiles it too)
def test_inductor_tokens_and_no_recompiles(llama, oracle):
    """The real backend: numerics against the oracle, and still two compiles then zero."""
    with CompileRecorder() as rec:
        engine = CompiledDynamicCache(llama)
        engine.generate([[5]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch in (1, 2, 3, 4):
                prompts = [prompt(LENGTHS[(batch + i) % 4], seed=batch * 10 + i) for i in range(batch)]
                for p, g in zip(prompts, engine.generate(prompts, NEW)):
                    assert_matches_oracle(oracle, p, g)
            engine.generate([prompt(256, 0)], 2)
    assert len(rec.warmup_events) == 2 and rec.post_warmup_events == []
