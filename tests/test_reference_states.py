"""The references on the hybrid models (issue 70): reference_impls/bamba.py's Mamba2 layers and qwen3_next.py's Gated
DeltaNet layers keep a `model.State` beside the attention layers' K/V, in ref-compiled-dynamic, ref-chunked-prefill
(reference_impls/chunked_prefill.py), ref-paged-prefix (snapshots per block) and ref-speculative (a state after
each verified token), checked here against transformers' own models in float64; the suites judge the engines on
`bamba` and `qwen3-next` (CI's served job, under inductor)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.recompiles.recorder import CompileRecorder  # noqa: E402
from reference_impls.chunked_prefill import ChunkedPrefill  # noqa: E402
from reference_impls.compile import left_pad  # noqa: E402
from reference_impls.loader import load_model  # noqa: E402
from reference_impls.model import STATE, State, StateSteps  # noqa: E402
from reference_impls.paged_prefix import PagedPrefixCache  # noqa: E402
from reference_impls.qwen3_next import gated_delta  # noqa: E402
from reference_impls.static_cache import StaticCache  # noqa: E402

#: float32 against float64: the largest logit error measured on these prompts was 1.0e-4 of the largest logit (7.3e-6
#: relative on bamba, 7.6e-6 on qwen3-next); a scan that loses D, the decay, beta or the carried state is off by
#: orders of magnitude
TOLERANCE = 2e-5


def spec(name: str, tmp_path_factory) -> ModelSpec:
    path = zoo.checkpoint(name, tmp_path_factory.mktemp("zoo"))
    return ModelSpec(name, path, AutoConfig.from_pretrained(path))


@pytest.fixture(scope="module")
def bamba(tmp_path_factory) -> ModelSpec:
    return spec("bamba", tmp_path_factory)


@pytest.fixture(scope="module", params=["bamba", "qwen3-next"])
def hybrid(request, tmp_path_factory) -> ModelSpec:
    return spec(request.param, tmp_path_factory)


def truth(hybrid: ModelSpec):
    """Every position's logits [t, vocab] of one prompt, transformers' model in float64 (positions passed; experts
    one by one: the grouped kernel refuses float64)."""
    model = AutoModelForCausalLM.from_pretrained(hybrid.path, dtype=torch.float64,
                                                 experts_implementation="eager").eval()

    @torch.no_grad()
    def run(ids: list[int]):
        tokens = torch.tensor([ids])
        return model(tokens, position_ids=torch.arange(len(ids))[None]).logits[0].float()

    return run


def close(got, want):
    error = (got - want).abs().max().item()
    assert error <= TOLERANCE * want.abs().max().item(), f"max error {error:.3g} at logit scale {want.abs().max():.3g}"


@torch.no_grad()
def test_the_reference_computes_what_transformers_does_whole_chunked_stepwise_and_padded(hybrid):
    model, run = load_model(hybrid, states=True), truth(hybrid)
    recurrent = [kind == STATE for kind in model.layer_types]
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    want = run(ids)
    tokens, valid = torch.tensor([ids]), torch.ones(1, 40, dtype=torch.bool)
    whole, _ = model(tokens, valid, every=True)
    close(whole[0], want)
    _, cache = model(tokens[:, :16], valid[:, :16])  # a chunk boundary inside the conv window, then another
    assert [isinstance(entry, State) for entry in cache] == recurrent
    states = [entry for entry in cache if isinstance(entry, State)]
    assert all(entry.conv.shape[1] == 3 and entry.ssm.dtype == torch.float for entry in states)  # K-1; float32
    second, steps = model(tokens[:, 16:32], valid[:, :32], cache, every=True)
    close(second[0], want[16:32])
    # a verify step's states after each of its tokens: the one after token j is the state 17 + j tokens leave
    assert [isinstance(entry, StateSteps) for entry in steps] == recurrent
    _, upto = model(tokens[:, :21], valid[:, :21])
    for got, want_state in zip(steps, upto):
        if isinstance(got, StateSteps):
            for x, y in zip(got.at(torch.tensor([4])), want_state):
                assert (x - y).abs().max() <= 1e-5 * y.abs().max(), (x - y).abs().max()
    cache = [entry.at(torch.tensor([15])) if isinstance(entry, StateSteps) else entry for entry in steps]
    for i in range(32, 40):
        step, cache = model(tokens[:, i:i + 1], valid[:, :i + 1], cache)
        close(step[0], want[i])
    short = ids[5:30]  # left-padded beside the 40-token prompt: a pad reaches neither its keys nor its states
    padded, valid = left_pad([ids, short], "cpu")
    both, _ = model(padded, valid)
    close(both[0], want[-1])
    close(both[1], run(short)[-1])


@torch.no_grad()
def test_the_unrolled_delta_rule_is_the_token_by_token_recurrence():
    """`gated_delta` over t tokens at once against the rule applied token by token (float64), from zeros and from a
    state, its state after every token too; one term dropped (the decay, beta, the delta's read of the state) is
    far off."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 2, 24, 3, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(b, t, h, d, generator=gen, dtype=torch.float64)
    g, beta = -torch.rand(b, t, h, generator=gen, dtype=torch.float64), torch.rand(b, t, h, generator=gen,
                                                                                  dtype=torch.float64)
    start = torch.randn(b, h, d, d, generator=gen, dtype=torch.float64)

    def recurrence(state, g=g, beta=beta, read=1.0):
        outs, after = [], []
        for i in range(t):
            state = state * g[:, i].exp()[..., None, None]
            u = (v[:, i] - read * (state * k[:, i, ..., None]).sum(-2)) * beta[:, i, :, None]
            state = state + k[:, i, ..., None] * u[..., None, :]
            outs.append((state * q[:, i, ..., None]).sum(-2))
            after.append(state)
        return torch.stack(outs, 1), torch.stack(after, 1)

    for state in (None, start):
        want, every = recurrence(torch.zeros_like(start) if state is None else state)
        out, last = gated_delta(q, k, v, g, beta, None if state is None else state.float())
        _, steps = gated_delta(q, k, v, g, beta, None if state is None else state.float(), every=True)
        assert (out - want).abs().max() < 1e-5 and (last - every[:, -1]).abs().max() < 1e-5
        assert (steps - every).abs().max() < 1e-5
    for wrong in (recurrence(start, g=torch.zeros_like(g))[0], recurrence(start, beta=torch.ones_like(beta))[0],
                  recurrence(start, read=0.0)[0]):
        assert (gated_delta(q, k, v, g, beta, start.float())[0] - wrong).abs().max() > 1e-2


def test_chunked_prefill_compiles_twice_then_never(bamba):
    """The first chunk, then one graph for every later chunk and decode step, whatever the batch and lengths."""
    with CompileRecorder() as rec:
        engine = ChunkedPrefill(bamba, compile_backend="eager")  # dynamo's guards decide recompiles
        engine.generate([[5, 6, 7]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompts in ([list(range(1, 40)), [5] * 7], [list(range(3, 22))], [[9]] * 3):
                assert [len(row) for row in engine.generate(prompts, 3)] == [3] * len(prompts)
    assert [e.frame.split(" ")[0] for e in rec.warmup_events] == ["prefill", "decode"]
    assert rec.post_warmup_events == [], "\n".join(e.describe() for e in rec.post_warmup_events)
    # the last call (3 rows, 1 + 3 - 1 positions): 2 Mamba2 layers' states once per row (the conv's K-1 = 3 inputs over
    # 160 channels, 4 x 32 x 16 float32), 2 attention layers' K and V (2 heads x 16) per position
    conv, state, kv = 3 * 160 * 4, 4 * 32 * 16 * 4, 2 * 2 * 16 * 4
    assert engine.kv_cache_bytes() == 3 * 2 * (conv + state) + 3 * 3 * 2 * kv


def test_the_paged_prefix_cache_compiles_once_and_holds_a_state_slot_per_block(bamba):
    """A fresh row's zero states and a hit's snapshot go through the same graph: one compile, then none, over hits
    between snapshots, full hits and batches; the pool and the state slots are what it holds."""
    with CompileRecorder() as rec:
        engine = PagedPrefixCache(bamba, compile_backend="eager", num_blocks=16)
        engine.generate([[5, 6, 7]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            ids = list(range(1, 40))
            for prompts in ([ids], [ids[:20], ids[:33]], [ids[:17] + [9] * 5], [ids[:32]]):
                assert [len(row) for row in engine.generate(prompts, 3)] == [3] * len(prompts)
    assert [e.frame.split(" ")[0] for e in rec.warmup_events] == ["step"]
    assert rec.post_warmup_events == [], "\n".join(e.describe() for e in rec.post_warmup_events)
    # 16 blocks of 16 positions: 2 attention layers' K and V (2 heads x 16); 16 state slots for each of the 2 Mamba2
    # layers (the conv's K-1 = 3 inputs over 160 channels, 4 x 32 x 16 float32)
    kv, conv, state = 2 * 2 * 16 * 4, 3 * 160 * 4, 4 * 32 * 16 * 4
    assert engine.kv_cache_bytes() == 16 * 16 * 2 * kv + 16 * 2 * (conv + state)


def test_references_keeping_key_values_only_refuse_a_model_with_states(bamba):
    with pytest.raises(ModelNotSupported, match=r"model 'bamba' has recurrent layers \(0, 2: .*ref-chunked-prefill"):
        load_model(bamba)
    with pytest.raises(ModelNotSupported, match="model 'bamba' has state layers"):
        StaticCache(bamba, compile_backend="eager")
