"""The eviction reference engines (reference_impls/eviction_engine.py) and their masking oracle
(reference_impls/eviction.py), on the zoo's tiny Llama with the "eager" compile backend.

- each engine equals its oracle token for token AND holds exactly the positions the oracle
  leaves unmasked, per layer and KV head, for every prompt of a batch (StreamingLLM with original
  and with shifted positions included);
- with a budget no prompt reaches, the eviction oracle is the exact oracle, on every zoo model; with a
  small one it evicts and changes the tokens; it runs in float64; `evicted` counts what it dropped;
- `teacher_forced` feeds the given tokens, and forks at near-tied cuts: an engine breaking them the
  other way passes, one evicting the wrong end still fails;
- the project suites pass on the engines, and fail two engines that declare the right strategy
  but carry a bug (H2O without its recent window, StreamingLLM without sinks);
- kvpress, where installed, keeps the same sets after prefill as the prefill-only oracle modes.
"""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

import kv_test_engines_eviction as engines  # noqa: E402
from conftest import run_suites  # noqa: E402
from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec, Strategy, declaration_of  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.models.checkpoints import with_cache  # noqa: E402
from pytest_kvcompile.models.layers import StateLayer, layer_caches  # noqa: E402
from pytest_kvcompile.oracles.eviction import EvictionOracle  # noqa: E402
from pytest_kvcompile.oracles.hf import HFEagerOracle, oracle_for  # noqa: E402
from pytest_kvcompile.oracles.token_match import check_tokens  # noqa: E402
from reference_impls import eviction_engine  # noqa: E402

NEW = 16
ENGINES = [engines.LastRecent, engines.StreamingLLM, engines.H2O, engines.TOVA, engines.StreamingLLMShifted]


