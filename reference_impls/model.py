"""The reference models, gpt-fast style: Llama / Mistral, and the pieces every architecture shares.

One place for each: RoPE (`rope_inv_freq`, `rope_cos_sin`, `apply_rope`), the attention mask (`attention_mask`,
the zoo's window rule), the KV cache (`KVCache.update(layer, k, v)`: gpt-fast's `KVCache.update`, one object for
all layers) and the layer loop (`Decoder.run`). An engine gives the loop positions, masks and its cache object
(compiled_dynamic.py, sliding_window.py: `GrowingCache`; static_cache.py: buffers written by slot;
eviction_engine.py: fixed buffers that drop entries); an architecture (gemma3.py, gemma4.py, gpt2.py) says only
what it changes. Parameter names match transformers' *ForCausalLM, so checkpoints load as they are (loader.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_kvcompile.contract.engine import ModelNotSupported
from pytest_kvcompile.models.zoo import sliding_layers
from pytest_kvcompile.recompiles.hooks import torch_check


def sdpa(q, k, v, mask, scale: float | None, enable_gqa: bool = False):
    """`F.scaled_dot_product_attention`; compiled on CUDA in 16-bit it is held to the math backend: there the fused
    backends' eligibility checks guard on the prompt width, which the compiled engines leave unbacked, and dynamo
    fails (`Could not guard on data-dependent expression Eq(u0, 1)`, torch 2.11 on an H100: docs/gpu-results.md)."""
    if torch.compiler.is_compiling() and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@torch.library.custom_op("reference_impls::matmul", mutates_args=())
def matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [..., m, k] @ y [..., k, n], y's leading dims broadcast to x's, as an opaque op: inductor lowers a batched
    matmul to a bmm whose lowering guards on whether a size the compiled engines leave unbacked is 1
    (`is_preferred_layout_as_bmm_input`: "Could not guard on data-dependent expression Eq(u1, 1)"); here eager's
    kernel runs, in eager's rounding."""
    return torch.matmul(x, y).contiguous()


@matmul.register_fake
def _(x, y):
    return x.new_empty((*x.shape[:-1], y.shape[-1]))


class UnsupportedModel(ModelNotSupported):
    """The checkpoint's architecture or options are outside what the reference models implement."""


SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types names
STATE = "linear_attention"  # a recurrent layer (bamba.py's Mamba2, qwen3_next.py's Gated DeltaNet): a state per row


def layer_types(config) -> list[str]:
    """SLIDING or FULL per layer (`zoo.sliding_layers`: `layer_types`, else Mistral's `sliding_window`)."""
    sliding = set(sliding_layers(config))
    return [SLIDING if i in sliding else FULL for i in range(config.num_hidden_layers)]


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's (static) RoPE variant.

    Configs with RoPE per layer type (Gemma3: `rope_parameters = {"sliding_attention": {...},
    "full_attention": {...}}`) give `layer_type`'s; flat ones (Llama, Mistral) give theirs to every type.
    """
    # transformers 5.x: `rope_parameters`; 4.x: `rope_scaling` (None for default RoPE; "type" in old configs).
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    per_type = layer_type in rope
    if per_type:
        rope = dict(rope[layer_type])
    kind = rope.get("rope_type", rope.get("type", "default"))
    # Gemma4 keeps per-layer-type geometry in per_layer_config (its config.head_dim raises when layers differ).
    c = config.per_layer_config[layer_type] if per_type and hasattr(config, "per_layer_config") else config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if kind == "default":
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        # partial rotary (Phi-3): RoPE over the first head_dim x factor dimensions only (`apply_rope` leaves the rest)
        head_dim = int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in ("dynamic", "longrope") or kind not in ROPE_INIT_FUNCTIONS:  # the first two depend on the length
        raise UnsupportedModel(f"rope_type '{kind}' is not supported (static RoPE variants only)")
    if per_type:
        return ROPE_INIT_FUNCTIONS[kind](config, layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[kind](config, None)  # (config, device): 4.x's device is positional, 5.x's optional


def rope_tables(config, device=None) -> dict[str, tuple[torch.Tensor, float]]:
    """Layer type -> (inv_freq in fp32 on `device`, attention scaling), like transformers' rotary embedding."""
    tables = {kind: rope_inv_freq(config, kind) for kind in sorted(set(layer_types(config)))}
    return {kind: (inv_freq.to(device), scale) for kind, (inv_freq, scale) in tables.items()}


