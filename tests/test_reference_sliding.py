"""The reference engines on sliding-window models: reference_impls/sliding_window.py (ring buffers) and
reference_impls/compiled_dynamic.py (growing cache, windowed mask), on the zoo's `mistral-sw` (every
layer sliding, W = 8) and `gemma3-hybrid` (sliding and global layers).

Checked against a hand-written transformers eager greedy loop (DynamicCache, fp32 CPU). The eager
backend keeps it fast; recompiles are decided by dynamo's guards, not the backend.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, Gemma3TextConfig, LlamaConfig  # noqa: E402

from conftest import assert_matches_oracle, run_suites  # noqa: E402
from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec, declaration_of  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.models.checkpoints import with_cache
from pytest_kvcompile.recompiles.recorder import CompileRecorder  # noqa: E402
from reference_impls.compiled_dynamic import CompiledDynamicCache  # noqa: E402
from reference_impls.model import UnsupportedModel  # noqa: E402
from reference_impls.sliding_window import SlidingWindowCache  # noqa: E402

W = zoo.WINDOW
LENGTHS = (W - 1, W, W + 1, 2 * W + 3)
NEW = 2 * W  # decode crosses the window too
MODELS = ("mistral-sw", "gemma3-hybrid")
ENGINES = (SlidingWindowCache, CompiledDynamicCache)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def spec_for(name: str, path) -> ModelSpec:
    return ModelSpec(name, path, AutoConfig.from_pretrained(path))


@pytest.fixture(scope="module")
def specs(zoo_cache) -> dict[str, ModelSpec]:
    """The zoo checkpoints, in the cache the pytester runs share."""
    return {name: spec_for(name, zoo.checkpoint(name, zoo_cache / "zoo")) for name in MODELS}


class EagerLoop:
    """oracle(prompt, n) -> (tokens, logits [n, vocab]): transformers eager greedy decoding with a DynamicCache."""

    def __init__(self, path):
        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        self.memo = {}

    @torch.no_grad()
    def __call__(self, prompt: list[int], n: int):
        key = (tuple(prompt), n)
        if key not in self.memo:
            cache, ids, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
            for _ in range(n):
                logits = self.model(input_ids=ids, **with_cache(cache), use_cache=True).logits[0, -1]
                rows.append(logits)
                tokens.append(int(logits.argmax()))
                ids = torch.tensor([[tokens[-1]]])
            self.memo[key] = tokens, torch.stack(rows)
        return self.memo[key]


@pytest.fixture(scope="module")
def oracles(specs):
    return {name: EagerLoop(spec.path) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def engines(specs):
    """(engine class, model) -> the engine on the eager backend, built once."""
    built = {}

    def get(cls, model):
        if (cls, model) not in built:
            built[cls, model] = cls(specs[model], compile_backend="eager")
        return built[cls, model]

    return get


# --------------------------------------------------------------------------- contract


def test_factory_signature_and_declaration():
    params = inspect.signature(SlidingWindowCache).parameters
    assert list(params) == ["spec", "compile_backend", "prefill_chunk"]
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in ("compile_backend", "prefill_chunk"))
    assert (params["compile_backend"].default, params["prefill_chunk"].default) == ("inductor", None)
    decl = declaration_of(SlidingWindowCache)
    assert (decl.batching, decl.scoring, decl.kv_cache_bytes, decl.compiled) == (True, True, True, True)
    assert decl.strategy.kind == "exact" and "ring" in decl.description


def test_models_without_sliding_layers_are_not_supported(tmp_path):
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    with pytest.raises(UnsupportedModel, match="model 'llama' .model_type 'llama'. has no sliding-window layers.*"
                                               "CompiledDynamicCache"):
        SlidingWindowCache(ModelSpec("llama", tmp_path, llama))
    gemma_global = Gemma3TextConfig(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    with pytest.raises(ModelNotSupported, match="has no sliding-window layers"):
        SlidingWindowCache(ModelSpec("gemma3-global", tmp_path, gemma_global))
    with pytest.raises(ValueError, match="prefill_chunk must be a positive number"):
        SlidingWindowCache(ModelSpec("llama", tmp_path, llama), prefill_chunk=0)


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_tokens_match_eager_transformers_around_the_window(engines, oracles, cls, model):
    """Prompts W-1, W, W+1, 2W+3 (and 1) alone, then all of them in one left-padded batch."""
    engine, prompts = engines(cls, model), [prompt(n, seed=n) for n in (1, *LENGTHS)]
    for p in prompts:
        assert_matches_oracle(oracles[model], p, engine.generate([p], NEW)[0], f"{cls.__name__} on {model}, alone")
    for p, got in zip(prompts, engine.generate(prompts, NEW)):
        assert_matches_oracle(oracles[model], p, got, f"{cls.__name__} on {model}, in a batch")


@pytest.mark.parametrize("model", MODELS)
def test_chunked_prefill_matches_eager_transformers(engines, oracles, model):
    engine, prompts = engines(SlidingWindowCache, model), [prompt(n, seed=n) for n in (2 * W + 3, 1, W)]
    engine.prefill_chunk = 3  # the same compiled step, fed 3 prompt tokens at a time
    try:
        outputs = engine.generate(prompts, NEW)
    finally:
        engine.prefill_chunk = None
    for p, got in zip(prompts, outputs):
        assert_matches_oracle(oracles[model], p, got, f"chunked prefill on {model}")


@pytest.mark.parametrize("model", MODELS)
def test_score_is_teacher_forced(engines, oracles, model):
    engine, p, cont = engines(SlidingWindowCache, model), prompt(W + 1, 3), prompt(2 * W, 4)  # not the greedy one
    with torch.no_grad():  # one full forward over prompt + continuation
        full = oracles[model].model(input_ids=torch.tensor([p + cont])).logits[0]
    torch.testing.assert_close(engine.score(p, cont), full[len(p) - 1 : -1], atol=1e-4, rtol=1e-4)
    assert engine.score(p, []).shape == (0, 256)


def test_gemma3_softcapping(tmp_path):
    """Gemma3's attention and final-logit softcapping (off in the zoo), tied head. The model code is
    shared (reference_impls/gemma3.py): one engine covers it."""
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    oracle = EagerLoop(tmp_path)
    p = prompt(11, 5)
    got = SlidingWindowCache(spec_for("gemma3-softcap", tmp_path), compile_backend="eager").generate([p], 10)[0]
    assert_matches_oracle(oracle, p, got, "SlidingWindowCache with softcapping")


# --------------------------------------------------------------------------- compiles


def calls_after_warmup():
    """Lengths crossing the window, batches of 1..4, long decodes, in no particular order."""
    for n in (2 * W + 3, 1, W, W - 1, 5 * W):
        yield [prompt(n, seed=n)], 2 * W + 2
    for batch in ((W + 1, 1), (2 * W + 3, W - 1, 1, W)):
        yield [prompt(n, seed=n) for n in batch], W + 2


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_no_recompiles_after_warmup(specs, cls, model):
    """Warmup: batch 1, prompt 1, 2 tokens (the sizes dynamo would specialise); then no compile, ever."""
    with CompileRecorder() as rec:
        engine = cls(specs[model], compile_backend="eager")
        engine.generate([[5]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompts, n in calls_after_warmup():
                engine.generate(prompts, n)
            engine.score(prompt(2 * W, 1), prompt(W + 2, 2))
            if cls is SlidingWindowCache:
                engine.prefill_chunk = 3
                engine.generate([prompt(2 * W + 3, 1), prompt(2, 2)], 2)
    frames = {SlidingWindowCache: ["step"], CompiledDynamicCache: ["prefill", "decode"]}[cls]
    assert [e.frame.split(" ")[0] for e in rec.warmup_events] == frames
    assert rec.post_warmup_events == [], "\n".join(e.describe() for e in rec.post_warmup_events)
    assert rec.graph_breaks == []


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("model", MODELS)
def test_sliding_layers_hold_the_window_whatever_the_length(engines, specs, model):
    """Each sliding layer holds W slots per row (W - 1 past keys + the current one) at any length; full
    layers grow by one position per token (plus the one pad slot, see SlidingWindowCache._empty)."""
    engine, c = engines(SlidingWindowCache, model), specs[model].config
    sliding = len(zoo.sliding_layers(c))
    per_position = 2 * c.num_key_value_heads * c.head_dim * 4  # K and V, fp32
    for lengths, n in [((1,), 1), ((W - 1,), 2), ((W,), 1), ((W + 1,), 1), ((2 * W + 3,), 5), ((48, 3), W)]:
        engine.generate([prompt(k, k) for k in lengths], n)
        rings = [k for (k, v), kind in zip(engine.cache, engine.model.layer_types) if kind == "sliding_attention"]
        assert [tuple(k.shape[:2]) for k in rings] == [(len(lengths), W)] * sliding
        full_positions = 1 + max(lengths) + n - 1  # pad slot + prompt width + new tokens fed back
        want = len(lengths) * per_position * (sliding * W + (c.num_hidden_layers - sliding) * full_positions)
        assert engine.kv_cache_bytes() == want, f"lengths {lengths}, {n} new tokens"


def test_all_sliding_cache_bytes_stop_growing_at_the_window(engines):
    """mistral-sw: the ring engine's bytes are one constant; the growing-cache engine's keep growing."""
    ring, growing = engines(SlidingWindowCache, "mistral-sw"), engines(CompiledDynamicCache, "mistral-sw")
    sizes = {}
    for n in (W - 1, W, W + 1, 2 * W + 3, 6 * W):
        for engine in (ring, growing):
            engine.generate([prompt(n, n)], 1)
            sizes.setdefault(type(engine).__name__, []).append(engine.kv_cache_bytes())
    assert len(set(sizes["SlidingWindowCache"])) == 1
    assert sizes["CompiledDynamicCache"] == sorted(set(sizes["CompiledDynamicCache"]))  # strictly growing
    assert sizes["SlidingWindowCache"][0] < sizes["CompiledDynamicCache"][-1]


# --------------------------------------------------------------------------- the suite catches a broken ring


def test_token_identity_suite_catches_an_off_by_one_window(kvtester):
    # The correct engine passes these (and the whole suite: see the final report's suite run); here only
    # the broken one runs, to keep CI short.
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_sliding:OffByOne", "--kv-zoo=mistral-sw",
                        "-k", "test_token_identity and not batched and (W-1 or 2W)")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_sliding:OffByOne' diverges from the oracle on model 'mistral-sw', "
        "prompt 'W-1=7' (length 7), alone: step 1 of 16",
        "*so this is a real mismatch*",
        "*hint: prefill was right; decode step 1 reads 8 cached positions*"
        "the sequence crossed the sliding window (8 keys) before this step: check window eviction",
    ])
    result.stdout.fnmatch_lines(["*prompt '2W+3=19' (length 19), alone: step 0 of 16",
                                 "*hint: step 0 is decided by prefill alone*"])
