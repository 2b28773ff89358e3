"""KV-cache eviction policies: the exact rules, and the masking oracle that applies them.

The step (every policy, oracle and engine alike). Each forward -- the whole prompt at once
(prefill), or one new token (decode) -- runs in three parts, per layer:

1. the step's queries attend causally over the entries the cache kept plus the step's own
   new keys (a decode query sees at most ``budget + 1`` keys: the kept ones and itself;
   prefill is never cut short: every prompt query sees every earlier prompt token);
2. the policy scores every candidate (kept + new) from this step's attention weights;
3. if there are more than ``budget`` candidates, the first ``budget`` in `order` stay, the
   rest are evicted for good. The first eviction of a prompt longer than the budget thus
   happens right after prefill, scored from the prefill's own attention.

`order` is the single ranking rule: protected entries first, then the others by higher score,
then lower position (deterministic ties); empty slots (position -1) last. Entries keep their original
positions (keys are cached after RoPE and never re-rotated).

Policies (``Strategy.of(kind, **params)``):

- ``last_recent(budget)``: keep the ``budget`` most recent positions. Per layer (every head
  keeps the same set).
- ``streaming_llm(sinks, recent)``: StreamingLLM (Xiao et al. 2023, "Efficient Streaming
  Language Models with Attention Sinks", arXiv:2309.17453): keep positions ``< sinks`` and the
  ``recent`` most recent. Per layer. budget = sinks + recent. This is
  ``StartRecentKVCache.__call__`` of mit-han-lab/streaming-llm (evict after the forward); its
  ``evict_for_space`` (evict before the forward) shows one key fewer to a decode query. Unlike
  the paper we keep original positions (no re-numbering of positions inside the cache).
- ``h2o(heavy, recent)``: H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle", arXiv:2306.14048;
  ``H2OKVCache_LayerWise`` of FMInference/H2O, h2o_hf/utils_real_drop). Per KV head. Score of
  an entry = the sum of the softmax attention weights it received, over every query since it
  entered the cache (prefill queries included) and over the query heads sharing its KV head
  (GQA: summed over the group). Protected: the ``recent`` most recent positions (the step's
  newest position p and p-1, ..., p-recent+1). The other ``heavy`` slots go to the highest scores.
  budget = heavy + recent.
- ``tova(budget)``: TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs",
  arXiv:2401.06104; ``TOVACache.reduce`` of schwartz-lab-NLP/TOVA). Per layer. Score = the
  attention weights of the step's LAST query only, averaged over all query heads of the layer;
  nothing is protected (the new token itself can be evicted). After prefill: the top ``budget``
  by the last prompt token's attention; in decode: evict the lowest.

Prefill-only policies (``*_prefill``; the presses of NVIDIA kvpress 0.5.5, ``ScorerPress.compress``)
compress ONCE, right after the prefill, then keep everything generated (no budget in decode).
The prefill step is the one above (full causal attention over the prompt, then evict), with a
budget derived from the prompt length n: ``n_kept = max(1, int(n * (1 - compression_ratio)))``
(Python float arithmetic, integer truncation: kvpress's ``compute_n_kept``; ``compression_ratio``
in [0, 1); 0 keeps everything). Decode queries see the kept prompt entries and every generated
token. Keys keep their positions (no re-rotation; decode continues at position n). kvpress
stores the kept entries in ``topk`` order; attention does not depend on the order, so we
compare sets. Where kvpress ranks several entries equal at the cut, ``topk`` picks among them in
an unspecified order; we take the lower positions (`order`).

- ``streaming_llm_prefill(compression_ratio, n_sink)``: ``StreamingLLMPress``. Per layer.
  Protected: positions ``< n_sink``; the others by recency. So n_kept >= n_sink keeps the first
  n_sink and the last n_kept - n_sink positions; n_kept < n_sink keeps positions < n_kept
  (kvpress: n_kept of its n_sink tied sinks). kvpress asserts n > n_sink.
- ``snapkv_prefill(compression_ratio, window_size, kernel_size)``: ``SnapKVPress`` (Li et al. 2024,
  arXiv:2404.14469). Per KV head. Protected: the observation window, the last ``window_size``
  positions. Score of a position p < n - window_size: the softmax weights (over all n keys,
  causal, not renormalised) the window's queries give it, averaged over those queries, then
  ``avg_pool1d(kernel_size, stride 1, zero padding kernel_size // 2 counted in the mean)`` along
  positions 0..n-window_size-1, then averaged over the query heads of the KV head's group.
  ``kernel_size`` must be odd (kvpress fails on even ones). kvpress asserts n > window_size.
- ``tova_prefill(compression_ratio)``: ``TOVAPress``. Per layer. Score = the last prompt token's
  attention weights averaged over all query heads (as ``tova``), but the last position is
  protected (kvpress pads its score with the maximum + 1; ``tova`` lets it compete). kvpress
  fails on a 1-token prompt.
- ``knorm_prefill(compression_ratio)``: ``KnormPress`` (Devoto et al. 2024, arXiv:2406.11430).
  Per KV head. Score = minus the L2 norm of the cached key (after RoPE, a rotation: the norm is
  that of the projected key), in at least float32: the LOWEST norms stay. Nothing is protected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pytest_kvcompile.engine import ModelNotSupported, ModelSpec, Strategy
from pytest_kvcompile.oracle import Reference

EMPTY = -1  # position of an empty cache slot


def order(pos: torch.Tensor, score: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Candidate indices [..., n], best first: protected entries (by position), then the others by
    higher score, then lower position; empty slots (pos < 0) last. Deterministic: stable sorts, no reliance on topk's tie order."""
    key = torch.where(protected, torch.inf, score.float()).masked_fill(pos < 0, -torch.inf)
    by_pos = pos.argsort(dim=-1, stable=True)
    ranked = key.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True)
    return by_pos.gather(-1, ranked)


