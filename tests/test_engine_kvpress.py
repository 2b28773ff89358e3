"""The kvpress engines (pytest_kvcompile/engines/kvpress.py) without kvpress installed, and the
prefill-only eviction rules their oracle applies (reference_impls/eviction.py) on cases small
enough to compute by hand. Runs of the presses themselves: tests/test_eviction.py (kvpress venv)."""

import importlib.util
import sys

import pytest
import torch
from transformers import AutoConfig

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec, Strategy, declaration_of
from pytest_kvcompile.engines import kvpress as engines
from pytest_kvcompile.oracles.eviction import (
    TOVA,
    KNormPrefill,
    SnapKVPrefill,
    StreamingLLMPrefill,
    TOVAPrefill,
    keep,
    policy_for,
)
from pytest_kvcompile.oracles.hf import ORACLES

HAS_KVPRESS = importlib.util.find_spec("kvpress") is not None
ENGINES = {"kvpress-streaming": engines.StreamingLLM, "kvpress-snapkv": engines.SnapKV,
           "kvpress-tova": engines.TOVA, "kvpress-knorm": engines.KNorm,
           "kvpress-streaming-rerotated": engines.StreamingLLMRerotated}


def test_the_module_imports_without_kvpress():
    assert HAS_KVPRESS or "kvpress" not in sys.modules


@pytest.mark.parametrize("name", ENGINES)
def test_declarations_name_a_prefill_strategy_with_an_oracle(name):
    decl = declaration_of(ENGINES[name])
    assert decl.requires == (("kvpress", "kvpress==0.5.5"),)
    assert decl.strategy.kind.endswith("_prefill") and decl.strategy.kind in ORACLES
    assert policy_for(decl.strategy).compression_ratio == 0.5  # parameters valid for the oracle's policy
    assert not decl.batching and decl.scoring and not decl.compiled


def test_configure_changes_the_press_and_the_strategy_together():
    engine = engines.SnapKV.configure(window_size=4)
    assert declaration_of(engine).strategy == Strategy.of("snapkv_prefill", compression_ratio=0.5, window_size=4,
                                                          kernel_size=3)
    assert engine.press == "SnapKVPress" and declaration_of(engines.SnapKV).strategy.params[2] == ("window_size", 2)


def test_the_rerotated_engine_wraps_its_press_and_decodes_at_shifted_positions():
    """positions="shifted" is KeyRerotationPress around the press (which never sees `positions`); the oracle's policy
    takes the same strategy, and a strategy at positions="original" names the plain one."""
    from types import SimpleNamespace

    decl = declaration_of(engines.StreamingLLMRerotated)
    assert decl.strategy == Strategy.of("streaming_llm_prefill", compression_ratio=0.5, n_sink=2, positions="shifted")
    assert policy_for(decl.strategy) == StreamingLLMPrefill(0.5, 2, "shifted")
    assert "KeyRerotationPress(StreamingLLMPress(compression_ratio=0.5, n_sink=2))" in decl.description
    assert policy_for(Strategy.of("streaming_llm_prefill", compression_ratio=0.5, n_sink=2, positions="original")
                      ).strategy == declaration_of(engines.StreamingLLM).strategy
    fake = SimpleNamespace(StreamingLLMPress=lambda **kw: ("streaming", kw),
                           KeyRerotationPress=lambda press: ("rerotated", press))
    engine = object.__new__(engines.StreamingLLMRerotated)
    assert engine._make_press(fake) == ("rerotated", ("streaming", {"compression_ratio": 0.5, "n_sink": 2}))
    plain = ("streaming", {"compression_ratio": 0.5, "n_sink": 2})
    assert object.__new__(engines.StreamingLLM)._make_press(fake) == plain


def test_known_findings_follow_the_parameters():
    """kvpress fails on the 1-token prompt where it asserts n > n_sink or n > window_size, and in TOVAPress (the checks
    serving one: token identity on it, stale state and the recompile check's warmup)."""
    checks = ("test_token_identity", "test_stale_state", "test_no_recompiles_after_warmup", "test_full_hit")
    for engine, raised in ((engines.StreamingLLM, "AssertionError"), (engines.StreamingLLMRerotated, "AssertionError"),
                           (engines.SnapKV, "AssertionError"), (engines.TOVA, "RuntimeError")):
        found = declaration_of(engine).known_findings
        assert tuple(f.check for f in found) == checks and found[0].prompts == ("len1",)
        assert {(f.kind.value, f.raised, f.prompt_length, f.batched) for f in found} == {("other", raised, 1, False)}
    assert declaration_of(engines.KNorm).known_findings == ()
    assert declaration_of(engines.StreamingLLM.configure(n_sink=0)).known_findings == ()


def test_sliding_window_models_are_not_supported(tmp_path):
    spec = ModelSpec("mistral-sw", tmp_path, AutoConfig.for_model("mistral", sliding_window=8))
    with pytest.raises(ModelNotSupported, match="kvpress 0.5.5 does not handle sliding-window layers"):
        engines._check_supported(spec)
    engines._check_supported(ModelSpec("llama", tmp_path, AutoConfig.for_model("llama")))


