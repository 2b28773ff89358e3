"""The reference static-cache engines (reference_impls/static_cache.py).

Checked against transformers eager greedy decoding (the project's oracle, a plain loop over a full
DynamicCache, fp32) on the zoo's tiny Llama, with the eager compile backend. The CUDA-graph tests need
a GPU and skip elsewhere.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, MistralConfig  # noqa: E402

from conftest import run_suites  # noqa: E402
from kv_test_engines_static import LeakyGraph, NoZero, StaleValid  # noqa: E402
from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec, declaration_of  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.oracles.hf import HFEagerOracle  # noqa: E402
from pytest_kvcompile.oracles.token_match import TokenMismatch, check_tokens  # noqa: E402
from pytest_kvcompile.recompiles.recorder import CompileRecorder  # noqa: E402
from reference_impls.model import UnsupportedModel  # noqa: E402
from reference_impls.static_cache import StaticCache, StaticCacheCudaGraph  # noqa: E402

NEW = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for CUDA graphs")


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed + length)).tolist()


def llama_on(path, device: str = "cpu") -> ModelSpec:
    return ModelSpec("llama", path, AutoConfig.from_pretrained(path), device=device)


@pytest.fixture(scope="module")
def llama(zoo_cache) -> ModelSpec:
    return llama_on(zoo.checkpoint("llama", zoo_cache))


@pytest.fixture(scope="module")
def oracle(llama):
    return HFEagerOracle(llama)


@pytest.fixture(scope="module")
def engine(llama):
    return StaticCache(llama, compile_backend="eager")


def assert_oracle_tokens(oracle, prompts, outputs, engine=None):
    """Each output equals the oracle's greedy continuation up to near ties (verified along the engine's tokens)."""
    for i, (p, got) in enumerate(zip(prompts, outputs)):
        check_tokens(oracle.reference(p, len(got)), got, engine="static cache", model="llama", prompt=f"prompt {i}",
                            where=f"index {i} of lengths {[len(q) for q in prompts]}")


# --------------------------------------------------------------------------- contract


def test_factories_and_declarations():
    for factory in (StaticCache, StaticCacheCudaGraph):
        params = inspect.signature(factory).parameters
        assert list(params)[:4] == ["spec", "compile_backend", "max_cache_len", "max_batch_size"]
        assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(params)[1:])
        assert (params["compile_backend"].default, params["max_cache_len"].default) == ("inductor", 512)
        decl = declaration_of(factory)
        assert (decl.batching, decl.scoring, decl.kv_cache_bytes, decl.compiled) == (True, True, True, True)
    assert declaration_of(StaticCache).devices == ("cpu", "cuda")
    assert declaration_of(StaticCacheCudaGraph).devices == ("cuda",)  # the suite skips it on CPU, naming the device


def test_unsupported_models_and_devices_are_clear_errors(llama, tmp_path):
    config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    with pytest.raises(UnsupportedModel, match="StaticCache supports full-attention layers only .*model 'mistral-sw' "
                                               "has sliding layers"):
        StaticCache(ModelSpec("mistral-sw", tmp_path, config))
    assert issubclass(UnsupportedModel, ModelNotSupported)  # the plugin skips the model with this reason
    with pytest.raises(ValueError, match="needs a CUDA device for CUDA graphs, got device 'cpu'"):
        StaticCacheCudaGraph(llama)


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("lengths", [(1,), (7,), (48,), (7, 1, 48), (48, 1, 7, 23, 5, 2)], ids=str)
def test_tokens_match_eager_transformers(engine, oracle, lengths):
    """Alone and batched; six prompts run as a padded chunk of 4 and one of 2 (+2 dummy rows)."""
    prompts = [prompt(n) for n in lengths]
    outputs = engine.generate(prompts, NEW)
    assert [len(o) for o in outputs] == [NEW] * len(prompts)
    assert_oracle_tokens(oracle, prompts, outputs, engine)


def test_score_is_teacher_forced_through_the_decode_path(engine, oracle):
    p, continuation = prompt(7), prompt(6, seed=1)  # an arbitrary continuation, not the greedy one
    with torch.inference_mode():
        full = oracle.model(input_ids=torch.tensor([p + continuation])).logits[0]
    torch.testing.assert_close(engine.score(p, continuation), full[len(p) - 1 : -1], atol=1e-4, rtol=1e-4)
    assert engine.score(p, []).shape == (0, 256)


def test_edge_counts_and_prompts_that_do_not_fit(engine, oracle):
    assert engine.generate([prompt(3), prompt(1)], 0) == [[], []]
    assert engine.generate([], 3) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], 3)
    with pytest.raises(ValueError, match=r"497 tokens \+ max_new_tokens=16 does not fit max_cache_len=512 .*at most "
                                         r"max_cache_len - max_new_tokens = 496 tokens"):
        engine.generate([prompt(497)], NEW)
    longest = prompt(496)  # fills all 512 slots
    assert_oracle_tokens(oracle, [longest], engine.generate([longest], NEW))


def test_kv_cache_bytes_are_the_preallocated_buffers(engine, llama):
    c = llama.config
    static = 512 * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4 * 4  # 4 rows, fp32
    for lengths in [(5,), (48, 2, 3, 4, 5)]:
        engine.generate([prompt(n) for n in lengths], 3)
        assert engine.kv_cache_bytes() == static


# --------------------------------------------------------------------------- compiles


def test_two_compiles_then_zero_across_lengths_and_batches(llama):
    """Warmup on batch 1, prompt 1 (sizes dynamo would specialise), then nothing compiles."""
    with CompileRecorder() as rec:
        engine = StaticCache(llama, compile_backend="eager")
        engine.generate([[5]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for lengths in [(2,), (200,), (13, 1), (7, 100, 3), (33, 2, 9, 1, 64)]:
                engine.generate([prompt(n) for n in lengths], 8)
            engine.score(prompt(40), prompt(5))
            for caller_mode in (torch.no_grad, torch.enable_grad):
                with caller_mode():
                    engine.generate([[5]], 3)
    assert [e.frame.split(" ")[0] for e in rec.warmup_events] == ["prefill", "decode"]
    assert rec.post_warmup_events == [], "\n".join(e.describe() for e in rec.post_warmup_events)
    assert rec.graph_breaks == []


# --------------------------------------------------------------------------- stale state


def run_after_earlier_calls(engine) -> tuple[list[list[int]], list[list[int]]]:
    """A long call, then every K/V slot poisoned with NaN (anything an earlier call could leave), then a batch
    whose short rows have left-pad slots the long call marked valid: (prompts, outputs) of the batch."""
    engine.generate([prompt(48, seed=3)], NEW)
    for cache in engine.model.caches:
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    prompts = [prompt(7), prompt(1), prompt(48)]
    return prompts, engine.generate(prompts, NEW)


def test_nothing_an_earlier_call_left_is_read(engine, oracle):
    assert_oracle_tokens(oracle, *run_after_earlier_calls(engine))


@pytest.mark.parametrize("broken", [StaleValid, NoZero], ids=lambda c: c.__name__)
def test_each_half_of_the_reset_rule_is_needed(llama, oracle, broken):
    with pytest.raises(TokenMismatch, match=r"prompt 0 \(length 7\), index 0 of lengths \[7, 1, 48\]"):
        assert_oracle_tokens(oracle, *run_after_earlier_calls(broken(llama)))


def test_suites_pass_the_reference_and_catch_a_static_cache_never_reset(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_static:StaticEager",
                        "--kv-engine=kv_test_engines_static:Stale", "--kv-engine=kv_test_engines_static:StaleValid",
                        "-k",
                        "stale_state or StaticEager and (token_identity or batch_consistency or determinism or "
                        "no_recompiles_after_warmup)")
    # Stale fails the sequential check; StaleValid (valid mask OR-ed, never reset) only the batched one.
    result.assert_outcomes(passed=12, failed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_static:Stale' diverges from the oracle on model 'llama', prompt "
        "'long48/v1' (length 48), call 2 of 6 on one engine object, after prompts ?long48 (length 48)?: step 0*",
        "*check that caches and positions are reset per call*",
    ])
    result.stdout.fnmatch_lines([
        "*engine 'kv_test_engines_static:StaleValid' diverges from the oracle on model 'llama', "
        "prompt 'len1' (length 1), "
        "index 0 of a batch of lengths ?1, 48?, after prompts ?long48 (length 48)?: step 0*",
    ])


# --------------------------------------------------------------------------- CUDA graphs (GPU only)


@pytest.fixture(scope="module")
def llama_cuda(llama):
    return llama_on(llama.path, "cuda")


@needs_cuda
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_graph_replay_matches_the_compiled_path_and_the_oracle(llama_cuda, backend):
    graphed = StaticCacheCudaGraph(llama_cuda, compile_backend=backend)
    plain = StaticCache(llama_cuda, compile_backend=backend)
    prompts = [prompt(n) for n in (7, 1, 48, 23, 5)]
    assert graphed.generate(prompts, NEW) == plain.generate(prompts, NEW)
    p, continuation = prompt(7), prompt(9, seed=2)
    torch.testing.assert_close(graphed.score(p, continuation), plain.score(p, continuation), atol=1e-5, rtol=1e-5)
    assert_oracle_tokens(HFEagerOracle(llama_cuda), prompts, graphed.generate(prompts, NEW), graphed)


def allocation_growth(engine) -> tuple[int, bool]:
    """(bytes allocated across later calls, whether the graph's static buffers moved), after one warm call."""
    engine.generate([prompt(7)], NEW)
    torch.cuda.synchronize()
    before, buffers = torch.cuda.memory_allocated(), (engine.static_tokens, engine.static_logits)
    for lengths in [(48,), (1, 7), (23, 5, 2)]:
        engine.generate([prompt(n) for n in lengths], NEW)
    torch.cuda.synchronize()
    moved = any(now is not then for now, then in zip((engine.static_tokens, engine.static_logits), buffers))
    return torch.cuda.memory_allocated() - before, moved


@needs_cuda
def test_replays_reuse_the_graph_buffers(llama_cuda):
    assert allocation_growth(StaticCacheCudaGraph(llama_cuda, compile_backend="eager")) == (0, False)
    growth, moved = allocation_growth(LeakyGraph(llama_cuda))  # the check catches a graph captured per call
    assert growth > 0 and moved
