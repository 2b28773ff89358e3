"""Property tests of the eviction rules (reference_impls/eviction.py) on random score tensors.

No model: each example runs a policy over a random prefill and decode steps whose attention
weights are random (as the engine does it: candidates = kept + new, score, keep the first
`budget` in `order`), and checks every step against a brute-force reading of the rule written
here with plain Python lists.

Profiles: "ci" (default; fixed, derandomized, few examples) and "dev" (HYPOTHESIS_PROFILE=dev).
"""

import os
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_kvcompile.contract.engine import Strategy
from pytest_kvcompile.oracles.eviction import (
    EMPTY,
    H2O,
    TOVA,
    KNormPrefill,
    LastRecent,
    SnapKVPrefill,
    StreamingLLM,
    StreamingLLMPrefill,
    TOVAPrefill,
    _Masks,
    _rotate,
    _shift,
    keep,
    order,
    policy_for,
)

settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

KV_HEADS, GROUP = 2, 2
GAP = 1e-4  # top-k checks skip a step whose reference scores are closer than this at the cut (near ties)

policies = st.one_of(
    st.builds(LastRecent, st.integers(1, 6)),
    st.builds(StreamingLLM, st.integers(0, 3), st.integers(1, 4)),
    st.builds(H2O, st.integers(1, 4), st.integers(1, 4)),
    st.builds(TOVA, st.integers(1, 6)),
)


def step(policy, pos, score, seen, t, gen):
    """One forward of t new tokens (positions seen, ..., seen + t - 1) over the kept entries: random
    causal weights, score, keep. Returns the candidates, their weights [1, kv, group, t, n], the kept
    positions and scores, and the newest position."""
    newest = seen + t - 1
    new = torch.arange(newest - t + 1, newest + 1).expand(1, KV_HEADS, t)
    cand = torch.cat((pos, new), dim=-1)
    q_pos = new[0, 0][:, None]
    visible = (cand[:, :, None, None, :] >= 0) & (cand[:, :, None, None, :] <= q_pos)
    weights = torch.rand(1, KV_HEADS, GROUP, t, cand.size(-1), generator=gen) * visible
    weights = weights / weights.sum(-1, keepdim=True)
    sc = policy.score(F.pad(score, (0, t)), weights, cand)
    kept = keep(policy, cand, sc, torch.tensor(newest))
    return cand, weights, cand.gather(-1, kept), sc.gather(-1, kept), newest


def reference_keep(policy, cand: list[int], score: dict[int, float], newest: int) -> set[int] | None:
    """The rule read literally; None when reference scores nearly tie at the cut."""
    cand = [p for p in cand if p >= 0]
    if len(cand) <= policy.budget:
        return set(cand)
    if isinstance(policy, LastRecent):
        return set(sorted(cand)[-policy.budget:])
    if isinstance(policy, StreamingLLM):
        return {p for p in cand if p < policy.sinks} | set(sorted(cand)[len(cand) - policy.recent:])
    protected = {p for p in cand if p > newest - policy.recent} if isinstance(policy, H2O) else set()
    rest = sorted((p for p in cand if p not in protected), key=lambda p: -score[p])
    slots = policy.budget - len(protected)
    if 0 < slots < len(rest) and score[rest[slots - 1]] - score[rest[slots]] < GAP:
        return None
    return protected | set(rest[:slots])


@PROFILE
@given(policy=policies, prompt=st.integers(1, 12), chunks=st.integers(1, 3), decode=st.integers(0, 8),
       seed=st.integers(0, 2**31 - 1))