def rope_cos_sin(pos, rope: tuple[torch.Tensor, float], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] in `dtype` at positions `pos` [...]; rope = (inv_freq fp32, attention scaling)."""
    freqs = pos[..., None].float() * rope[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope[1]).to(dtype), (emb.sin() * rope[1]).to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [..., head_dim] rotated by the angles of `rope_cos_sin` (transformers' rotate_half layout); where the angles
    cover fewer dimensions (partial rotary, Phi-3), the first of them, the rest passed through."""
    rotated = cos.size(-1)
    if rotated == x.size(-1):
        return x * cos + rotate_half(x) * sin
    head, tail = x.split([rotated, x.size(-1) - rotated], dim=-1)
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


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


# --------------------------------------------------------------------------- the KV cache


class State(NamedTuple):
    """A recurrent layer's cache (bamba.py, qwen3_next.py): per row, whatever the length, the conv's last K-1 inputs
    [b, K-1, channels] in the model's dtype and the recurrent state [b, heads, ...] in float32."""

    conv: torch.Tensor
    ssm: torch.Tensor


class StateSteps(NamedTuple):
    """A recurrent layer's `State` after each of a call's t new tokens (`KVCache.every_state`: a speculative verify
    step, to roll back to any of them): conv [b, t, K-1, channels], ssm [b, t, heads, head_dim, state]."""

    conv: torch.Tensor
    ssm: torch.Tensor

    def at(self, index: torch.Tensor) -> State:
        """Each row's `State` after its new token `index` [b] (0-based), freshly allocated."""
        rows = torch.arange(index.size(0), device=index.device)
        return State(self.conv[rows, index], self.ssm[rows, index])


class KVCache:
    """Where the layer loop keeps keys and values: gpt-fast's `KVCache.update`, one object for every layer.

    `update(layer, k, v)` takes a layer's new keys and values [b, t, kv_heads, d] and returns the keys and
    values that layer attends over, [b, n, kv_heads, d]; `attend` is that attention (the layer's own, SDPA with
    the mask, unless the cache needs the weights). `keys_rotated`: the layers hand over keys after RoPE
    (False: before, and the cache rotates them itself: eviction_engine.py's pos-shift). A recurrent layer reads its
    `state` before the new tokens and hands `update_state` the one after them (`every_state`: after each of them).
    """

    keys_rotated = True
    every_state = False  # a recurrent layer hands `update_state` its `StateSteps` (after each new token), not a State
    past = None  # `GrowingCache`'s earlier K/V (gpt2.py copies its views of the prefill's K/V into a fresh cache)

    def update(self, layer: int, k, v):
        raise NotImplementedError

    def state(self, layer: int) -> State | None:
        """The recurrent layer's `State` before the new tokens; None: nothing yet (the layer starts from zeros)."""
        raise UnsupportedModel(f"{type(self).__name__} keeps keys and values only, no recurrent state")

    def update_state(self, layer: int, state: State) -> None:
        raise UnsupportedModel(f"{type(self).__name__} keeps keys and values only, no recurrent state")

    def attend(self, layer: int, attn, q, k, v, mask):
        """q [b, t, heads, d], k and v from `update`, mask [b, 1, t, n] -> [b, t, heads, d]."""
        return attn.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)


