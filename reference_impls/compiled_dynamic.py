"""Reference engine: a gpt-fast-style decoder over a growing KV cache, under torch.compile.

Models: Llama, Mistral (Llama + sliding window), Gemma3 text (`reference_impls/gemma3.py`) and Gemma4
text with KV sharing (`reference_impls/gemma4.py`),
~150 lines of plain PyTorch loaded straight from the checkpoint's safetensors, so every shape
is ours. Sliding-window layers keep every key here and mask by position (the zoo rule: a query
at position q sees key k iff q - W < k <= q); `reference_impls/sliding_window.py` is the engine
whose sliding layers hold only the window.

Two functions are compiled, once each: `prefill` (batch and prompt length dynamic) and `decode`
(batch and cache length dynamic, one new token per row). The cache is
DynamicCache-like: per-layer K/V tensors [batch, seq, kv_heads, head_dim] that grow by
`torch.cat` every step, so memory follows prompt + generated tokens. cudagraphs stay off: the
shapes change every step.

Dynamic shapes, and why exactly two compiles:

- Every varying dim (batch, prompt length, cache length, mask length) is marked
  `mark_unbacked` before each call, and the compiled code ties the symbols together with
  `torch._check` (one batch; one cache length shared by every layer's K and V; mask length =
  cache length + new tokens), so the graph has one batch and one length symbol, not one per tensor.
- Unbacked, not `mark_dynamic`: dynamo specialises backed sizes 0 and 1 (batch 1, a 1-token prompt,
  the first decode step after it), and a graph warmed on sizes >= 2 guards `size >= 2`, so each
  of those would compile again. Unbacked sizes are never specialised and install no shape guards:
  warming up on batch 1 / prompt 1 serves batch 4 / prompt 256 and back. The price: the code
  must not branch on a size (there is none: the mask and positions are tensor ops).
- Guards that are not about sizes are kept constant too: the cache tensors are always freshly
  allocated and contiguous (no stride guard can flip between prefill and decode outputs), and
  generate/score always run under `torch.inference_mode()` (a caller's no_grad vs inference_mode
  would otherwise fail a dispatch-key guard).
- Each engine compiles private copies of `prefill`/`decode` (`compile_fresh`): dynamo caches per
  code object, so engines for other models, dtypes or backends never count as its recompiles.

Batches are left-padded; `valid` [batch, keys] marks real tokens. Positions restart at 0 on each
prompt's first real token and pads are masked from every query, so a padded row computes what
the prompt alone would.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch._dynamo.decorators import mark_unbacked  # not re-exported by torch._dynamo in 2.13

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec
from pytest_kvcompile.memory.measure import KVLayout
from pytest_kvcompile.models.zoo import sliding_layers

class UnsupportedModel(ModelNotSupported):
    """The checkpoint's architecture or options are outside what this engine implements."""


# --------------------------------------------------------------------------- model

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types names