def test_every_step_keeps_what_the_rule_says(policy, prompt, chunks, decode, seed):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.empty(1, KV_HEADS, 0, dtype=torch.long)
    score = torch.empty(1, KV_HEADS, 0)
    h2o = [dict() for _ in range(KV_HEADS)]  # brute-force H2O scores: position -> summed weights
    sizes = [len(c) for c in torch.arange(prompt).chunk(chunks)] + [1] * decode
    seen = 0
    for t in sizes:
        cand, weights, pos, score, newest = step(policy, pos, score, seen, t, gen)
        seen += t
        for head in range(KV_HEADS):
            cands = cand[0, head].tolist()
            kept = [p for p in pos[0, head].tolist() if p >= 0]
            # the budget formula, unique and in range
            assert len(kept) == min(seen, policy.budget)
            assert len(set(kept)) == len(kept) and all(0 <= p <= newest for p in kept)
            # protected entries always stay
            if isinstance(policy, StreamingLLM):
                assert set(range(min(policy.sinks, seen))) <= set(kept)
            if isinstance(policy, (StreamingLLM, H2O)):
                assert set(range(max(0, newest - policy.recent + 1), newest + 1)) <= set(kept)
            # scores: H2O = brute-force sum of every weight received; TOVA = last query, mean over all heads
            if isinstance(policy, H2O):
                for j, p in enumerate(cands):
                    if p >= 0:
                        h2o[head][p] = h2o[head].get(p, 0.0) + float(weights[0, head, :, :, j].double().sum())
                ref = h2o[head]
            elif isinstance(policy, TOVA):
                ref = {p: float(weights[0, :, :, -1, j].double().mean()) for j, p in enumerate(cands)}
            else:
                ref = {}
            for p, s in zip(pos[0, head].tolist(), score[0, head].tolist()):
                if ref and p >= 0:
                    assert s == pytest.approx(ref[p], abs=1e-5), f"score of position {p}"
            want = reference_keep(policy, cands, ref, newest)
            if want is not None:
                assert set(kept) == want
            if isinstance(policy, H2O):
                h2o[head] = {p: h2o[head][p] for p in kept}


@PROFILE
@given(n=st.integers(1, 12), data=st.data())
def test_order_is_protected_then_score_then_lowest_position(n, data):
    pos = data.draw(st.permutations(list(range(n))))
    pos = [EMPTY if data.draw(st.booleans()) and i % 3 == 0 else p for i, p in enumerate(pos)]
    score = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # small integers: many ties
    protected = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = order(torch.tensor(pos), torch.tensor(score, dtype=torch.float), torch.tensor(protected)).tolist()
    want = sorted(range(n), key=lambda i: (pos[i] < 0, not protected[i], 0 if protected[i] else -score[i], pos[i]))
    assert [pos[i] for i in got] == [pos[i] for i in want]  # empty slots are interchangeable


@PROFILE
@given(policy=st.one_of(st.builds(LastRecent, st.integers(1, 6)),
                        st.builds(StreamingLLM, st.integers(0, 3), st.integers(1, 4))),
       prompt=st.integers(1, 20), chunks=st.integers(2, 4), seed=st.integers(0, 2**31 - 1))
def test_chunked_prefill_keeps_what_one_shot_keeps_for_position_policies(policy, prompt, chunks, seed):
    """Position-only rules do not depend on attention: any chunking of the prompt ends with the same set."""
    gen = torch.Generator().manual_seed(seed)
    empty = torch.empty(1, KV_HEADS, 0, dtype=torch.long), torch.empty(1, KV_HEADS, 0)
    one_shot = step(policy, *empty, 0, prompt, gen)[2]
    pos, score = empty
    for c in torch.arange(prompt).chunk(chunks):
        _, _, pos, score, _ = step(policy, pos, score, int(c[0]), len(c), gen)
    assert torch.equal(pos.sort(-1).values, one_shot.sort(-1).values)


