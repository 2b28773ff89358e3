"""The shared-KV prefill-skip engine (reference_impls/kv_shared.py, model reference_impls/gemma4.py).

- The model equals transformers' Gemma4 (the no-skip oracle) with and without the skip.
- The skipped positions are really unused: random hidden states at those positions entering the
  shared layers change no logit, in our model and in transformers' own; the same randomisation
  entering a non-shared layer does change them (so the check can fail).
- The saving, counted: the prefill's layer FLOPs drop by (the shared layers' share) x (N-1)/N.
- The suites catch a broken skip (CI's main job runs every suite on `ref-kv-shared` itself).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from conftest import run_suites  # noqa: E402
from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.oracles.eviction import kv_sources  # noqa: E402
from reference_impls.compile import left_pad  # noqa: E402
from reference_impls.kv_shared import KVSharedPrefillSkip  # noqa: E402
from reference_impls.loader import load_model  # noqa: E402

LENGTHS = (2, 7, 9, 48)  # around the window (W=8) and longer


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> ModelSpec:
    try:
        path = zoo.checkpoint("gemma4-kvshared", tmp_path_factory.mktemp("zoo"))
    except zoo.ModelUnavailable as exc:
        pytest.skip(str(exc))
    config = AutoConfig.from_pretrained(path)
    if config.model_type != "gemma4_text":
        pytest.skip(f"this transformers builds gemma4-kvshared as {config.model_type}, not Gemma4")
    return ModelSpec("gemma4-kvshared", path, config)


@pytest.fixture(scope="module")
def model(spec):
    return load_model(spec)


@pytest.fixture(scope="module")
def hf(spec):
    return AutoModelForCausalLM.from_pretrained(spec.path, attn_implementation="eager").eval()


def ours(model, prompts, skip: bool) -> torch.Tensor:
    model.skip_shared_prefill = skip
    with torch.inference_mode():
        return model(*left_pad(prompts, "cpu"))[0]


def theirs(hf, prompt_ids) -> torch.Tensor:
    """transformers' last-position logits with every position through every layer (logits_to_keep=0: no slicing)."""
    with torch.inference_mode():
        return hf(torch.tensor([prompt_ids]), logits_to_keep=0).logits[:, -1]


def randomise_skipped(layers, seed: int):
    """Forward pre-hooks replacing every position but the last of each layer's input hidden states with noise."""
    g = torch.Generator().manual_seed(seed)

    def hook(layer, args, kwargs):
        x = args[0].clone()
        x[:, :-1] = torch.randn(x[:, :-1].shape, generator=g) * x.std()
        return (x, *args[1:]), kwargs

    return [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]


def test_sharing_rule_matches_transformers(spec):
    """Layer i >= L - S reads the K/V of the last earlier non-shared layer of its type (transformers: 'store')."""
    sources = kv_sources(spec.config)
    assert sources == {2: 0, 3: 1}
    modes = spec.config.kv_sharing_modes
    assert [i for i, m in enumerate(modes) if m == "reuse"] == sorted(sources)
    assert [i for i, m in enumerate(modes) if m == "store"] == sorted(set(sources.values()))


@pytest.mark.parametrize("length", LENGTHS)
def test_model_equals_transformers_with_and_without_the_skip(model, hf, length):
    p = prompt(length, length)
    expected = theirs(hf, p)
    for skip in (False, True):
        torch.testing.assert_close(ours(model, [p], skip), expected, rtol=0, atol=1e-4)


def test_skip_leaves_logits_and_cache_bitwise_unchanged_in_a_padded_batch(model):
    prompts = [prompt(n, n) for n in LENGTHS]
    model.skip_shared_prefill = False
    with torch.inference_mode():
        full, full_cache = model(*left_pad(prompts, "cpu"))
        model.skip_shared_prefill = True
        skipped, skipped_cache = model(*left_pad(prompts, "cpu"))
    torch.testing.assert_close(skipped, full, rtol=0, atol=1e-5)
    assert len(skipped_cache) == 2  # the shared layers cache nothing
    for (k, v), (k2, v2) in zip(full_cache, skipped_cache):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("length", LENGTHS[1:])
def test_randomised_skipped_positions_change_nothing(model, hf, spec, length):
    p = prompt(length, 100 + length)
    clean_ours, clean_theirs = ours(model, [p], False), theirs(hf, p)
    shared = sorted(kv_sources(spec.config))
    handles = randomise_skipped([model.model.layers[i] for i in shared], seed=length)
    handles += randomise_skipped([hf.model.layers[i] for i in shared], seed=length)
    try:
        noisy_ours, noisy_theirs = ours(model, [p], False), theirs(hf, p)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(noisy_ours, clean_ours), (noisy_ours - clean_ours).abs().max()
    assert torch.equal(noisy_theirs, clean_theirs), (noisy_theirs - clean_theirs).abs().max()


