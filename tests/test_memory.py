"""pytest_kvcompile.memory.measure: held bytes, the KVLayout footprint formulas against transformers' own caches,
and the memory suite (suites/test_kv_memory.py) failing broken engines (tests/kv_test_engines_memory.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from conftest import run_suites
from pytest_kvcompile.contract.engine import KVLayout
from pytest_kvcompile.memory.measure import (
    StateSizesUnknown,
    cache_tensors,
    expected_kv_bytes,
    held_bytes,
    live_tensor_bytes,
)
from pytest_kvcompile.models import zoo
from pytest_kvcompile.models.checkpoints import with_cache
from pytest_kvcompile.models.layers import expanded

NEW_TOKENS = 5
MAX_CACHE_LEN = 40


# --------------------------------------------------------------------------- held_bytes


def test_a_view_holds_its_whole_base():
    base = torch.zeros(1, 2, 8, 16)  # 256 floats: 1,024 bytes
    window = base[:, :, 1:]  # the W-1 positions a sliding layer keeps
    assert window.nbytes == 896 and held_bytes([window]) == 1024


def test_a_shared_storage_counts_once_and_distinct_ones_add_up():
    k = torch.zeros(2, 3)
    assert held_bytes([k, k.view(3, 2), k[0], None]) == 24
    assert held_bytes([k, torch.zeros(2, 3)]) == 48


def test_unallocated_and_meta_tensors_hold_nothing():
    assert held_bytes([None, torch.empty(4, 4, device="meta"), torch.empty(0)]) == 0


def test_live_tensor_bytes_sees_new_tensors():
    before = live_tensor_bytes()
    kept = [torch.zeros(1000) for _ in range(3)]
    assert live_tensor_bytes() - before >= 12000
    del kept


# --------------------------------------------------------------------------- KVLayout


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(allocation="paged"), "KVLayout allocation 'paged' is unknown; write KVLayout(\"dynamic\"), *"),
    (dict(allocation="static"), "*max_cache_len is required for allocation 'static' and only there*"),
    (dict(allocation="dynamic", budget=8), "*budget is required for allocation 'budget' and only there*"),
    (dict(allocation="budget", budget=0), "*budget must be an int >= 1, got 0"),
    (dict(window_offset=1), "*window_offset must be -1 (W-1 positions) or 0 (W), got 1"),
    (dict(rows=0), "*rows must be an int >= 1, got 0"),
    (dict(conv_window_offset=1),
     "*conv_window_offset must be -1 (the conv keeps kernel-1 inputs) or 0 (kernel), got 1"),
    (dict(state_dtype="int8"), "*state_dtype must be one of None, 'float32', 'bfloat16', 'float16', got 'int8'"),
])
def test_bad_layouts_name_the_fix(kwargs, message):
    with pytest.raises(ValueError) as info:
        KVLayout(**kwargs)
    assert info.match(message.replace("(", r"\(").replace(")", r"\)").replace("*", ".*"))


def test_positions_per_kind():
    assert KVLayout().positions(22, None) == (22, "T=22")
    assert KVLayout().positions(22, 8) == (8, "min(T=22, W=8)")
    assert KVLayout(window_offset=-1).positions(5, 8) == (5, "min(T=5, W-1=7)")
    assert KVLayout("static", max_cache_len=256).positions(22, 8) == (8, "min(max_cache_len=256, W=8)")
    assert KVLayout("budget", budget=16).positions(22, None) == (16, "min(T=22, budget=16)")


def test_fixed_rows():
    llama = zoo.ZOO["llama"].build_config()
    one, padded = (expected_kv_bytes(KVLayout("static", max_cache_len=64, rows=rows), llama, torch.float32, 1, 7, 4)
                   for rows in (None, 4))
    assert (one.rows, padded.rows, padded.total) == (1, 4, 4 * one.total)


def test_footprint_needs_a_decode_step():
    with pytest.raises(ValueError, match="new_tokens >= 2"):
        expected_kv_bytes(KVLayout(), zoo.ZOO["llama"].build_config(), torch.float32, 1, 7, 1)


# --------------------------------------------------------------------------- the formulas vs transformers' caches


def _gemma4_wide_global():
    """gemma4-kvshared with global layers of their own geometry (head_dim 32, 1 KV head)."""
    config = zoo.ZOO["gemma4-kvshared"].build_config()
    kwargs = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
    return type(config)(**{**kwargs, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True})


def _tiny(class_name: str, **kwargs):
    """A builder of a tiny config of a hybrid family the zoo does not carry (models/states.py's readers must find its
    state's sizes in its own field names): ModelUnavailable where this transformers has no such class."""
    def build():
        cls = zoo._config_class(class_name, class_name)
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)
        return cls(**{**base, **kwargs})

    return build


