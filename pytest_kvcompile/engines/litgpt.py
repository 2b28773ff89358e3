"""Built-in engines wrapping LitGPT (``litgpt==0.5.13``), imported only when an engine is built.

- ``litgpt``: LitGPT's own greedy loop (`litgpt.generate.base.generate_fn`, temperature 0 = raw-logit
  argmax, no stop tokens) over its static `KVCache`, eager.
- ``litgpt-compile``: the same loop over ``torch.compile(model)``.
- ``litgpt-top-k-1``: ``litgpt`` with ``top_k=1``: the argmax on every release (``sample()`` keeps one
  logit), also on 0.3.1 - 0.5.12, where temperature 0 with ``top_p=1.0`` samples (LitGPT #2238). It isolates
  the sliding-window bugs of older releases (#2145, PR #2215) from that one.

The HF checkpoint is converted in memory by LitGPT's own converter functions
(`litgpt.scripts.convert_hf_checkpoint.copy_weights_hf_llama` / `copy_weights_gemma_3`) into a
LitGPT `Config` built from the HF config (`litgpt_config_kwargs`, pure Python), without touching
LitGPT's global config table. The cache is allocated once per engine (`MAX_SEQ_LENGTH` positions,
batch 1: LitGPT's KV cache takes one sequence, or several of one length) and zeroed before every
call, as LitGPT's `LLM.generate` does with a fixed cache size.

Findings (docs/engines/litgpt.md) are LitGPT's, declared, not worked around: a prompt longer than a
sliding window raises in its ring-buffer `KVCache` (`generate_fn` prefills in one forward), and the
compiled forward recompiles for a 1-token prompt.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_kvcompile.contract.engine import (
    Bounds,
    Declaration,
    KVLayout,
    ModelNotSupported,
    ModelSpec,
    require_config,
)
from pytest_kvcompile.contract.findings import KnownFinding
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.memory.measure import held_bytes
from pytest_kvcompile.verdicts.failures import Kind

MAX_SEQ_LENGTH = 512  # KV-cache positions allocated per engine (prompt + new tokens must fit: the suites reach 266)
RECIPE = Recipe(
    packages=("litgpt==0.5.13",),
    note="litgpt installs without transformers, but pins huggingface-hub<1.4 (and psutil==7.2.2, "
    "jsonargparse<=4.41), so pip resolves this project's transformers>=5.2 to 5.3.0 (5.23 needs "
    "huggingface-hub>=1.31): the oracle runs on transformers 5.3, where gemma4-kvshared is Gemma3n.",
)
REQUIRES = RECIPE.requirement("litgpt")

#: litgpt 0.5.13's deliberate limit, declared (Declaration.bounds): a sliding-window layer's KVCache is a W-slot ring
#: buffer that raises ValueError ('Prefill length (n) exceeds the sliding window size') for a prefill longer than W,
#: and generate_fn prefills the whole prompt in one forward. Calls past it are named skips (docs/engines/litgpt.md).
BOUNDS = Bounds(prompt_within_window=True)
_INT_MAXP1 = ("litgpt 0.5.13: forward takes input_pos_maxp1 as a Python int; dynamo makes it dynamic but "
              "specializes 0/1, so a 1-token prompt (prefill with input_pos_maxp1=1) recompiles the forward "
              "(guard 'input_pos_maxp1 != 1', docs/engines/litgpt.md)")


_MASK_CACHE = ("litgpt 0.5.13: set_kv_cache also builds a [max_seq_length, max_seq_length] bool mask_cache "
               "(build_mask_cache) held beside the KV cache: 256 KiB at the 512 positions here, quadratic in the "
               "context (16 GiB at 131072 positions; docs/engines/litgpt.md, finding 4)")
_MASK_HELD = KnownFinding("test_memory_held_matches_reported", Kind.MEMORY, _MASK_CACHE, models=("llama",))


_NO_KV_SHARING = ("litgpt 0.5.13 has no {arch} architecture: its attention layers cannot reuse another "
                  "layer's KV (num_kv_shared_layers={shared}) and it has no per-layer input embeddings "
                  "(hidden_size_per_layer_input={per_layer}){extra}")


def _rope_theta(hf: Any, layer_type: str | None = None) -> float:
    """The RoPE base of `layer_type`'s layers (transformers 5 `rope_parameters`, per layer type where the
    model has several); ModelNotSupported for scaled RoPE (not mapped here)."""
    params = hf.rope_parameters
    params = params.get(layer_type, params)
    if params.get("rope_type", "default") != "default":
        raise ModelNotSupported(f"RoPE type {params['rope_type']!r} is not mapped to a LitGPT config by this adapter")
    return params["rope_theta"]



def litgpt_config_kwargs(hf: Any) -> dict[str, Any]:
    """LitGPT `Config(**kwargs)` equivalent to a transformers config (Llama, Mistral, Gemma3 text).

    Raises ModelNotSupported, with the reason, for architectures or options LitGPT 0.5.13 cannot
    represent (KV sharing, Gemma3n/Gemma4) or this mapping does not cover.
    """
    kind = hf.model_type
    if kind in ("gemma3n_text", "gemma4_text"):
        arch = "Gemma3n" if kind == "gemma3n_text" else "Gemma4"
        extra = ", AltUp or LAuReL blocks" if kind == "gemma3n_text" else ""
        raise ModelNotSupported(_NO_KV_SHARING.format(
            arch=arch, shared=getattr(hf, "num_kv_shared_layers", None),
            per_layer=getattr(hf, "hidden_size_per_layer_input", None), extra=extra))
    if kind not in ("llama", "mistral", "gemma3_text"):
        raise ModelNotSupported(f"model_type {kind!r} is not mapped to a LitGPT config by this adapter "
                                "(mapped: llama, mistral, gemma3_text)")
    n_layer = hf.num_hidden_layers
    common = dict(
        block_size=hf.max_position_embeddings,
        n_layer=n_layer,
        n_embd=hf.hidden_size,
        vocab_size=hf.vocab_size,
        padded_vocab_size=hf.vocab_size,  # logits over exactly the HF vocabulary
        n_head=hf.num_attention_heads,
        n_query_groups=hf.num_key_value_heads,
        head_size=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=hf.rms_norm_eps,
        intermediate_size=hf.intermediate_size,
    )
    if kind in ("llama", "mistral"):
        require_config(hf, "a LitGPT config", hidden_act="silu", attention_bias=False, mlp_bias=False)
        window = getattr(hf, "sliding_window", None) if kind == "mistral" else None
        sliding = dict(sliding_window_size=window, sliding_window_indices=[1] * n_layer) if window else {}
        # The name matters: LitGPT's RMSNorm adds 1 to its weight when "Gemma" is in the config's name.
        return dict(common, name=f"kvcompile-{kind}", mlp_class_name="LLaMAMLP", rope_base=_rope_theta(hf), **sliding)
    require_config(hf, "a LitGPT config", hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                    use_bidirectional_attention=False)
    sliding = [1 if t == "sliding_attention" else 0 for t in hf.layer_types]
    return dict(
        common,
        name="Gemma-3-kvcompile",  # "Gemma" in the name: RMSNorm scales by (1 + weight), as Gemma3RMSNorm
        mlp_class_name="GemmaMLP",
        gelu_approximate="tanh",
        scale_embeddings=True,
        attention_scores_scalar=hf.query_pre_attn_scalar,
        attention_logit_softcapping=hf.attn_logit_softcapping,
        final_logit_softcapping=hf.final_logit_softcapping,
        post_attention_norm=True,
        post_mlp_norm=True,
        norm_qk=True,
        sliding_window_size=hf.sliding_window if any(sliding) else None,
        sliding_window_indices=sliding,
        rope_base=_rope_theta(hf, "full_attention"),
        rope_local_base_freq=_rope_theta(hf, "sliding_attention"),
        rope_indices=sliding,  # LitGPT: 1 = the local RoPE base, on the sliding layers as in Gemma3
    )


def _load(spec: ModelSpec):
    """The LitGPT GPT for `spec`, weights converted by LitGPT's converter; eval mode, on device and dtype."""
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.scripts.convert_hf_checkpoint import (
        copy_weights_gemma_3,
        copy_weights_hf_llama,
    )

    config = Config(**litgpt_config_kwargs(spec.config))
    hf_weights = spec.weights()
    state_dict: dict[str, torch.Tensor] = {}
    if spec.config.model_type == "gemma3_text":
        copy_weights_gemma_3({}, state_dict, hf_weights, config=config)
    else:
        copy_weights_hf_llama(config, {}, state_dict, hf_weights)
    model = GPT(config)
    model.load_state_dict(state_dict, strict=True)
    model.max_seq_length = min(MAX_SEQ_LENGTH, config.block_size)
    model = model.to(device=spec.device, dtype=spec.dtype).eval()
    model.set_kv_cache(batch_size=1, device=torch.device(spec.device), dtype=spec.dtype)
    return model