@PROFILE
@given(heavy=st.integers(1, 4), recent=st.integers(1, 4), prompt=st.integers(2, 8), seed=st.integers(0, 2**31 - 1))
def test_h2o_scores_add_up_over_chunks(heavy, recent, prompt, seed):
    """Within the budget nothing is evicted, so chunking only splits the sum over queries."""
    policy = H2O(heavy + prompt, recent)
    weights = torch.rand(1, KV_HEADS, GROUP, prompt, prompt, generator=torch.Generator().manual_seed(seed)).tril()
    pos = torch.arange(prompt).expand(1, KV_HEADS, prompt)
    one_shot = policy.score(torch.zeros(1, KV_HEADS, prompt), weights, pos)
    split = prompt // 2
    first = policy.score(torch.zeros(1, KV_HEADS, split), weights[..., :split, :split], pos[..., :split])
    both = policy.score(F.pad(first, (0, prompt - split)), weights[..., split:, :], pos)
    torch.testing.assert_close(both, one_shot)


@pytest.mark.parametrize("strategy, policy", [
    (Strategy.of("last_recent", budget=16), LastRecent(16)),
    (Strategy.of("streaming_llm", sinks=4, recent=12), StreamingLLM(4, 12)),
    (Strategy.of("h2o", heavy=8, recent=8), H2O(8, 8)),
    (Strategy.of("tova", budget=16), TOVA(16)),
    (Strategy.of("streaming_llm", sinks=4, recent=12, positions="shifted"), StreamingLLM(4, 12, "shifted")),
])
def test_strategies_name_their_policy(strategy, policy):
    assert policy_for(strategy) == policy and policy.strategy == strategy and policy.budget == 16


def test_a_parameter_at_its_default_may_be_omitted():
    explicit = Strategy.of("streaming_llm", sinks=4, recent=12, positions="original")
    assert policy_for(explicit) == StreamingLLM(4, 12) and StreamingLLM(4, 12).strategy == Strategy.of(
        "streaming_llm", sinks=4, recent=12)


@pytest.mark.parametrize("strategy, message", [
    (Strategy.of("h2o", heavy=8), "needs exactly the parameters heavy, recent"),
    (Strategy.of("streaming_llm", sinks=4, recent=0), "recent=0 must be an int >= 1"),
    (Strategy.of("tova", budget=2.5), "budget=2.5 must be an int"),
    (Strategy.of("streaming_llm", sinks=4, recent=12, positions="rotated"),
     "positions='rotated' must be 'original' or 'shifted'"),
    (Strategy.of("streaming_llm", sinks=4), "needs exactly the parameters sinks, recent (optional: positions)"),
    (Strategy.of("lru", budget=4), "unknown eviction strategy 'lru'; known: last_recent, streaming_llm, h2o, tova, "
     "streaming_llm_prefill, snapkv_prefill, tova_prefill, knorm_prefill"),
])
def test_bad_strategies_say_what_to_write(strategy, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        policy_for(strategy)


# --------------------------------------------------------------------------- prefill-only policies (kvpress)

ratios = st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.9])
prefill_policies = st.one_of(
    st.builds(StreamingLLMPrefill, ratios, st.integers(0, 3)),
    st.builds(SnapKVPrefill, ratios, st.integers(1, 4), st.sampled_from([1, 3, 5])),
    st.builds(TOVAPrefill, ratios),
    st.builds(KNormPrefill, ratios),
)