def layer_types(config) -> list[str]:
    """SLIDING or FULL per layer (`zoo.sliding_layers`: `layer_types`, else Mistral's `sliding_window`)."""
    sliding = set(sliding_layers(config))
    return [SLIDING if i in sliding else FULL for i in range(config.num_hidden_layers)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's (static) RoPE variant.

    Configs with RoPE per layer type (Gemma3: `rope_parameters = {"sliding_attention": {...},
    "full_attention": {...}}`) give `layer_type`'s; flat ones (Llama, Mistral) give theirs to every type.
    """
    rope = dict(getattr(config, "rope_parameters", None) or {})
    per_type = layer_type in rope
    if per_type:
        rope = dict(rope[layer_type])
    kind = rope.get("rope_type", "default")
    # Gemma4 keeps per-layer-type geometry in per_layer_config (its config.head_dim raises when layers differ).
    c = config.per_layer_config[layer_type] if per_type and hasattr(config, "per_layer_config") else config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if kind == "default":
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in ("dynamic", "longrope") or kind not in ROPE_INIT_FUNCTIONS:  # the first two depend on the length
        raise UnsupportedModel(f"rope_type '{kind}' is not supported (static RoPE variants only)")
    return ROPE_INIT_FUNCTIONS[kind](config, layer_type=layer_type if per_type else None)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_mask(q_pos, k_pos, k_real, window: int | None = None):
    """Bool [b, 1, t, n]: may query i (position q_pos[:, i]) see key j (position k_pos[:, j])?

    Yes iff key j is a real token (`k_real`, not a pad or an empty slot) and k <= q, and for a
    sliding layer of window W also q - W < k (the zoo rule, `zoo.attention_window`). The t new
    keys are the last t of the n: query i also always sees key n - t + i, itself, so a pad query
    has a non-empty row (its output is never read).
    """
    t, n = q_pos.size(1), k_pos.size(1)
    q, k = q_pos[:, None, :, None], k_pos[:, None, None, :]
    seen = k_real[:, None, None, :] & (k <= q)
    if window is not None:
        seen = seen & (k > q - window)
    itself = torch.arange(n, device=q_pos.device) == torch.arange(n - t, n, device=q_pos.device)[:, None]
    return seen | itself


class Attention(nn.Module):
    scale: float | None = None  # SDPA's default, 1/sqrt(head_dim)

    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(self, x):
        """q [b, t, heads, d], k and v [b, t, kv_heads, d], before RoPE."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        return q, k, self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)

    def attend(self, q, k, v, mask):
        """q [b, heads, t, d], k and v [b, kv_heads, n, d], mask [b, 1, t, n] -> [b, heads, t, d]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

    def forward(self, x, cos, sin, mask, past):
        b, t, _ = x.shape
        q, k, v = self.project(x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:  # append this step's keys and values to the cache
            k = torch.cat((past[0], k), dim=1)
            v = torch.cat((past[1], v), dim=1)
        # The cache is [b, seq, heads, d]: always freshly allocated and contiguous, so its
        # strides follow its sizes (no stride guards to fail between prefill and decode).
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)), (k, v)


#: config activation name -> function (transformers' ACT2FN entries these models use).
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, config, hidden_act: str | None = None):
        super().__init__()
        hidden_act = hidden_act or getattr(config, "hidden_act", "silu")
        if hidden_act not in ACTIVATIONS:
            raise UnsupportedModel(f"activation '{hidden_act}' is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[hidden_act]
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, past):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    def __init__(self, config, block: type[nn.Module], norm: type[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(block(config) for _ in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


def rope_tables(config, device=None) -> dict[str, tuple[torch.Tensor, float]]:
    """Layer type -> (inv_freq in fp32 on `device`, attention scaling), like transformers' rotary embedding."""
    tables = {kind: rope_inv_freq(config, kind) for kind in sorted(set(layer_types(config)))}
    return {kind: (inv_freq.to(device), scale) for kind, (inv_freq, scale) in tables.items()}


class Llama(nn.Module):
    """Llama, and Mistral (the same weights; `config.sliding_window` makes every layer sliding).

    Parameter names match transformers' *ForCausalLM, so the checkpoint loads as is. `run` is the
    model for any cache layout (the caller gives key positions and masks); `forward` is it over the
    growing cache of this module's engine.
    """

    block, norm = Block, RMSNorm

    def __init__(self, config):
        super().__init__()
        self.model = Backbone(config, self.block, self.norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layer_types = layer_types(config)
        self.window = config.sliding_window if SLIDING in self.layer_types else None
        self.rope = rope_tables(config)  # load_model rebuilds it on the real device

    def embed(self, tokens):
        return self.model.embed_tokens(tokens)

    def head(self, x):
        return self.lm_head(x)

    def run(self, tokens, pos, masks, cache):
        """Logits [b, vocab] of the last position, and each layer's keys and values, past + new.

        tokens [b, t]; pos [b, t] their positions (RoPE); masks: layer type -> [b, 1, t, n] bool
        (`attention_mask`); cache: per layer (k, v) [b, n - t, kv_heads, d] or None (nothing cached).
        """
        x = self.embed(tokens)
        cos_sin = {}
        for kind, (inv_freq, scale) in self.rope.items():
            freqs = pos[..., None].float() * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # [b, t, 1, d]
            cos_sin[kind] = ((emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype))
        kvs = []
        for layer, kind, past in zip(self.model.layers, self.layer_types, cache or [None] * len(self.layer_types)):
            x, kv = layer(x, *cos_sin[kind], masks[kind], past)
            kvs.append(kv)
        x = self.model.norm(x.narrow(1, tokens.size(1) - 1, 1))
        return self.head(x)[:, 0], kvs

    def masks(self, q_pos, k_pos, k_real):
        """Layer type -> `attention_mask` (the window applies to sliding layers only)."""
        return {kind: attention_mask(q_pos, k_pos, k_real, self.window if kind == SLIDING else None)
                for kind in self.rope}

    def forward(self, tokens, valid, cache=None):
        """Logits [batch, vocab] for the last position, and the grown cache.

        tokens [b, t] are the new tokens; valid [b, n] marks real (non-pad) tokens over all n
        keys, the cache's n - t plus these t; cache is a list of per-layer (k, v) [b, n - t, kv_heads, d].
        """
        b, t = tokens.shape
        n = valid.size(1)
        # Tie the dynamic sizes: one batch, and one cache length shared by every layer's K and V.
        past = cache[0][0].size(1) if cache else 0
        torch._check(t >= 1)
        torch._check(valid.size(0) == b)
        torch._check(n == past + t)
        for x in (x for kv in cache or () for x in kv):
            torch._check(x.size(0) == b)
            torch._check(x.size(1) == past)
        # Positions count real tokens only: a left-padded prompt sees what it would see alone.
        k_pos = valid.long().cumsum(-1) - 1
        q_pos = k_pos.narrow(1, n - t, t).clamp(min=0)
        return self.run(tokens, q_pos, self.masks(q_pos, k_pos, valid), cache)


#: config.model_type -> model class (reference_impls/gemma3.py adds "gemma3_text").
ARCHITECTURES: dict[str, type[nn.Module]] = {"llama": Llama, "mistral": Llama}


def load_model(spec: ModelSpec) -> nn.Module:
    """The checkpoint's model in spec.dtype on spec.device, weights straight from its safetensors."""
    config = spec.config
    if config.model_type not in ARCHITECTURES:
        raise UnsupportedModel(
            f"reference_impls does not support model_type '{config.model_type}' (model '{spec.name}'); "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    with torch.device("meta"):
        model = ARCHITECTURES[config.model_type](config)
    state = {}
    for file in sorted(Path(spec.path).glob("*.safetensors")):
        state.update(load_file(file, device=str(spec.device)))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state[getattr(model, "tied_embedding", "model.embed_tokens.weight")]
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(spec.dtype).eval().requires_grad_(False)
    if hasattr(model, "rope"):  # RoPE models (not GPT-2)
        model.rope = rope_tables(config, spec.device)  # not in the checkpoint; fp32 like transformers
    return model


# --------------------------------------------------------------------------- engine


def prefill(model, tokens, valid):
    return model(tokens, valid)


def decode(model, tokens, valid, cache):
    return model(tokens, valid, cache)


def compile_fresh(fn, backend: str):
    """torch.compile a private copy of `fn`.

    Dynamo keeps compiled code (and its recompile limit) per code object. A fresh code object
    per engine gives each engine its own cache: exactly its own compiles, never a
    "recompile" because another engine served a different model, dtype or backend first.
    """
    code = fn.__code__.replace()  # an equal but distinct code object
    fn = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    options = {"triton.cudagraphs": False} if backend == "inductor" else None  # shapes change every step
    return torch.compile(fn, backend=backend, fullgraph=True, options=options)


def mark_dynamic(tokens, valid, cache=None):
    """Batch, prompt and cache lengths vary: unbacked, so sizes 0/1 are not specialised either."""
    mark_unbacked(tokens, 0)
    mark_unbacked(valid, 0)
    mark_unbacked(valid, 1)
    if cache is None:
        mark_unbacked(tokens, 1)  # prefill: any prompt length; decode: one token
    for k, v in cache or ():
        for x in (k, v):
            mark_unbacked(x, 0)
            mark_unbacked(x, 1)


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [b, width] left-padded with 0, and valid [b, width] marking the real tokens."""
    if not all(prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(map(len, prompts))
    tokens = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
    return tokens, valid


class DynamicState(NamedTuple):
    valid: torch.Tensor  # [b, n]: real tokens among the n cached positions
    cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [b, n, kv_heads, d]


class CompiledDynamicCache:
    """Greedy generation with a growing KV cache; prefill and decode each compiled once.

    generate/score drive `_prefill` and `_decode`, which pass an engine-specific state whose
    `cache` field is the per-layer (k, v) list (reference_impls/sliding_window.py reuses them).
    """

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("dynamic", windowed=False),  # sliding layers keep every key (masked), see the docstring
        compiled=True,
        description="reference: gpt-fast-style Llama/Mistral/Gemma3/Gemma4, dynamic KV cache, torch.compile with "
        "unbacked dynamic shapes",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor"):
        self.spec = spec
        self.model = load_model(spec)
        self.compiled_prefill = compile_fresh(prefill, compile_backend)
        self.compiled_decode = compile_fresh(decode, compile_backend)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last generate's

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, DynamicState]:
        """Left-pad the prompts and run them: last logits [b, vocab] and the state."""
        tokens, valid = left_pad(prompts, self.spec.device)
        mark_dynamic(tokens, valid)
        logits, cache = self.compiled_prefill(self.model, tokens, valid)
        return logits, DynamicState(valid, cache)

    def _decode(self, tokens: torch.Tensor, state: DynamicState) -> tuple[torch.Tensor, DynamicState]:
        """Feed one token per row (tokens [b]): logits [b, vocab] and the state, one key longer."""
        tokens, valid = tokens[:, None], torch.cat((state.valid, state.valid.new_ones(tokens.size(0), 1)), dim=1)
        mark_dynamic(tokens, valid, state.cache)
        logits, cache = self.compiled_decode(self.model, tokens, valid, state.cache)
        return logits, DynamicState(valid, cache)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens <= 0 or not prompts:
            self.cache = []
            return [[] for _ in prompts]
        logits, state = self._prefill(prompts)
        out = [logits.argmax(-1)]
        for _ in range(max_new_tokens - 1):
            logits, state = self._decode(out[-1], state)
            out.append(logits.argmax(-1))
        self.cache = state.cache
        return torch.stack(out, dim=1).tolist()

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(continuation), vocab]: the generate path, fed `continuation`."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size, dtype=self.spec.dtype, device=self.spec.device)
        logits, state = self._prefill([prompt])
        rows = [logits[0]]
        for token in continuation[:-1]:
            logits, state = self._decode(torch.tensor([token], device=self.spec.device), state)
            rows.append(logits[0])
        return torch.stack(rows)

    def kv_cache_bytes(self) -> int:
        """Bytes of the K/V tensors the last generate left (here: prompt width + new tokens - 1 positions)."""
        return sum(x.numel() * x.element_size() for kv in self.cache for x in kv)


import reference_impls.gemma3  # noqa: E402,F401  register Gemma3 and Gemma4 in ARCHITECTURES (they import this module)
import reference_impls.gemma4  # noqa: E402,F401
import reference_impls.gpt2  # noqa: E402,F401  register GPT-2