class LitGPT:
    """LitGPT's `generate_fn` (greedy, one prompt per call) over its static KV cache, eager."""

    kv_declaration = Declaration(
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("static", max_cache_len=MAX_SEQ_LENGTH, rows=1),
        requires=REQUIRES,
        description="litgpt 0.5.13 generate_fn, static KVCache (512 positions, batch 1), eager",
        bounds=BOUNDS,
        known_findings=(_MASK_HELD,),
    )

    #: generate_fn's sampling arguments: temperature 0 with the default top_p, as users call it
    SAMPLING: dict[str, Any] = dict(temperature=0.0, top_k=None, top_p=1.0)

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.gpt = _load(spec)
        self.model = self.gpt

    def _reset(self) -> None:
        """Zero every layer's KV buffers in place (LitGPT's `LLM.generate` with a fixed cache size)."""
        for block in self.gpt.transformer.h:
            block.attn.kv_cache.reset_parameters()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from litgpt.generate.base import generate_fn

        out = []
        for prompt in prompts:
            self._reset()
            if max_new_tokens == 0:
                out.append([])
                continue
            tokens = generate_fn(
                self.model, torch.tensor(prompt, device=self.spec.device), len(prompt) + max_new_tokens,
                **self.SAMPLING, stop_tokens=(), include_prompt=False, include_eos=True,
            )
            out.append([int(t) for t in tokens])
        return out

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits [len(continuation), vocab] through generate_fn's calls: prefill `prompt`
        (input_pos 0..T-1), then each continuation token at its position; row i predicts continuation[i]."""
        self._reset()
        device, n = self.spec.device, len(prompt)
        rows = []
        x = torch.tensor([prompt], device=device)
        for i in range(len(continuation)):
            input_pos = torch.arange(n, device=device) if i == 0 else torch.tensor([n + i - 1], device=device)
            logits = self.model(x, input_pos, input_pos_maxp1=n + i)
            rows.append(logits[0, -1].float().cpu())
            x = torch.tensor([[continuation[i]]], device=device)
        return torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)

    def kv_cache_bytes(self) -> int:
        """Bytes of every layer's K and V buffers (allocated once: MAX_SEQ_LENGTH, or W on sliding layers)."""
        return held_bytes(t for block in self.gpt.transformer.h for t in (block.attn.kv_cache.k, block.attn.kv_cache.v))