class GrowingCache(KVCache):
    """DynamicCache-like: each layer's keys and values grow by `torch.cat`, so they are always freshly
    allocated and contiguous (no stride guard can flip between prefill and decode outputs)."""

    def __init__(self, past=None, every_state: bool = False):
        self.past = past  # per layer (k, v) [b, n - t, kv_heads, d]; None: nothing cached yet
        self.every_state = every_state
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer written, in order: past + new

    def update(self, layer, k, v):
        if self.past is not None:
            k = torch.cat((self.past[layer][0], k), dim=1)
            v = torch.cat((self.past[layer][1], v), dim=1)
        self.layers.append((k, v))
        return k, v

    def state(self, layer):
        return None if self.past is None else self.past[layer]

    def update_state(self, layer, state):
        self.layers.append(state)


@torch.no_grad()
def probe(model) -> list:
    """What each layer with a cache of its own keeps after one token: (k, v) [1, 1, ...] or a `State` [1, ...], read
    off one eager step, so every architecture fits."""
    one = torch.zeros(1, 1, dtype=torch.long, device=model.lm_head.weight.device)
    cache = GrowingCache()
    model.run(one, one, model.masks(one, one, one == 0), cache)
    return cache.layers


def cache_shapes(model) -> list[tuple[torch.Size, torch.Size]]:
    """Per layer with K/V of its own, what it caches per position: the (K, V) shapes [kv_heads, d] (a latent layer:
    [1, kv_lora_rank] and [1, qk_rope_head_dim]); recurrent layers' states are `state_shapes`."""
    return [(k.shape[2:], v.shape[2:]) for k, v in (e for e in probe(model) if not isinstance(e, State))]


def state_shapes(model) -> list[State]:
    """Per recurrent layer, in layer order, a one-row `State` of zeros: the shapes and dtypes a row's state has."""
    return [State(*(torch.zeros_like(x) for x in e)) for e in probe(model) if isinstance(e, State)]


# --------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x):
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self.weight * self.normalize(x).to(x.dtype)