#: hybrid families beyond the zoo's two, each spelling its state's sizes its own way
OTHER_HYBRIDS = {
    "nemotron-h": _tiny("NemotronHConfig", num_hidden_layers=4,
                        layers_block_type=["mamba", "attention", "mlp", "mamba"],
                        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=3,
                        head_dim=16, chunk_size=16),
    "granite-4-h": _tiny("GraniteMoeHybridConfig", num_hidden_layers=2, layer_types=["mamba", "attention"],
                         mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                         mamba_expand=2, mamba_chunk_size=16, num_local_experts=0),
    "falcon-h1": _tiny("FalconH1Config", num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                       mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16,
                       projectors_bias=False),  # every layer attends and runs a Mamba2 mixer beside: state+kv
    "jamba": _tiny("JambaConfig", num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
}
CONFIGS = ({name: zoo.ZOO[name].build_config for name in zoo.RANDOM} | {"gemma4-wide-global": _gemma4_wide_global}
           | OTHER_HYBRIDS)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    try:
        config = CONFIGS[request.param]()
    except zoo.ModelUnavailable as exc:
        pytest.skip(str(exc))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.inference_mode()
def _decode(model, cache, lengths: list[int]):
    """Left-padded prefill of prompts of these lengths, then NEW_TOKENS - 1 decode steps (generate's forwards)."""
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    ids = torch.randint(0, 256, mask.shape)
    for _ in range(NEW_TOKENS - 1):
        ids = model(input_ids=ids, attention_mask=mask, **with_cache(cache), use_cache=True).logits[:, -1:].argmax(-1)
        mask = torch.cat((mask, torch.ones_like(ids)), dim=1)
    model(input_ids=ids, attention_mask=mask, **with_cache(cache), use_cache=True)


@pytest.mark.parametrize("lengths", [[3], [7, 1, 20, 9]], ids=str)  # T below the window; a padded batch above it
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_formula_equals_what_transformers_caches_hold(model, kind, lengths):
    config = model.config
    if kind == "dynamic":
        cache, layout = DynamicCache(config=config), KVLayout()
    else:
        cache, layout = (StaticCache(config=config, max_cache_len=MAX_CACHE_LEN),
                         KVLayout("static", max_cache_len=MAX_CACHE_LEN))
        assert held_bytes(cache_tensors(cache)) == 0  # allocated lazily, at the first forward
    _decode(model, cache, lengths)
    footprint = expected_kv_bytes(layout, config, torch.float32, len(lengths), max(lengths), NEW_TOKENS)
    assert held_bytes(cache_tensors(cache)) == footprint.total, footprint.explain()


def test_sliding_layer_holds_more_than_its_nbytes():
    """The measurement behind held_bytes: the kept W-1 positions are a view of a W-position buffer."""
    config = zoo.ZOO["mistral-sw"].build_config()
    torch.manual_seed(0)
    cache = DynamicCache(config=config)
    _decode(AutoModelForCausalLM.from_config(config).eval(), cache, [20])
    tensors = cache_tensors(cache)
    window = config.sliding_window
    assert [t.shape[-2] for t in tensors] == [window - 1] * 4
    assert held_bytes(tensors) == sum(t.nbytes for t in tensors) * window // (window - 1)


def test_per_layer_geometry():
    footprint = expected_kv_bytes(KVLayout(), _gemma4_wide_global(), torch.float32, 1, 10, 4)
    assert [getattr(t.cache, "kv_heads", 0) for t in footprint.layers] == [2, 1, 0, 0]  # 2 and 3 reuse 0's and 1's
    assert [getattr(t.cache, "head_dim", 0) for t in footprint.layers] == [16, 32, 0, 0]


def test_shared_kv_layers_hold_nothing():
    footprint = expected_kv_bytes(KVLayout(), zoo.ZOO["gemma4-kvshared"].build_config(), torch.bfloat16, 2, 10, 4)
    assert [(t.kind, t.positions) for t in footprint.layers] == [("sliding", 8), ("full", 13), ("shared", 0),
                                                                  ("shared", 0)]
    assert footprint.total == 2 * (8 + 13) * 2 * 2 * 16 * 2
    assert "layer 2 (shared): 0 (reuses another layer's KV)" in footprint.explain()


def test_latent_layers_hold_the_latent_and_the_rope_key():
    """Multi-head latent attention (DeepSeek-V3): kv_lora_rank + qk_rope_head_dim values per position, no per-head K/V;
    the per-head alternative (`expanded`) is what the hint compares with."""
    config = zoo.ZOO["deepseek-v3"].build_config()
    footprint = expected_kv_bytes(KVLayout(), config, torch.bfloat16, 2, 10, 4)
    assert [(t.kind, t.positions, t.cache.values) for t in footprint.layers] == [("latent", 13, 32 + 8)] * 3
    assert footprint.total == 3 * 2 * 13 * (32 + 8) * 2
    assert expanded(footprint.layers[0].cache, config).values == 4 * ((16 + 8) + 16)
    llama = zoo.ZOO["llama"].build_config()
    gqa = expected_kv_bytes(KVLayout(), llama, torch.float32, 1, 4, 2).layers[0].cache
    assert expanded(gqa, llama).values == 4 * 2 * 16  # GQA's 2 KV heads repeated for the 4 query heads


def test_recurrent_layers_hold_one_state_per_row_whatever_the_length():
    """A hybrid model's recurrent layers hold a conv window and a recurrent state per row, the same at every length;
    the conv window in the model's dtype, the recurrent state in float32 unless the layout stores it lower."""
    config = zoo.ZOO["bamba"].build_config()
    short, long = (expected_kv_bytes(KVLayout(), config, torch.bfloat16, 2, width, 4) for width in (3, 300))
    assert [t.kind for t in short.layers] == ["state", "full", "state", "full"]
    state = (160 * 4 * 2 + 4 * 32 * 16 * 4)  # conv 160 channels x 4 inputs in bfloat16, Mamba2 state in float32
    assert [t.fixed for t in short.layers] == [state, 0, state, 0] == [t.fixed for t in long.layers]
    assert long.total - short.total == 2 * 2 * (300 - 3) * 2 * 2 * 16 * 2  # only the attention layers grow
    lower = expected_kv_bytes(KVLayout(conv_window_offset=-1, state_dtype="bfloat16"), config, torch.bfloat16, 2, 3, 4)
    assert lower.layers[0].fixed == 160 * 3 * 2 + 4 * 32 * 16 * 2
    assert ("layer 0 (state): 2 x (conv 160 channels x 4 inputs [K=4] x 2 + mamba2 state 4 x 32 x 16 x 4 (float32)) = "
            f"{2 * state} (per row whatever the length)") in short.explain()
    deltanet = expected_kv_bytes(KVLayout(), zoo.ZOO["qwen3-next"].build_config(), torch.float32, 1, 5, 2)
    assert [t.fixed for t in deltanet.layers] == [(128 * 4 + 4 * 16 * 16) * 4] * 3 + [0]


def test_a_state_whose_sizes_no_reader_knows_is_named():
    config = zoo.ZOO["bamba"].build_config()
    config.mamba_d_state = None  # a family spelling its state's size in a field the readers do not know
    with pytest.raises(StateSizesUnknown, match="layer 0 is a recurrent layer .layer type 'linear_attention'. "
                                                "whose state's sizes are not in config fields the suite reads "
                                                ".known: Mamba2"):
        expected_kv_bytes(KVLayout(), config, torch.float32, 1, 5, 2)


# --------------------------------------------------------------------------- the suite on test engines

ENGINES = ("DynamicBytes", "NbytesNotStorage", "KeepsOutOfWindowKeys", "KeepsEveryCache")


def test_memory_suite_passes_correct_and_fails_broken_engines(kvtester):
    result = run_suites(
        kvtester, *(f"--kv-engine=kv_test_engines_memory:{e}" for e in ENGINES), "--kv-zoo=mistral-sw",
        "-k", "kv_memory and (DynamicBytes or ((NbytesNotStorage or KeepsOutOfWindowKeys) and long48) or "
              "(KeepsEveryCache and growth))",
    )
    # DynamicBytes: its 7 prompts, the held-memory and the growth checks pass; its batched check skips (no batching).
    result.assert_outcomes(passed=9, failed=3, skipped=1)
    for failed in ("test_no_memory_growth?kv_test_engines_memory:KeepsEveryCache-mistral-sw",  # in any order
                   "test_kv_cache_bytes?kv_test_engines_memory:NbytesNotStorage-mistral-sw-long48",
                   "test_kv_cache_bytes?kv_test_engines_memory:KeepsOutOfWindowKeys-mistral-sw-long48"):
        result.stdout.fnmatch_lines([f"FAILED *{failed}*"])
    result.stdout.fnmatch_lines([
        "engine 'kv_test_engines_memory:KeepsOutOfWindowKeys' on model 'mistral-sw', prompt 'long48' alone, 16 new "
        "tokens: kv_cache_bytes() = 32,256 B (31.5 KiB) but its declared KVLayout('dynamic') holds 4,096 B (4.0 KiB) "
        "(+28,160 B)",
        "*hint: the count matches sliding layers holding all T=63 positions: the engine keeps keys that left the "
        "window (masked, never read again)*",
    ])
    result.stdout.fnmatch_lines([
        "engine 'kv_test_engines_memory:NbytesNotStorage' on model 'mistral-sw', prompt 'long48' alone, 16 new "
        "tokens: kv_cache_bytes() = 3,584 B (3.5 KiB) but its declared KVLayout('dynamic') holds 4,096 B (4.0 KiB) "
        "(-512 B)",
        "KVLayout('dynamic'), T = width 48 + new_tokens 16 - 1 = 63; bytes = rows x positions x values per position "
        "(the layer's kind) x dtype bytes",
        "  layer 0 (sliding): 1 x 8 [min(T=63, W=8)] x 2 (K,V) x 2 kv_heads x 16 head_dim x 4 = 2048",
        "  layer 1 (sliding): 1 x 8 [min(T=63, W=8)] x 2 (K,V) x 2 kv_heads x 16 head_dim x 4 = 2048",
        "  total: 4096",
        "  hint: the count matches KVLayout('dynamic', window_offset=-1), sliding layers holding W-1 positions, not W.*"
        "count storages with pytest_kvcompile.memory.measure.held_bytes, not tensor.nbytes*",
    ], consecutive=True)
    result.stdout.fnmatch_lines([
        "engine 'kv_test_engines_memory:KeepsEveryCache' on model 'mistral-sw': memory grows over 3 repeated calls "
        "generate(<1 prompt(s) of lengths [[]48[]]>, 16), each call with other prompts of these lengths",
        "  live tensor bytes: 4,112 B (4.0 KiB) after 1 warmup call(s), then +4,112 B, +4,112 B, +4,112 B per call",
        "  hint: generate() keeps something per call (caches or outputs appended to a list*",
    ], consecutive=True)


def test_a_latent_cache_held_per_head_fails_naming_the_latent(kvtester):
    """Multi-head latent attention: the footprint is the latent's; an engine caching K and V per head (the latent
    up-projected) fails with a hint naming that, while the correct engine on the same model passes."""
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_memory:CachesExpandedLatent",
                        "--kv-engine=kv_test_engines_memory:DynamicBytes", "--kv-zoo=deepseek-v3",
                        "-k", "test_kv_cache_bytes and long48")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "engine 'kv_test_engines_memory:CachesExpandedLatent' on model 'deepseek-v3', prompt 'long48' alone, 16 new "
        "tokens: kv_cache_bytes() = 120,960 B (118.1 KiB) but its declared KVLayout('dynamic') holds 30,240 B "
        "(29.5 KiB) (+90,720 B)",
        "*layer 0 (latent): 1 x 63 [[]T=63[]] x (32 kv_lora_rank + 8 qk_rope_head_dim) x 4 = 10080",
        "*hint: the count matches K and V per head, the latent up-projected (kv_b_proj) before it was cached*",
    ])