class LitGPTTopK1(LitGPT):
    """`litgpt` with ``top_k=1``: `sample()` crops the logits to the largest one, so the token is the argmax on
    every release, including those that sample at temperature 0 (LitGPT #2238, <= 0.5.12)."""

    SAMPLING = dict(temperature=0.0, top_k=1, top_p=1.0)
    kv_declaration = Declaration(
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("static", max_cache_len=MAX_SEQ_LENGTH, rows=1),
        requires=REQUIRES,
        description="litgpt generate_fn with top_k=1 (argmax on every release, LitGPT #2238 aside), static "
        "KVCache (512 positions, batch 1), eager",
        bounds=BOUNDS,
        known_findings=(_MASK_HELD,),
    )


class LitGPTCompiled(LitGPT):
    """The same loop over ``torch.compile(model, backend=compile_backend)`` (LitGPT's generate compiles its
    `next_token`, i.e. the model's forward plus argmax)."""

    kv_declaration = Declaration(
        eager="litgpt",
        scoring=True,
        kv_cache_bytes=True,
        compiled=True,
        kv_layout=KVLayout("static", max_cache_len=MAX_SEQ_LENGTH, rows=1),
        requires=REQUIRES,
        description="litgpt 0.5.13 generate_fn over torch.compile(model), static KVCache (512 positions, batch 1)",
        bounds=BOUNDS,
        known_findings=(KnownFinding("test_no_recompiles_after_warmup", Kind.RECOMPILE, _INT_MAXP1, models=("llama",)),
                        _MASK_HELD),
    )

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor"):
        super().__init__(spec)
        self.model = torch.compile(self.gpt, backend=compile_backend)