#: config activation name -> function (transformers' ACT2FN entries these models use).
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def activation(name: str, what: str = "activation"):
    """ACTIVATIONS[name], or UnsupportedModel naming `what` and the activations known."""
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"{what} '{name}' is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    def __init__(self, config, hidden_act: str | None = None, inner: int | None = None):
        super().__init__()
        hidden_act = hidden_act or getattr(config, "hidden_act", "silu")
        self.act = activation(hidden_act)
        bias, inner = getattr(config, "mlp_bias", False), inner or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=bias)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    scale: float | None = None  # SDPA's default, 1/sqrt(head_dim)

    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias or config.model_type == "qwen2"  # Qwen2: q, k and v biased, o not
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(self, x):
        """q [b, t, heads, d], k and v [b, t, kv_heads, d], before RoPE."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        return q, k, self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)

    def attend(self, q, k, v, mask):
        """q [b, heads, t, d], k and v [b, kv_heads, n, d], mask [b, 1, t, n] -> [b, heads, t, d]."""
        return sdpa(q, k, v, mask, self.scale, enable_gqa=True)

    def forward(self, x, rope, mask, cache: KVCache, layer: int):
        """x [b, t, dim]; rope: (cos, sin) [b, t, 1, d], or None (no rotation here, `KVCache.keys_rotated`)."""
        b, t, _ = x.shape
        q, k, v = self.project(x)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k, v = cache.update(layer, k, v)
        y = cache.attend(layer, self, q, k, v, mask)
        return self.o_proj(y.reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    """A pre-norm decoder layer; an architecture changes its parts (`attention`, `feed_forward`, `norm`)."""

    attention, norm = Attention, RMSNorm

    def __init__(self, config, layer: int = 0):
        super().__init__()
        self.input_layernorm = self.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention(config)
        self.post_attention_layernorm = self.norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.feed_forward(config, layer)

    def feed_forward(self, config, layer: int) -> nn.Module:
        """Layer `layer`'s MLP (a mixture-of-experts architecture: its experts where the config routes)."""
        return MLP(config)

    def forward(self, x, rope, mask, cache: KVCache, layer: int):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The layer loop (gpt-fast's `Transformer.forward`), for every architecture and cache.

    A subclass has `layers`, `layer_types` (SLIDING or FULL per layer), `window`, `rope` (layer type ->
    (inv_freq, scaling); empty without RoPE), `embed(tokens, pos)` and `head(x)` (final norm, LM head).
    """

    window: int | None = None

    def rotary(self, pos, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Layer type -> RoPE (cos, sin) [b, t, 1, d] at positions pos [b, t]."""
        return {kind: rope_cos_sin(pos[:, :, None], rope, dtype) for kind, rope in self.rope.items()}

    def run(self, tokens, pos, masks, cache: KVCache, every: bool = False):
        """Logits [b, vocab] of the last of tokens [b, t], at positions pos [b, t] (RoPE; GPT-2: wpe); `every`:
        logits [b, t, vocab] of every position (a speculative verify step, reference_impls/speculative.py).

        masks: layer type -> [b, 1, t, n] bool (`attention_mask`) over the n keys `cache.update` returns.
        """
        x = self.embed(tokens, pos)
        rope = self.rotary(pos, x.dtype) if cache.keys_rotated else {}
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types)):
            x = layer(x, rope.get(kind), masks[kind], cache, i)
        return self.head(x) if every else self.head(x.narrow(1, x.size(1) - 1, 1))[:, 0]

    def masks(self, q_pos, k_pos, k_real):
        """Layer type -> `attention_mask` (the window applies to sliding layers only); a recurrent layer's: which of
        the t new tokens are real [b, t] (a pad never reaches a state)."""
        t, n = q_pos.size(1), k_pos.size(1)
        return {kind: k_real.narrow(1, n - t, t) if kind == STATE else
                attention_mask(q_pos, k_pos, k_real, self.window if kind == SLIDING else None)
                for kind in sorted(set(self.layer_types))}

    def forward(self, tokens, valid, cache=None, every: bool = False):
        """Logits [batch, vocab] for the last position (`every`: [batch, t, vocab], every position, and a recurrent
        layer's state after each: `StateSteps`), and the grown cache (`GrowingCache`).

        tokens [b, t] are the new tokens; valid [b, n] marks real (non-pad) tokens over all n
        keys, the cache's n - t plus these t; cache is a list of per-layer (k, v) [b, n - t, kv_heads, d] (a
        recurrent layer: its `State`).
        """
        b, t = tokens.shape
        n = valid.size(1)
        # Tie the dynamic sizes: one batch, and one cache length shared by every layer's K and V.
        kv = [entry for entry in cache or () if not isinstance(entry, State)]
        past = kv[0][0].size(1) if kv else n - t if cache else 0  # n - t: a model of recurrent layers alone
        torch_check(t >= 1)
        torch_check(valid.size(0) == b)
        torch_check(n == past + t)
        for entry in cache or ():
            for x in entry:
                torch_check(x.size(0) == b)
                if not isinstance(entry, State):
                    torch_check(x.size(1) == past)
        # Positions count real tokens only: a left-padded prompt sees what it would see alone.
        k_pos = valid.long().cumsum(-1) - 1
        q_pos = k_pos.narrow(1, n - t, t).clamp(min=0)
        grown = GrowingCache(cache, every)
        return self.run(tokens, q_pos, self.masks(q_pos, k_pos, valid), grown, every), grown.layers


class Backbone(nn.Module):
    def __init__(self, config, block: type[nn.Module], norm: type[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


class Llama(Decoder):
    """Llama, Mistral (the same weights; `config.sliding_window` makes every layer sliding) and Qwen2 (Mistral with
    q/k/v biases; `use_sliding_window` and `max_window_layers` choose the sliding layers)."""

    block, norm = Block, RMSNorm

    def __init__(self, config):
        super().__init__()
        self.model = Backbone(config, self.block, self.norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layer_types = layer_types(config)
        self.window = config.sliding_window if SLIDING in self.layer_types else None
        self.rope = rope_tables(config)  # load_model rebuilds it on the real device

    @property
    def layers(self):
        return self.model.layers

    def embed(self, tokens, pos):
        return self.model.embed_tokens(tokens)

    def head(self, x):
        return self.lm_head(self.model.norm(x))