def test_a_state_not_counted_or_growing_fails_naming_the_state(kvtester):
    """Hybrid models: the footprint counts each recurrent layer's state once per row; an engine leaving the states
    out, and one whose conv windows grow with the sequence, fail with hints naming that, on both state families,
    while the correct engine passes."""
    result = run_suites(kvtester, *(f"--kv-engine=kv_test_engines_memory:{e}" for e in
                                    ("DynamicBytes", "StateNotCounted", "StateGrowsWithLength")),
                        "--kv-zoo=recurrent", "-k", "test_kv_cache_bytes and long48")
    result.assert_outcomes(passed=2, failed=4)
    result.stdout.fnmatch_lines([
        "engine 'kv_test_engines_memory:StateNotCounted' on model 'bamba', prompt 'long48' alone, 16 new tokens: "
        "kv_cache_bytes() = 32,256 B (31.5 KiB) but its declared KVLayout('dynamic') holds 53,760 B (52.5 KiB) "
        "(-21,504 B)",
        "*layer 0 (state): 1 x (conv 160 channels x 4 inputs [[]K=4[]] x 4 + mamba2 state 4 x 32 x 16 x 4 (float32)) "
        "= 10752 (per row whatever the length)",
        "*hint: the count matches the attention layers alone: the recurrent layers' states (layers 0, 2: *) were "
        "not counted*",
    ])
    result.stdout.fnmatch_lines([
        "engine 'kv_test_engines_memory:StateGrowsWithLength' on model 'qwen3-next', prompt 'long48' alone, *",
        "*hint: the count matches conv windows holding all T=63 inputs, not the conv's kernel: a recurrent layer's "
        "state grows with the sequence*",
    ])


def test_memory_held_skips_by_name_when_nothing_is_visible(kvtester):
    # Instant holds no tensor at all (as a native runtime's cache and weights): nothing measured is a named skip,
    # never a pass of "0 B <= what it reports"
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_latency:Instant", "--kv-engine=kv_test_engines:Greedy",
                        "-k", "test_memory_held or test_no_memory_growth", "-rs")
    # Greedy: its growth check runs, its held check skips (it declares nothing to hold against); Instant: its growth
    # check runs on what it reports (kv_cache_bytes() must not change), its held check measured nothing: a named skip
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines(["*Instant* holds no tensor visible from Python after *not even its weights: its "
                                 "model and cache live in native memory*nothing was measured*"])
    opaque = run_suites(kvtester, "--kv-engine=kv_test_engines_latency:Opaque", "-k", "test_no_memory_growth", "-rs")
    opaque.assert_outcomes(skipped=1)  # a census of nothing proves nothing
    opaque.stdout.fnmatch_lines(["*Opaque* holds no tensor visible from Python, not even its weights, and reports no "
                                 "kv_cache_bytes(): its memory is native*"])