def prompt(length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def zoo_spec(name: str, zoo_dir) -> ModelSpec:
    try:
        path = zoo.checkpoint(name, zoo_dir)
    except zoo.ModelUnavailable as exc:
        pytest.skip(str(exc))
    return ModelSpec(name, path, AutoConfig.from_pretrained(path))


@pytest.fixture(scope="module")
def llama(zoo_dir) -> ModelSpec:
    return zoo_spec("llama", zoo_dir)


@pytest.mark.parametrize("factory", ENGINES, ids=lambda f: f.__name__)
def test_engine_equals_its_oracle_in_tokens_and_kept_positions(llama, factory):
    """A batch of lengths 48, 7, 1, 23 (left-padded): every row evicts during prefill or decode."""
    engine = factory(llama)
    oracle = oracle_for(declaration_of(factory).strategy, llama)
    prompts = [prompt(n) for n in (48, 7, 1, 23)]
    got = engine.generate(prompts, NEW)
    kept = engine.kept_positions()
    for row, p in enumerate(prompts):
        check_tokens(oracle.reference(p, NEW), got[row], engine=factory.__name__, model="llama",
                            prompt=f"prompt of length {len(p)}")
        for layer, want in enumerate(oracle.kept(p, NEW)):
            held = kept[layer][row]
            assert [h[h >= 0].tolist() for h in held] == want.tolist(), f"row {row} (length {len(p)}), layer {layer}"
    budget = engine.policy.budget
    assert all(k.shape[-1] == budget for k in kept)
    assert engine.kv_cache_bytes() == 2 * len(kept) * 4 * 2 * budget * 16 * 4  # 2 layers, b=4, 2 kv heads, d=16, fp32


def test_a_budget_nothing_reaches_is_exact_attention(llama):
    p = prompt(48)
    exact = HFEagerOracle(llama).reference(p, NEW)
    for strategy in (Strategy.of("h2o", heavy=64, recent=64), Strategy.of("tova", budget=64)):
        got = EvictionOracle(llama, strategy).reference(p, NEW)
        assert got.tokens == exact.tokens
        torch.testing.assert_close(got.logits, exact.logits, atol=1e-4, rtol=1e-4)


def test_the_engines_implement_llama_only(tmp_path):
    mistral = ModelSpec("mistral-sw", tmp_path, AutoConfig.for_model("mistral"))
    with pytest.raises(ModelNotSupported, match="implements Llama only, not 'mistral'"):
        eviction_engine.StreamingLLM(mistral, compile_backend="eager")


def eager_greedy(spec: ModelSpec, p: list[int]) -> tuple[tuple[int, ...], torch.Tensor]:
    """transformers' plain eager greedy loop (its own cache, masks and attention): tokens and logits."""
    model = AutoModelForCausalLM.from_pretrained(spec.path, attn_implementation="eager").eval()
    cache, ids, tokens, rows = DynamicCache(config=model.config), torch.tensor([p]), [], []
    with torch.inference_mode():
        for _ in range(NEW):
            rows.append(model(input_ids=ids, **with_cache(cache)).logits[0, -1])
            tokens.append(int(rows[-1].argmax()))
            ids = torch.tensor([tokens[-1:]])
    return tuple(tokens), torch.stack(rows)


@pytest.mark.parametrize("name", zoo.RANDOM)
def test_the_oracle_serves_every_zoo_model(zoo_dir, name):
    """Budget >= every sequence: the masks are no-ops, so the tokens are transformers' plain eager ones exactly
    (sliding windows, scaling, softcapping, KV sharing, absolute positions all the model's own). A small budget
    evicts and changes the tokens. Shifted positions need RoPE (GPT-2 has none)."""
    spec = zoo_spec(name, zoo_dir)
    if any(isinstance(c, StateLayer) for c in layer_caches(spec.config)):  # a hybrid model's state drops nothing
        with pytest.raises(ModelNotSupported, match="evicts attention keys, and model .* has recurrent layers"):
            EvictionOracle(spec, Strategy.of("tova", budget=64))
        return
    prompts = [prompt(n) for n in (7, 48)]
    exact = {tuple(p): eager_greedy(spec, p) for p in prompts}
    rope = "gpt2" not in spec.config.model_type
    big = [Strategy.of("h2o", heavy=64, recent=64), Strategy.of("tova", budget=64)]
    big += [Strategy.of("streaming_llm", sinks=4, recent=60, positions="shifted")] if rope else []
    for strategy in big:
        oracle = EvictionOracle(spec, strategy)
        for p in prompts:
            got, (tokens, logits) = oracle.reference(p, NEW), exact[tuple(p)]
            assert got.tokens == tokens, (strategy, len(p))
            torch.testing.assert_close(got.logits, logits, atol=1e-4, rtol=1e-4)
            assert oracle.evicted(p, NEW) == 0
    small = [Strategy.of("h2o", heavy=2, recent=2), Strategy.of("tova", budget=4),
             Strategy.of("streaming_llm", sinks=1, recent=3), Strategy.of("snapkv_prefill", compression_ratio=0.75,
                                                                          window_size=2, kernel_size=3)]
    small += [Strategy.of("streaming_llm", sinks=1, recent=3, positions="shifted")] if rope else []
    for strategy in small:
        oracle = EvictionOracle(spec, strategy)
        assert any(oracle.reference(p, NEW).tokens != exact[tuple(p)][0] for p in prompts), strategy
        assert all(oracle.evicted(p, NEW) > 0 for p in prompts), strategy
    if not rope:
        with pytest.raises(ModelNotSupported, match="re-rotates keys: GPT2 has no rotary embedding"):
            EvictionOracle(spec, Strategy.of("streaming_llm", sinks=1, recent=3, positions="shifted"))


def test_kv_sharing_layers_hold_no_cache(zoo_dir):
    """Gemma4's last 2 of 4 layers read layers 0 and 1: only those keep, score and evict."""
    spec = zoo_spec("gemma4-kvshared", zoo_dir)
    oracle = EvictionOracle(spec, Strategy.of("h2o", heavy=4, recent=4))
    assert oracle.sources == {2: 0, 3: 1}
    p = prompt(23)
    assert [k.shape for k in oracle.kept(p, NEW)] == [(2, 8), (2, 8)]
    assert oracle.evicted(p, NEW) == 2 * 2 * (23 + NEW - 1 - 8)  # 2 layers with a cache, 2 KV heads


def test_evicted_counts_what_the_greedy_run_dropped(llama):
    """Over layers and KV heads (2 and 2): entries seen = prompt + NEW - 1 (the last token is never fed)."""
    h2o = EvictionOracle(llama, Strategy.of("h2o", heavy=8, recent=8))
    assert h2o.evicted(prompt(7), NEW) == 2 * 2 * (7 + NEW - 1 - 16)
    assert h2o.evicted(prompt(1), NEW) == 0  # 16 entries: the budget
    snapkv = EvictionOracle(llama, Strategy.of("snapkv_prefill", compression_ratio=0.5, window_size=4, kernel_size=3))
    assert snapkv.evicted(prompt(48), NEW) == 2 * 2 * 24  # the one compression only


# gemma4-kvshared: one prompt past the budget (two took 47 s of the fast tier)
@pytest.mark.parametrize("name, lengths", [("llama", (23, 48)), ("gemma4-kvshared", (48,))],
                         ids=["llama", "gemma4-kvshared"])
def test_the_oracle_runs_in_float64(zoo_dir, name, lengths):
    spec = zoo_spec(name, zoo_dir)
    for strategy in (Strategy.of("h2o", heavy=8, recent=8), Strategy.of("tova", budget=16)):
        f32 = EvictionOracle(spec, strategy)
        f64 = EvictionOracle(dataclasses.replace(spec, dtype=torch.float64), strategy)
        assert f64.model.dtype == torch.float64
        for p in map(prompt, lengths):
            a, b = f32.reference(p, NEW), f64.reference(p, NEW)
            assert a.tokens == b.tokens and b.logits.dtype == torch.float32
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
            assert all(torch.equal(x, y) for x, y in zip(f32.kept(p, NEW), f64.kept(p, NEW)))
            assert torch.equal(f64.teacher_forced(p, a.tokens, 1e-3), b.logits)


def test_shifted_positions_differ_from_original_ones_on_a_long_prompt(llama):
    """The same sets are kept (position rules), but re-numbered keys change the attention."""
    p = prompt(48)
    original = EvictionOracle(llama, Strategy.of("streaming_llm", sinks=4, recent=12))
    shifted = EvictionOracle(llama, Strategy.of("streaming_llm", sinks=4, recent=12, positions="shifted"))
    assert shifted.source.endswith("streaming_llm(positions=shifted, recent=12, sinks=4)")
    assert original.reference(p, NEW).tokens != shifted.reference(p, NEW).tokens
    assert all(torch.equal(a, b) for a, b in zip(original.kept(p, NEW), shifted.kept(p, NEW)))


def test_teacher_forced_feeds_the_given_tokens(llama):
    """On the greedy path it is the greedy run; off it, with nothing evicted, the plain model on prompt + tokens."""
    p, tokens = prompt(48), prompt(NEW)
    for strategy in (Strategy.of("h2o", heavy=8, recent=8), Strategy.of("tova", budget=16)):
        oracle = EvictionOracle(llama, strategy)
        ref = oracle.reference(p, NEW)
        assert torch.equal(oracle.teacher_forced(p, ref.tokens, 1e-3), ref.logits)
        assert oracle.teacher_forced(p, (), 1e-3).shape == (0, 256)
    model = AutoModelForCausalLM.from_pretrained(llama.path, attn_implementation="eager").eval()
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([p + tokens[:-1]])).logits[0, len(p) - 1:]
    got = EvictionOracle(llama, Strategy.of("tova", budget=64)).teacher_forced(p, tokens, 1e-3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def verified(oracle: EvictionOracle, p: list[int], got: list[int], tie: float = 1e-3) -> bool:
    """Every engine token within `tie` of the oracle's best given the engine's own prefix (the plugin's rule)."""
    rows = oracle.teacher_forced(p, got, tie)
    return bool((rows.max(-1).values - rows[torch.arange(len(got)), got] <= tie).all())


def test_near_tied_evictions_broken_the_other_way_pass_and_a_wrong_policy_fails(llama):
    """TOVANudged moves scores by NUDGE / 2 of themselves: on this prompt it evicts the other side of a cut
    nearer than NUDGE and then generates other tokens, a mismatch for one oracle path (no forks), accepted by
    the forked verification with a tolerance of NUDGE. TOVA evicting the most attended token fails either way."""
    p = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(2048)).tolist()
    strategy = declaration_of(engines.TOVA).strategy
    forked, single = EvictionOracle(llama, strategy), EvictionOracle(llama, strategy)
    forked.eviction_tie_tolerance, single.eviction_tie_tolerance = engines.NUDGE, None
    nudged = engines.TOVANudged(llama).generate([p], NEW)[0]
    assert list(single.reference(p, NEW).tokens) != nudged and not verified(single, p, nudged)
    assert verified(forked, p, nudged)
    run = forked.teacher_forced_run(p, nudged, 1e-3)
    assert 2 <= run.states <= 8 and run.pruned_at is None
    wrong = engines.TOVAEvictsTheMostAttended(llama)
    for q in (p, prompt(23), prompt(48)):
        got = wrong.generate([q], NEW)[0]
        assert not verified(forked, q, got)
        assert forked.teacher_forced_run(q, got, 1e-3).pruned_at is not None