def prefill_reference_scores(policy, weights, keys, head) -> dict[int, float]:
    """The score of each position for KV head `head`, read literally from the rule with Python numbers.
    weights [1, kv, group, n, n], keys [1, kv, n, d]."""
    n = weights.shape[-1]
    w = weights.double()
    if isinstance(policy, StreamingLLMPrefill):
        return {p: float(p) for p in range(n)}
    if isinstance(policy, TOVAPrefill):
        return {p: float(w[0, :, :, -1, p].mean()) for p in range(n)}
    if isinstance(policy, KNormPrefill):
        return {p: -float(keys[0, head, p].double().norm()) for p in range(n)}
    win, k = policy.window_size, policy.kernel_size
    scored = max(n - win, 0)
    seen = [[float(w[0, head, g, n - win:, p].mean()) for p in range(scored)] for g in range(GROUP)]
    pooled = [[sum(row[j] for j in range(p - k // 2, p + k // 2 + 1) if 0 <= j < scored) / k for p in range(scored)]
              for row in seen]
    return {p: sum(row[p] for row in pooled) / GROUP if p < scored else 0.0 for p in range(n)}


@PROFILE
@given(policy=prefill_policies, n=st.integers(1, 16), decode=st.integers(0, 4), seed=st.integers(0, 2**31 - 1))
def test_prefill_policies_compress_once_to_the_top_of_their_score(policy, n, decode, seed):
    """Through the oracle's own per-layer state (`_Masks`, random q/k/v, no model): after prefill each KV head
    holds n_kept unique in-range positions = the protected ones + the best others by the literal score (near
    ties skipped); decode steps evict nothing."""
    gen = torch.Generator().manual_seed(seed)
    d, heads = 4, KV_HEADS * GROUP
    masks = _Masks(policy)
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (heads, KV_HEADS, KV_HEADS))
    masks.attend(0, q, k, v, 1.0)
    n_kept = max(1, int(n * (1 - policy.compression_ratio)))
    assert policy.n_kept(n) == n_kept
    logits = (q.view(1, KV_HEADS, GROUP, n, d) @ k[:, :, None].transpose(-1, -2)).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf)
    weights = logits.softmax(-1)
    for head in range(KV_HEADS):
        kept = masks.alive[0][0, head].nonzero()[:, 0].tolist()
        assert len(kept) == n_kept and len(set(kept)) == len(kept) and all(0 <= p < n for p in kept)
        protected = {p for p in range(n) if policy.protected(torch.tensor(p), torch.tensor(n - 1))}
        if len(protected) <= n_kept:
            assert protected <= set(kept)
        else:  # more protected than kept (kvpress: topk among ties): the lowest positions
            assert kept == sorted(protected)[:n_kept]
        score = prefill_reference_scores(policy, weights, k, head)
        rest = sorted((p for p in range(n) if p not in protected), key=lambda p: -score[p])
        slots = max(n_kept - len(protected), 0)
        if 0 < slots < len(rest) and score[rest[slots - 1]] - score[rest[slots]] < GAP:
            continue
        if slots:
            assert set(kept) == protected | set(rest[:slots])
    prompt_kept = masks.alive[0].clone()
    for _ in range(decode):
        k = torch.cat((k, torch.randn(1, KV_HEADS, 1, d, generator=gen)), dim=2)
        masks.attend(0, torch.randn(1, heads, 1, d, generator=gen), k, torch.randn_like(k), 1.0)
    assert torch.equal(masks.alive[0][..., :n], prompt_kept) and masks.alive[0][..., n:].all()


# --------------------------------------------------------------------------- the oracle's state (`_Masks`)


def test_a_kv_sharing_layer_attends_over_its_source_candidates_and_keeps_no_cache():
    """Layer 1 reads layer 0's keys: each step it sees layer 0's candidates (kept + new, before this step's
    eviction), and neither scores nor evicts."""
    gen = torch.Generator().manual_seed(0)
    d, heads, n = 4, KV_HEADS * GROUP, 9
    masks = _Masks(H2O(2, 2), sources={1: 0})
    k, v = torch.randn(1, KV_HEADS, n, d, generator=gen), torch.randn(1, KV_HEADS, n, d, generator=gen)
    for t, seen in ((6, 0), (1, 6), (1, 7), (1, 8)):  # prefill of 6, then 3 decode steps
        keys, values = k[:, :, :seen + t], v[:, :, :seen + t]
        masks.attend(0, torch.randn(1, heads, t, d, generator=gen), keys, values, 1.0)
        candidates = masks.seen[0]
        assert candidates.sum(-1).tolist() == [[min(seen, 4) + t] * KV_HEADS] if seen else [[6, 6]]
        q = torch.randn(1, heads, t, d, generator=gen)
        out = masks.attend(1, q, keys, values, 1.0)[0]
        causal = torch.ones(t, seen + t, dtype=torch.bool).tril(seen)
        logits = q.view(1, KV_HEADS, GROUP, t, d) @ keys[:, :, None].transpose(-1, -2)
        logits = logits.masked_fill(~(candidates[:, :, None, None] & causal), -torch.inf)
        want = (logits.softmax(-1) @ values[:, :, None]).reshape(1, heads, t, d).transpose(1, 2)
        torch.testing.assert_close(out, want)
        assert sorted(masks.alive) == [0] and sorted(masks.scores) == [0]


@PROFILE
@given(policy=st.one_of(st.builds(H2O, st.integers(1, 3), st.integers(1, 3)), st.builds(TOVA, st.integers(1, 6))),
       n=st.integers(2, 12), tolerance=st.sampled_from([0.0, 0.1, 0.5]), seed=st.integers(0, 2**31 - 1))
def test_near_ties_are_the_close_unprotected_cuts_and_a_fork_takes_the_other_side(policy, n, tolerance, seed):
    gen = torch.Generator().manual_seed(seed)
    d, heads = 4, KV_HEADS * GROUP
    masks = _Masks(policy, tolerance=tolerance)
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (heads, KV_HEADS, KV_HEADS))
    masks.attend(0, q, k, v, 1.0)
    score, alive = masks.scores[0][0], masks.alive[0][0]
    protected = policy.protected(torch.arange(n), torch.tensor(n - 1))
    for head in range(KV_HEADS) if policy.per_head else (0,):
        kept = [p for p in range(n) if alive[head, p] and not protected[p]]
        dropped = [p for p in range(n) if not alive[head, p]]
        want = set()
        for a in kept:
            for b in dropped:
                s_a, s_b = float(score[head, a]), float(score[head, b])
                if s_a - s_b <= tolerance * max(abs(s_a), abs(s_b)):
                    want.add((0, (head,) if policy.per_head else (0, 1), a, b))
        ties = {t[:4] for t in masks.ties if head in t[1]}
        assert ties == want
        assert all(0 <= t[4] <= 1 for t in masks.ties)
    for tie in masks.ties:
        fork = masks.fork([tie])
        _, tie_heads, a, b, _ = tie
        for head in range(KV_HEADS):
            flipped = fork.alive[0][0, head]
            if head in tie_heads:
                assert not flipped[a] and flipped[b] and flipped.sum() == alive[head].sum()
            else:
                assert torch.equal(flipped, alive[head])
        assert torch.equal(masks.alive[0][0], alive)  # the original is untouched


def test_shifted_positions_put_each_key_at_its_rank_and_each_query_at_its_own():
    """After RoPE at original positions, `_shift` gives the keys and queries RoPE would give at their ranks
    among the candidates (evicted positions 1, 2 and 4 of 0..6 do not count)."""
    gen = torch.Generator().manual_seed(0)
    d, n, t = 8, 7, 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    raw_q = torch.randn(1, KV_HEADS, GROUP, t, d, generator=gen)
    raw_k = torch.randn(1, KV_HEADS, 1, n, d, generator=gen)

    def at(x, positions):  # RoPE at `positions`
        return _rotate(x, torch.tensor(positions, dtype=torch.float)[:, None] * inv_freq)

    alive = torch.tensor([True, False, False, True, False, True, True]).expand(1, KV_HEADS, n)
    q, k = _shift(at(raw_q, [5, 6]), at(raw_k, list(range(n))), alive, inv_freq)
    ranks = [0, 0, 0, 1, 1, 2, 3]  # evicted ones: the rank of the next kept one (masked anyway)
    torch.testing.assert_close(q, at(raw_q, [2, 3]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k[..., alive[0, 0], :], at(raw_k, ranks)[..., alive[0, 0], :], atol=1e-5, rtol=1e-5)
