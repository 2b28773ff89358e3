"""Routing near ties (oracles/routing.py): the decisions read from any mixture-of-experts block, one taken the other
way, the router noise measured, and the token rule following a near-tied routing alternative -- with its twin just
outside the tolerance."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models import zoo
from pytest_kvcompile.oracles import precision, routing
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.oracles.token_match import TokenMismatch, check_tokens, token_verdict
from pytest_kvcompile.oracles.truth import high_precision, load_lm

MOE = ("qwen3-moe", "deepseek-v3", "gpt-oss")


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _spec(name, root, dtype=torch.bfloat16):
    return ModelSpec(name, zoo.checkpoint(name, root), zoo.ZOO[name].build_config(), dtype=dtype)


def _ids(spec, n=40):
    return torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("name", MOE)
def test_every_router_decision_is_read_and_one_is_taken_the_other_way(zoo_dir, name):
    """Each MoE block's top-k per token: experts (DeepSeek-V3 first picks groups); a swap changes that one decision's
    expert and leaves every earlier decision as it was."""
    spec = _spec(name, zoo_dir)
    truth = load_lm(high_precision(spec), widened=True)
    ids = _ids(spec)
    logits, calls = routing._forward(truth, ids, "cpu")
    found = routing.decisions(calls)
    moe_layers = {d.layer for d in found}
    assert moe_layers and all(isinstance(layer, int) for layer in moe_layers)
    assert len([d for d in found if not d.groups]) == len(moe_layers) * len(ids)
    assert any(d.groups for d in found) == (name == "deepseek-v3")
    swap = min((d for d in found if not d.groups), key=lambda d: (d.layer, -d.row))  # the first block, last row
    swapped, after = routing._forward(truth, ids, "cpu", swap)
    chosen = {(b, c): i for b, c, _, i in after}
    assert swap.dropped in chosen[(swap.block, swap.call)][swap.row].tolist()
    assert swap.kept not in chosen[(swap.block, swap.call)][swap.row].tolist()
    for (block, call, _, before), (_, _, _, now) in zip(calls, after):
        rows = slice(None) if (block, call) != (swap.block, swap.call) else slice(0, swap.row)
        layer = routing.Decision(block, call, 0, 0, 0, 0.0).layer
        if (layer, call) <= (swap.layer, swap.call):  # the calls before the swapped one, and its own earlier rows
            assert torch.equal(before[rows], now[rows]), (block, call)
    assert not torch.equal(logits, swapped)
    assert "instead of expert" in swap.describe() and f"layer {swap.layer}" in swap.describe()


def test_a_dense_model_has_no_routing_decisions(zoo_dir):
    spec = _spec("llama", zoo_dir)
    truth = load_lm(high_precision(spec), widened=True)
    assert routing.blocks(truth) == {}
    assert routing.alternatives(truth, _ids(spec), "cpu", 1.0) == []


@pytest.mark.parametrize("name", MOE)
def test_the_router_noise_is_measured_per_dtype(zoo_dir, name):
    """bfloat16 routers err on their margins by rounding (and route some tokens the other way); float32 ones by
    ~1e-6, far below."""
    seqs = [_ids(_spec(name, zoo_dir), n) for n in (9, 33)]
    noise = {}
    for dtype in (torch.bfloat16, torch.float32):
        spec = _spec(name, zoo_dir, dtype)
        noise[dtype] = routing.calibrate(name, str(dtype), load_lm(high_precision(spec), widened=True),
                                         [load_lm(spec)], seqs, "cpu", precision.NOISE_FACTOR, precision.QUANTILE)
        assert noise[dtype].decisions > 0
    assert 1e-4 < noise[torch.bfloat16].scale < 0.2
    assert noise[torch.float32].scale < 1e-4 < noise[torch.bfloat16].scale
    assert routing.RouterNoise.from_dict(noise[torch.bfloat16].to_dict()) == noise[torch.bfloat16]
    assert "router noise" in noise[torch.bfloat16].describe()


def test_a_token_from_a_near_tied_routing_swap_is_a_near_tie_and_just_outside_the_tolerance_a_mismatch(zoo_dir):
    """The engine is the truth with one routing decision taken the other way, at a step where that changes its
    token: within the router tolerance its token is a near tie naming the swap; with the tolerance just below the
    decision's margin, a mismatch (the rule's twin, in bfloat16)."""
    spec = _spec("qwen3-moe", zoo_dir)
    truth = load_lm(high_precision(spec), widened=True)
    prompt = _ids(spec, 24)
    _, calls = routing._forward(truth, prompt, "cpu")
    base = truth(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1].float()
    flipping = None
    for decision in sorted(routing.decisions(calls), key=lambda d: d.margin):
        row, _ = routing._forward(truth, prompt, "cpu", decision)
        if int(row.argmax()) != int(base.argmax()):
            flipping, alternative = decision, row
            break
    assert flipping is not None, "no single routing swap changes the first token of this prompt"
    token, best = int(alternative.argmax()), int(base.argmax())

    def verdict(tolerance):
        ref = Reference(tuple(prompt), (best,), base[None], "the truth",
                        forced=lambda got, tol: base[None],
                        routes=lambda got, step: routing.alternatives(truth, prompt, "cpu", tolerance))
        return token_verdict(ref, [token], tie_tolerance=1e-6)

    near = verdict(flipping.margin * 1.001)
    assert not near.mismatch and near.near_ties[0].via == flipping.describe()
    assert verdict(flipping.margin * 0.999).mismatch is not None
    ref = Reference(tuple(prompt), (best,), base[None], "the truth", forced=lambda got, tol: base[None],
                    routes=lambda got, step: routing.alternatives(truth, prompt, "cpu", flipping.margin * 0.999))
    with pytest.raises(TokenMismatch, match=rf"nor is {token} the truth's token with one near-tied routing decision "
                                            r"taken the other way, or two in a chain \(\d+ \+ \d+ tried"):
        check_tokens(ref, [token], tie_tolerance=1e-6, engine="moe", model="qwen3-moe", prompt="p24")


def test_a_model_without_an_sdpa_path_is_calibrated_on_its_eager_kernel(zoo_dir):
    """GPT-OSS (sinks) has no SDPA path in transformers: the no-cache and padded computations run its eager kernel
    (named so), where they once made the calibration's oracle "could not run" on it."""
    spec = _spec("gpt-oss", zoo_dir)
    computed = precision.Computations(spec)
    assert computed.sdpa is computed.eager
    assert computed.names == ("eager, cache", "eager, no cache", "eager, left-padded batch", "eager, chunked prefill")
    assert computed.along([3, 1, 4, 1, 5], [9, 2]).shape == (4, 2, spec.vocab_size)
    assert computed.routed
    pinned = computed.along([3, 1, 4, 1, 5], [9, 2], pinned=True)
    assert pinned.shape == (4, 2, spec.vocab_size) and torch.isfinite(pinned).all()