# --------------------------------------------------------------------------- the oracle's rules, by hand


def kept(policy, n, weights=None, keys=None):
    """Positions kept after an n-token prefill (one KV head)."""
    pos = torch.arange(n).view(1, 1, n)
    weights = torch.zeros(1, 1, 1, n, n) if weights is None else weights
    score = policy.score(torch.zeros(1, 1, n), weights, pos, keys=keys)
    return sorted(pos[0, 0, keep(policy, pos, score, torch.tensor(n - 1), policy.n_kept(n))[0, 0]].tolist())


@pytest.mark.parametrize("ratio, n, n_kept", [(0.5, 7, 3), (0.5, 9, 4), (0.0, 5, 5), (0.9, 1, 1), (0.9, 5, 1),
                                              (0.7, 10, 3), (0.3, 10, 7), (0.6, 5, 2)])
def test_n_kept_truncates_like_kvpress(ratio, n, n_kept):
    assert KNormPrefill(ratio).n_kept(n) == n_kept  # max(1, int(n * (1 - ratio)))


def test_streaming_llm_prefill_keeps_sinks_and_the_most_recent():
    assert kept(StreamingLLMPrefill(0.5, 2), 7) == [0, 1, 6]
    assert kept(StreamingLLMPrefill(0.5, 2), 48) == [0, 1, *range(26, 48)]
    assert kept(StreamingLLMPrefill(0.5, 4), 7) == [0, 1, 2]  # n_kept 3 < 4 sinks: the lowest sinks


def test_snapkv_prefill_pools_the_window_attention_and_keeps_the_window():
    """Window = queries 3, 4. Mean over them: p0 .25, p1 .15, p2 .2; pooled (kernel 3, zeros counted):
    p0 (0 + .25 + .15) / 3, p1 (.25 + .15 + .2) / 3 = .2, p2 (.15 + .2 + 0) / 3. n_kept = int(5 * .6) = 3."""
    weights = torch.zeros(1, 1, 1, 5, 5)
    weights[0, 0, 0, 3] = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    weights[0, 0, 0, 4] = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.2])
    policy = SnapKVPrefill(0.4, window_size=2, kernel_size=3)
    torch.testing.assert_close(policy.score(torch.zeros(1, 1, 5), weights, None)[0, 0, :3],
                               torch.tensor([0.4 / 3, 0.2, 0.35 / 3]))
    assert kept(policy, 5, weights) == [1, 3, 4]  # without pooling position 0 (.25) would win
    assert kept(SnapKVPrefill(0.4, window_size=2, kernel_size=1), 5, weights) == [0, 3, 4]


def test_snapkv_averages_query_heads_per_kv_head():
    weights = torch.zeros(1, 2, 2, 4, 4)  # 2 KV heads of 2 query heads; window = query 3
    weights[0, 0, :, 3, :3] = torch.tensor([[0.9, 0.0, 0.1], [0.0, 0.2, 0.8]])  # means .45 .1 .45
    weights[0, 1, :, 3, :3] = torch.tensor([[0.0, 0.6, 0.4], [0.0, 0.6, 0.4]])
    score = SnapKVPrefill(0.5, window_size=1, kernel_size=1).score(torch.zeros(1, 2, 4), weights, None)
    torch.testing.assert_close(score[0, :, :3], torch.tensor([[0.45, 0.1, 0.45], [0.0, 0.6, 0.4]]))


def test_tova_prefill_protects_the_last_token_unlike_tova():
    """Last-row weights of 2 query heads, mean [.2, .4, .3, .1]: n_kept = 2."""
    weights = torch.zeros(1, 1, 2, 4, 4)
    weights[0, 0, :, 3] = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.3, 0.3, 0.3, 0.1]])
    assert kept(TOVAPrefill(0.5), 4, weights) == [1, 3]
    pos = torch.arange(4).view(1, 1, 4)
    tova = TOVA(2)
    tova_kept = keep(tova, pos, tova.score(torch.zeros(1, 1, 4), weights, pos), torch.tensor(3))
    assert sorted(tova_kept[0, 0].tolist()) == [1, 2]


def test_knorm_prefill_keeps_the_lowest_key_norms():
    keys = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]).view(1, 1, 4, 2)  # norms 5, 1, 2, 1.41
    assert kept(KNormPrefill(0.5), 4, keys=keys) == [1, 3]


@pytest.mark.parametrize("strategy, message", [
    (Strategy.of("snapkv_prefill", compression_ratio=0.5, window_size=2, kernel_size=4), "kernel_size=4 must be odd"),
    (Strategy.of("knorm_prefill", compression_ratio=1.0), "compression_ratio=1.0 must be a number in \\[0, 1\\)"),
    (Strategy.of("streaming_llm_prefill", compression_ratio=0.5, n_sink=-1), "n_sink=-1 must be an int >= 0"),
    (Strategy.of("tova_prefill", ratio=0.5), "needs exactly the parameters compression_ratio"),
])
def test_bad_prefill_strategies_say_what_to_write(strategy, message):
    with pytest.raises(ValueError, match=message):
        policy_for(strategy)