@dataclass(frozen=True)
class Policy:
    """One eviction rule. Tensors: `pos` [b, kv_heads, n] (-1 = empty), `newest` [b, 1, 1] the
    step's newest position, `weights` [b, kv_heads, group, queries, n] this step's softmax weights
    (zero on masked keys and padding queries), `prev` [b, kv_heads, n] the carried scores (0 for new),
    `keys` [b, kv_heads, n, head_dim] the candidates' keys (after RoPE; given by the oracle only)."""

    kind: ClassVar[str]
    budget: ClassVar[int]  # a field (last_recent, tova) or a property (streaming_llm, h2o); none for *_prefill
    prefill_only: ClassVar[bool] = False  # True: evict once, after prefill, to n_kept(prompt length)

    @property
    def strategy(self) -> Strategy:
        return Strategy.of(self.kind, **dataclasses.asdict(self))

    def protected(self, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(pos, dtype=torch.bool)

    def score(self, prev: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, keys=None) -> torch.Tensor:
        return pos.float()  # recency

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if name == "compression_ratio":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                    raise ValueError(f"{self.kind}: compression_ratio={value!r} must be a number in [0, 1)")
                continue
            least = 0 if name in ("sinks", "n_sink") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{self.kind}: {name}={value!r} must be an int >= {least}")


@dataclass(frozen=True)
class LastRecent(Policy):
    kind: ClassVar[str] = "last_recent"
    budget: int


@dataclass(frozen=True)
class StreamingLLM(Policy):
    kind: ClassVar[str] = "streaming_llm"
    sinks: int
    recent: int

    @property
    def budget(self) -> int:
        return self.sinks + self.recent

    def protected(self, pos, newest):
        return (pos >= 0) & (pos < self.sinks)


@dataclass(frozen=True)
class H2O(Policy):
    kind: ClassVar[str] = "h2o"
    heavy: int
    recent: int

    @property
    def budget(self) -> int:
        return self.heavy + self.recent

    def protected(self, pos, newest):
        return pos > newest - self.recent

    def score(self, prev, weights, pos, keys=None):
        return prev + weights.sum(dim=(2, 3))


@dataclass(frozen=True)
class TOVA(Policy):
    kind: ClassVar[str] = "tova"
    budget: int

    def score(self, prev, weights, pos, keys=None):
        return weights[:, :, :, -1].mean(dim=(1, 2))[:, None].expand_as(prev)


@dataclass(frozen=True)
class PrefillPolicy(Policy):
    """Evicts once, after prefill, to `n_kept(n)` entries of an n-token prompt; keeps every generated one."""

    prefill_only: ClassVar[bool] = True
    compression_ratio: float

    def n_kept(self, n: int) -> int:
        """kvpress's ``compute_n_kept``: max(1, int(n * (1 - compression_ratio))), Python floats."""
        return max(1, int(n * (1 - self.compression_ratio)))


@dataclass(frozen=True)
class StreamingLLMPrefill(PrefillPolicy):
    kind: ClassVar[str] = "streaming_llm_prefill"
    n_sink: int

    def protected(self, pos, newest):
        return (pos >= 0) & (pos < self.n_sink)


@dataclass(frozen=True)
class SnapKVPrefill(PrefillPolicy):
    kind: ClassVar[str] = "snapkv_prefill"
    window_size: int
    kernel_size: int

    def __post_init__(self):
        super().__post_init__()
        if self.kernel_size % 2 == 0:
            raise ValueError(f"{self.kind}: kernel_size={self.kernel_size} must be odd (kvpress pools to n + 1 scores)")

    def protected(self, pos, newest):
        return pos > newest - self.window_size

    def score(self, prev, weights, pos, keys=None):
        """weights: the prefill's [b, kv_heads, group, n, n]; the window's entries score 0 (protected)."""
        b, kv_heads, group, _, n = weights.shape
        scored = max(n - self.window_size, 0)
        if scored == 0:
            return weights.new_zeros(b, kv_heads, n)
        seen = weights[..., -self.window_size:, :scored].mean(dim=3)  # [b, kv_heads, group, scored]
        pooled = F.avg_pool1d(seen.reshape(-1, 1, scored), self.kernel_size, stride=1, padding=self.kernel_size // 2)
        return F.pad(pooled.view(b, kv_heads, group, scored).mean(dim=2), (0, n - scored))


@dataclass(frozen=True)
class TOVAPrefill(PrefillPolicy):
    kind: ClassVar[str] = "tova_prefill"

    def protected(self, pos, newest):
        return pos == newest

    def score(self, prev, weights, pos, keys=None):
        return TOVA.score(self, prev, weights, pos)


@dataclass(frozen=True)
class KNormPrefill(PrefillPolicy):
    kind: ClassVar[str] = "knorm_prefill"

    def score(self, prev, weights, pos, keys=None):
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))