@pytest.mark.parametrize("length", LENGTHS[1:])
def test_randomised_positions_entering_a_non_shared_layer_do_change_the_output(model, hf, spec, length):
    """The control: the same noise one layer earlier (the last non-shared layer) reaches the logits."""
    p = prompt(length, 100 + length)
    clean_ours, clean_theirs = ours(model, [p], False), theirs(hf, p)
    last_own = min(kv_sources(spec.config)) - 1
    handles = randomise_skipped([model.model.layers[last_own]], seed=length)
    handles += randomise_skipped([hf.model.layers[last_own]], seed=length)
    try:
        noisy_ours, noisy_theirs = ours(model, [p], False), theirs(hf, p)
    finally:
        for h in handles:
            h.remove()
    assert (noisy_ours - clean_ours).abs().max() > 1e-2
    assert (noisy_theirs - clean_theirs).abs().max() > 1e-2


def layer_flops(model, prompts, skip: bool) -> list[int]:
    """Per-layer FLOPs of one prefill, as torch.utils.flop_counter counts them (the matmuls of the linear layers)."""
    model.skip_shared_prefill = skip
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(*left_pad(prompts, "cpu"))
    counts = counter.get_flop_counts()
    return [sum(counts[f"Gemma4.model.layers.{i}"].values()) for i in range(len(model.model.layers))]


@pytest.mark.parametrize("length", (7, 48, 200))
def test_prefill_saving_is_the_shared_share_times_n_minus_1_over_n(model, spec, length):
    full, skipped = layer_flops(model, [prompt(length, 1)], False), layer_flops(model, [prompt(length, 1)], True)
    shared = sorted(kv_sources(spec.config))
    share = sum(full[i] for i in shared) / sum(full)
    saving = 1 - sum(skipped) / sum(full)
    assert saving == pytest.approx(share * (length - 1) / length, rel=1e-12)
    theory = len(shared) / len(full) * (length - 1) / length
    # Shared layers have no K/V projections, so they are less than S/L of the layer work.
    assert 0 < share < len(shared) / len(full) and saving < theory
    for i in shared:
        assert full[i] == length * skipped[i]


def test_models_without_shared_layers_are_not_supported(tmp_path):
    path = zoo.checkpoint("llama", tmp_path)
    with pytest.raises(ModelNotSupported, match="'llama' .*has no KV-shared layers"):
        KVSharedPrefillSkip(ModelSpec("llama", path, AutoConfig.from_pretrained(path)), compile_backend="eager")


def test_token_identity_catches_dropping_the_shared_layers_at_prefill(kvtester, spec):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_kvshared:SkipsSharedLayers",
                        "--kv-zoo=gemma4-kvshared", "-k", "test_token_identity and not batched and (len1 or long48)")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_kvshared:SkipsSharedLayers' diverges from the oracle on model "
        "'gemma4-kvshared', prompt 'len1' (length 1), alone: step 0 of 16",
        "*hint: step 0 is decided by prefill alone*",
    ])


def test_kv_bytes_are_the_non_shared_layers_only(spec):
    """The cache holds L - S layers: half of the unshared model's bytes here (2 of 4 layers)."""
    engine = KVSharedPrefillSkip(spec, compile_backend="eager")
    engine.generate([prompt(48, 3)], 4)
    per_layer = (48 + 4 - 1) * 2 * 2 * 16 * 4  # positions x (K, V) x kv_heads x head_dim x fp32 bytes
    assert engine.kv_cache_bytes() == 2 * per_layer == spec.config.num_hidden_layers * per_layer // 2


def test_global_layers_with_their_own_head_dim_match_transformers(tmp_path):
    """Gemma4's full layers may be wider (global_head_dim): geometry and RoPE per layer type."""
    import transformers

    if getattr(transformers, "Gemma4TextConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma4")
    tiny = {**zoo._TINY, "head_dim": 16}
    config = transformers.Gemma4TextConfig(
        **tiny, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, global_head_dim=32)
    zoo._build_model(config).save_pretrained(tmp_path)
    spec = ModelSpec("gemma4-global32", tmp_path, AutoConfig.from_pretrained(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = load_model(spec)
    for length in (7, 48):
        p = prompt(length, length)
        torch.testing.assert_close(ours(model, [p], True), theirs(hf, p), rtol=0, atol=1e-4)