# the suites again on two correct eviction engines: CI's inductor and bfloat16 jobs run ref-h2o, ref-tova and
# ref-streaming-llm-shifted through them; the fast tier holds each to its oracle
@pytest.mark.full
def test_the_suites_pass_on_the_engines(kvtester):
    """Token identity (alone and batched), zero recompiles, stale state, determinism, both engines in one run. (All
    engines: the same run with --kv-engine=kv_test_engines_eviction:{LastRecent,StreamingLLM,TOVA} too.)"""
    names = ("H2O", "StreamingLLMShifted")
    result = run_suites(kvtester, *(f"--kv-engine=kv_test_engines_eviction:{name}" for name in names),
                        "-k", "token_identity or recompiles or stale_state or determinism")
    assert result.ret == 0 and result.parseoutcomes()["passed"] >= 18  # the suites' test count changes with them
    for name in names:
        result.stdout.fnmatch_lines([f"PASS  kv_test_engines_eviction:{name}: *"])
        result.stdout.fnmatch_lines([f"kv_test_engines_eviction:{name} / llama: 0 compile(s) while building, "
                                     "2 warmup compile(s) over 3 call(s), 0 after warmup over * call(s)"])


def test_engines_with_a_broken_policy_fail_token_identity(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_eviction:H2OForgetsRecent",
                        "--kv-engine=kv_test_engines_eviction:StreamingLLMWithoutSinks",
                        "-k", "test_token_identity and long48 and not batched")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_eviction:H2OForgetsRecent' diverges from the oracle on model "
        "'llama', prompt 'long48' (length 48), alone: step * of 16",
        "*reference: transformers eager Llama, all keys kept, evicted ones masked by h2o(heavy=8, recent=8)",
    ])
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_eviction:StreamingLLMWithoutSinks' diverges from the oracle on "
        "model 'llama', prompt 'long48' (length 48), alone: step * of 16",
        "*reference: transformers eager Llama, all keys kept, evicted ones masked by streaming_llm(recent=12, sinks=4)",
    ])