POLICIES: dict[str, type[Policy]] = {p.kind: p for p in (
    LastRecent, StreamingLLM, H2O, TOVA, StreamingLLMPrefill, SnapKVPrefill, TOVAPrefill, KNormPrefill)}


def policy_for(strategy: Strategy) -> Policy:
    """The policy a strategy declares, e.g. ``Strategy.of("h2o", heavy=8, recent=8)``."""
    if strategy.kind not in POLICIES:
        raise ValueError(f"unknown eviction strategy '{strategy.kind}'; known: {', '.join(POLICIES)}")
    cls, params = POLICIES[strategy.kind], dict(strategy.params)
    names = [f.name for f in dataclasses.fields(cls)]
    if sorted(params) != sorted(names):
        raise ValueError(f"strategy '{strategy}' needs exactly the parameters {', '.join(names)}: write "
                         f"Strategy.of('{strategy.kind}', {', '.join(f'{n}=...' for n in names)})")
    return cls(**params)


def keep(policy: Policy, pos, score, newest, budget: int | None = None) -> torch.Tensor:
    """Indices of the candidates that stay: the first `budget` (default: the policy's) in `order`
    (all of them if fewer)."""
    return order(pos, score, policy.protected(pos, newest))[..., : policy.budget if budget is None else budget]


# --------------------------------------------------------------------------- the oracle