def test_a_token_from_two_chained_near_tied_swaps_is_a_near_tie_and_just_outside_the_tolerance_a_mismatch(zoo_dir):
    """The engine is the truth with a group taken the other way and then, among the experts that puts in the running,
    a decision near-tied only once that is taken (deepseek-v3: seen under inductor in bfloat16, margins 0.037 then
    0.008): within the router tolerance its token is a near tie naming both swaps; with the tolerance just below the
    larger margin, a mismatch that counts the chains tried."""
    spec = _spec("deepseek-v3", zoo_dir)
    truth = load_lm(high_precision(spec), widened=True)
    found = None
    for seed in range(8):  # the first prompt whose last token only a chain of two swaps explains
        prompt = torch.randint(0, spec.vocab_size, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
        base, _ = routing._forward(truth, prompt, "cpu")
        routes = routing.alternatives(truth, prompt, "cpu", 1.0)
        for chain, row in routes:
            token, widest = int(row.argmax()), max(d.margin for d in chain.swaps)
            if len(chain.swaps) < 2 or token == int(base.argmax()):
                continue
            explaining = [r for r, alternative in routing.alternatives(truth, prompt, "cpu", widest * 1.001)
                          if int(alternative.argmax()) == token]
            if explaining and explaining[0] == chain:
                found = prompt, base, chain, row
                break
        if found:
            break
    assert found is not None, "no chain of two routing swaps changes a last token on 8 prompts"
    prompt, base, chain, row = found
    token, best, widest = int(row.argmax()), int(base.argmax()), max(d.margin for d in chain.swaps)

    def reference(tolerance):
        return Reference(tuple(prompt), (best,), base[None], "the truth", forced=lambda got, tol: base[None],
                         routes=lambda got, step: routing.alternatives(truth, prompt, "cpu", tolerance))

    near = token_verdict(reference(widest * 1.001), [token], tie_tolerance=1e-6)
    assert not near.mismatch and near.near_ties[0].via == chain.describe() and ", then " in chain.describe()
    assert token_verdict(reference(widest * 0.999), [token], tie_tolerance=1e-6).mismatch is not None
    with pytest.raises(TokenMismatch, match=r"or two in a chain \(\d+ \+ \d+ tried"):
        check_tokens(reference(widest * 0.999), [token], tie_tolerance=1e-6, engine="moe", model="deepseek-v3",
                     prompt="p24")


def test_an_engine_storing_its_kv_cache_lower_is_judged_with_routing_alternatives_in_float32(zoo_dir, tmp_path):
    """A float32 run has no 16-bit computations, so its store follows no routing alternative; an engine declaring K
    and V stored as float16 is judged through its view of the store (`StoredOracle.for_lowered`), which follows them
    within that computation's measured router noise: llama.cpp's float16 cache tipped a router cut 3e-6 apart on
    qwen3-moe, far below it, and float32's own noise is ~1e-6 (the twin: a dense model has no view, the store
    itself)."""
    from pytest_kvcompile.contract.engine import Lowered, Strategy
    from pytest_kvcompile.oracles.hf import HFEagerOracle
    from pytest_kvcompile.oracles.store import LoweredView, StoredOracle

    spec = _spec("qwen3-moe", zoo_dir, torch.float32)
    stored = StoredOracle(HFEagerOracle(spec), Strategy(), spec, 1e-3, tmp_path)
    prompt = _ids(spec, 40)  # a router cut 2.4e-4 apart at one of its positions
    assert not stored.routed and stored.reference(prompt, 8).routes is None
    view = stored.for_lowered(spec, Lowered("float16"))
    assert isinstance(view, LoweredView) and view.lazy and "K and V stored as float16" in repr(view)
    reference = view.reference(prompt, 8)
    assert reference.routes is not None
    noise = view.noise
    assert noise.lowered == "K and V stored as float16" and noise.decisions > 0
    assert 1e-5 < noise.tolerance < 0.05 and view.routing_tolerance == noise.tolerance
    assert "with K and V stored as float16" in noise.describe()
    tokens = list(reference.tokens)
    found = reference.routes(tokens, 0)
    assert found and all(d.margin <= noise.tolerance for route, _ in found for d in route.swaps)
    expected = routing.alternatives(stored.oracle.model, prompt, "cpu", noise.tolerance)
    assert [route for route, _ in found] == [route for route, _ in expected]
    dense = _spec("llama", zoo_dir, torch.float32)
    dense_store = StoredOracle(HFEagerOracle(dense), Strategy(), dense, 1e-3, tmp_path)
    assert dense_store.for_lowered(dense, Lowered("float16")) is dense_store


def test_a_kv_cache_stored_lower_routes_as_the_truth_when_pinned(zoo_dir):
    """The lowered computation's calibration scale is rounding alone on a mixture-of-experts model (as the 16-bit
    computations'): pinned, every token routes as the truth routes, and its forward through a fresh rounded cache
    (routing.calibrate's) reads the router calls the truth's forward makes."""
    from pytest_kvcompile.oracles.computations import KVComputation

    spec = _spec("qwen3-moe", zoo_dir, torch.float32)
    lowered = KVComputation(spec, "float16")
    assert lowered.routed
    prompt = _ids(spec, 12)
    free, pinned = lowered.along(prompt, [5, 9, 2]), lowered.along(prompt, [5, 9, 2], pinned=True)
    assert free.shape == pinned.shape == (1, 3, spec.vocab_size)
    chosen = routing.truth_routing(lowered.model, prompt + [5, 9], "cpu")
    with routing.Routes(lowered) as seen:
        lowered(input_ids=torch.tensor([prompt + [5, 9]]))
    assert [(b, c) for b, c, _, _ in seen.calls] == list(chosen)


def test_a_score_row_from_a_near_tied_routing_swap_is_explained_and_just_outside_the_tolerance_fails(zoo_dir):
    """score() rows of an engine whose router took a near tie the other way are the truth's with that swap: within the
    router tolerance such a row passes the score check though it is whole logits from the truth's; with the
    tolerance just below the decision's margin, the check fails and says the routing alternatives were tried."""
    from pytest_kvcompile.oracles.token_match import check_score

    spec = _spec("qwen3-moe", zoo_dir)
    truth = load_lm(high_precision(spec), widened=True)
    prompt = _ids(spec, 24)
    base, calls = routing._forward(truth, prompt, "cpu")
    swapped = None
    for decision in sorted(routing.decisions(calls), key=lambda d: d.margin):
        row, _ = routing._forward(truth, prompt, "cpu", decision)
        if float((row - base).abs().max()) > 0.5:
            swapped, alternative = decision, row
            break
    assert swapped is not None, "no single routing swap moves the last row of this prompt by half a logit"
    token = int(alternative.argmax())

    def check(tolerance):
        ref = Reference(tuple(prompt), (int(base.argmax()),), base[None], "the truth",
                        forced=lambda got, tol: base[None],
                        routes=lambda got, step: routing.alternatives(truth, prompt, "cpu", tolerance))
        return check_score(ref, [token], alternative[None] + 0.01, tie_tolerance=1.0, score_tolerance=0.1)

    assert check(swapped.margin * 1.001) == pytest.approx(float((alternative + 0.01 - base).abs().max()), abs=1e-4)
    with pytest.raises(TokenMismatch, match="nor are they within that of the truth with one near-tied routing"):
        check(swapped.margin * 0.999)