@pytest.mark.parametrize("name", ["StreamingLLM", "SnapKV", "TOVA", "KNorm"])
def test_kept_sets_after_prefill_match_kvpress(llama, name):
    """kvpress's press (pytest_kvcompile/engines/kvpress.py, its declared parameters) keeps, per layer and
    KV head, exactly the positions our prefill-only oracle keeps (same model, prompts of 7, 23 and 48
    tokens: each evicts), and the kvpress engine's tokens equal the oracle's. Against our per-step
    policies after prefill: StreamingLLMPress keeps what streaming_llm(n_sink, n_kept - n_sink) keeps;
    TOVAPress keeps what tova(n_kept) keeps when the last token is in that set, otherwise that set's
    best n_kept - 1 plus the last token (kvpress protects it). docs/engines/kvpress.md lists the rules."""
    kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed (kvpress 0.5.5 needs transformers<5.3)")
    from transformers import AutoModelForCausalLM, DynamicCache

    from pytest_kvcompile.engines import kvpress as adapters

    engine = getattr(adapters, name)(llama)
    strategy = declaration_of(type(engine)).strategy
    params = dict(strategy.params)
    oracle = EvictionOracle(llama, strategy)
    model = AutoModelForCausalLM.from_pretrained(llama.path, attn_implementation="eager").eval()
    for n in (7, 23, 48):
        p, n_kept = prompt(n), oracle.policy.n_kept(n)
        ids = torch.tensor([p])
        full, pressed = DynamicCache(config=model.config), DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, **with_cache(full))
            with getattr(kvpress, engine.press)(**params)(model):
                model(ids, **with_cache(pressed))
        ours = oracle.kept(p, 1)  # the state right after prefill
        per_step = {"StreamingLLM": Strategy.of("streaming_llm", sinks=params.get("n_sink"),
                                                recent=n_kept - params.get("n_sink", 0)),
                    "TOVA": Strategy.of("tova", budget=n_kept)}.get(name)
        step_kept = EvictionOracle(llama, per_step).kept(p, 1) if per_step else None
        for layer, mine in enumerate(ours):
            # which positions kvpress kept: its keys are copies of the uncompressed ones
            distance = torch.cdist(pressed.layers[layer].keys[0], full.layers[layer].keys[0],
                                   compute_mode="donot_use_mm_for_euclid_dist")
            assert distance.min(-1).values.max() < 1e-6
            theirs = distance.argmin(-1).sort(-1).values
            assert theirs.tolist() == mine.tolist(), f"{name}, prompt length {n}, layer {layer}"
            for head in range(mine.shape[0]) if per_step else ():
                kv, step = set(theirs[head].tolist()), set(step_kept[layer][head].tolist())
                assert kv == step or (name == "TOVA" and n - 1 in kv - step and len(kv & step) == n_kept - 1)
        check_tokens(oracle.reference(p, NEW), engine.generate([p], NEW)[0], engine=f"kvpress-{name}",
                            model="llama", prompt=f"prompt of length {n}")