class _Masks:
    """Per-layer state of one oracle generation: which positions each KV head still sees, and scores."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.alive: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, n] bool
        self.scores: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, query, key, value, scaling: float):
        """Explicit attention over every key ever seen, evicted ones masked; then evict.

        query [1, heads, t, d]; key, value [1, kv_heads, n, d]: the whole sequence so far.
        """
        _, heads, t, d = query.shape
        kv_heads, n = key.shape[1], key.shape[2]
        new = torch.ones(1, kv_heads, t, dtype=torch.bool, device=key.device)
        alive = torch.cat((self.alive.get(layer, new[..., :0]), new), dim=-1)
        pos = torch.arange(n, device=key.device)
        causal = pos[None, :] <= pos[n - t:, None]  # [t, n]: query at n - t + i sees keys <= itself
        q = query.view(1, kv_heads, heads // kv_heads, t, d)
        logits = (q @ key[:, :, None].transpose(-1, -2)) * scaling  # [1, kv_heads, group, t, n]
        logits = logits.masked_fill(~(alive[:, :, None, None, :] & causal), -torch.inf)
        weights = logits.softmax(dim=-1, dtype=torch.float32)
        out = weights.to(value.dtype) @ value[:, :, None]  # [1, kv_heads, group, t, d]

        result = out.reshape(1, heads, t, d).transpose(1, 2), None
        if self.policy.prefill_only and layer in self.alive:  # decode after a one-time compression: keep all
            self.alive[layer] = alive
            return result
        prev = torch.cat((self.scores.get(layer, weights.new_zeros(1, kv_heads, 0)),
                          weights.new_zeros(1, kv_heads, t)), dim=-1)
        score = self.policy.score(prev, weights, pos.expand(1, kv_heads, n), keys=key)
        budget = self.policy.n_kept(n) if self.policy.prefill_only else self.policy.budget
        kept = keep(self.policy, torch.where(alive, pos, EMPTY), score, torch.tensor(n - 1), budget)
        self.alive[layer] = torch.zeros_like(alive).scatter(-1, kept, True) & alive
        self.scores[layer] = score
        return result


ATTENTION_NAME = "kvcompile_eviction_oracle"


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, eviction=None, **kwargs):
    """transformers attention function: delegates to the generation's `_Masks` (ignores the mask:
    one unpadded prompt, causal by construction)."""
    return eviction.attend(module.layer_idx, query, key, value, scaling)


class EvictionOracle:
    """transformers' eager Llama keeping EVERY key, with evicted ones masked per layer and KV head.

    Attention weights are computed explicitly (no SDPA) and the policy decides evictions with the
    same rule as any engine (`keep`). One prompt at a time, greedy, raw-logit argmax.
    """

    def __init__(self, spec: ModelSpec, strategy: Strategy):
        from transformers import AttentionInterface, AutoModelForCausalLM

        if spec.config.model_type != "llama":
            raise ModelNotSupported(f"the eviction oracle implements Llama only, not '{spec.config.model_type}'")
        self.spec, self.policy = spec, policy_for(strategy)
        once = " (once, after prefill)" if self.policy.prefill_only else ""
        self.source = f"transformers eager Llama, all keys kept, evicted ones masked by {self.policy.strategy}{once}"
        AttentionInterface.register(ATTENTION_NAME, _attention)
        self.model = AutoModelForCausalLM.from_pretrained(
            spec.path, dtype=spec.dtype, attn_implementation=ATTENTION_NAME).to(spec.device).eval()
        self._memo: dict[tuple[tuple[int, ...], int], tuple[Reference, _Masks]] = {}

    def __repr__(self) -> str:
        return f"<oracle: {self.source}, model '{self.spec.name}'>"

    def reference(self, prompt, max_new_tokens: int) -> Reference:
        return self.run(prompt, max_new_tokens)[0]

    def kept(self, prompt, max_new_tokens: int) -> list[torch.Tensor]:
        """Per layer: the positions each KV head still holds after the run, [kv_heads, budget or fewer], sorted
        (for a prefill-only policy: n_kept + steps - 1)."""
        masks = self.run(prompt, max_new_tokens)[1]
        return [torch.stack([a.nonzero()[:, 0] for a in alive[0]]) for _, alive in sorted(masks.alive.items())]

    @torch.inference_mode()
    def run(self, prompt, steps: int) -> tuple[Reference, _Masks]:
        from transformers import DynamicCache

        key = (tuple(prompt), steps)
        if key not in self._memo:
            masks, cache = _Masks(self.policy), DynamicCache(config=self.model.config)
            inputs = torch.tensor([key[0]], device=self.spec.device)
            tokens, rows = [], []
            for _ in range(steps):
                logits = self.model(input_ids=inputs, past_key_values=cache, use_cache=True, eviction=masks).logits[0, -1]
                rows.append(logits.float().cpu())
                tokens.append(int(logits.argmax()))
                inputs = torch.tensor([[tokens[-1]]], device=self.spec.device)
            self._memo[key] = Reference(key[0], tuple(tokens), torch.stack(rows), self.source), masks
        return self._memo[key]
