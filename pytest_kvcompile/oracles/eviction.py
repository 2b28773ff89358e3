"""The checker's definition of correct eviction: the policies' exact rules, and the masking oracle that applies them.

The reference eviction engines (reference_impls/eviction_engine.py) and the oracle both rank by `order` and
score with the `Policy` classes here: one rule, written once, on the checker's side.

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
then lower position (deterministic ties); empty slots (position -1) last.

Positions. Entries keep their original positions (keys are cached after RoPE and never re-rotated),
except under ``streaming_llm(..., positions="shifted")`` (and ``streaming_llm_prefill(..., positions="shifted")``,
kvpress's KeyRerotationPress), StreamingLLM's pos-shift: arXiv:2309.17453
section 3.2, "StreamingLLM focuses on positions within the cache rather than those in the original text"
(cache [0, 1, 2, 3, 6, 7, 8] decoding token 9 uses positions 0..7); mit-han-lab/streaming-llm
``enable_streaming_llm`` -> ``pos_shift/modify_llama.py`` ``llama_pos_shift_attention_forward`` caches keys
before RoPE and rotates them at every forward by ``key_position_ids = arange(kv_seq_len)``, their index in the
cache, and the query by ``position_ids`` = the cache length, its own index. So at each step every candidate key
is rotated to its rank among the step's candidates (by original position), and each query to its own key's
rank. Needs rotary position embeddings (GPT-2's learned absolute ones cannot be re-assigned per key:
ModelNotSupported).

Models (the oracle). The eviction mask is applied ON TOP OF the model's own attention mask (causal, plus
the sliding window of sliding layers: the ``attention_mask`` transformers builds and passes to the attention
function), with the model's own ``scaling`` and ``softcap`` as it passes them: a policy only ever removes keys
the model would have attended. A KV-sharing layer (Gemma3n/Gemma4 ``num_kv_shared_layers``; source = the
last earlier non-shared layer of the same layer type, transformers' ``kv_sharing`` "store"/"reuse", see
`kv_sources`) has no cache of its own: at each step it sees exactly the candidates its
source layer's queries see (the source's kept entries + the step's new ones; the source's eviction at this
step applies from the next step on, for both) and it neither scores nor evicts.
Learned attention sinks (GPT-OSS's ``s_aux``) join each head's softmax as one more logit and attend to nothing; the
policies score the keys' weights (the sink's share is no position). Multi-head latent attention (DeepSeek-V3) is seen
as transformers passes it, per-head keys up-projected from the latent: values of ``v_head_dim``; its shared RoPE key
is the keys' last ``qk_rope_head_dim`` dims, partial rotary's (Phi-3) the first ones: pos-shift rotates those only.

Policies (``Strategy.of(kind, **params)``):

- ``last_recent(budget)``: keep the ``budget`` most recent positions. Per layer (every head
  keeps the same set).
- ``streaming_llm(sinks, recent)``: StreamingLLM (Xiao et al. 2023, "Efficient Streaming
  Language Models with Attention Sinks", arXiv:2309.17453): keep positions ``< sinks`` and the
  ``recent`` most recent. Per layer. budget = sinks + recent. This is
  ``StartRecentKVCache.__call__`` of mit-han-lab/streaming-llm (evict after the forward); its
  ``evict_for_space`` (evict before the forward) shows one key fewer to a decode query.
  ``positions``: ``"original"`` (default, may be omitted) or ``"shifted"`` (the paper's pos-shift, above).
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
token. Keys keep their positions (no re-rotation; decode continues at position n; but see
``streaming_llm_prefill``'s ``positions``). kvpress
stores the kept entries in ``topk`` order; attention does not depend on the order, so we
compare sets. Where kvpress ranks several entries equal at the cut, ``topk`` picks among them in
an unspecified order; we take the lower positions (`order`).

- ``streaming_llm_prefill(compression_ratio, n_sink)``: ``StreamingLLMPress``. Per layer.
  Protected: positions ``< n_sink``; the others by recency. So n_kept >= n_sink keeps the first
  n_sink and the last n_kept - n_sink positions; n_kept < n_sink keeps positions < n_kept
  (kvpress: n_kept of its n_sink tied sinks). kvpress asserts n > n_sink.
  ``positions``: ``"original"`` (default) or ``"shifted"``: kvpress's ``KeyRerotationPress`` around the
  press, whose kept keys are re-rotated to their rank 0..n_kept-1 among the kept ones and whose pipeline
  (``KVPressTextGenerationPipeline``: ``context_length = cache.get_seq_length()`` for a KeyRerotationPress)
  then decodes at positions n_kept, n_kept + 1, ...: exactly pos-shift's rank rule (module docstring,
  "Positions") applied to the candidates left after the one compression. Re-rotation is a pure rotation by
  rank - p (``_shift``): a RoPE variant's attention factor (YaRN's mscale) stays as the model's RoPE put it
  (kvpress <= 0.2.6 un-rotated with the scaled (cos, -sin) and was off by factor^2: kvpress PR #85).
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

Near ties (score-based policies: h2o, tova, snapkv_prefill, tova_prefill, knorm_prefill; position rules are
exact). A correct engine in bfloat16, or with fused kernels, computes slightly different scores and may take
the other side of a close cut, then legitimately generate other tokens. Rule: any kept and any evicted candidate
(neither protected nor empty) whose scores are within the eviction tie tolerance of each other RELATIVE to the
larger, ``|s_kept - s_evicted| <= tol * max(|s_kept|, |s_evicted|)``, may swap (per KV head, or per layer for
per-layer policies): several candidates often sit within it of the cut (attention near uniform), so the swap is not
only the last kept with the first evicted. The greedy `reference` takes the rule's own side; `teacher_forced`
follows the swaps (`EvictionOracle.teacher_forced_run`), cheapest first.
The tolerance: float32 ``EVICTION_TIE_TOLERANCE`` (1e-4: a float32 computation's score differences are ~5e-6 from
float64 at the cuts, measured below); bfloat16 and float16 are measured per model and policy at run time
(`eviction_noise.py`: a 16-bit computation vs the float64 truth at the truth's cuts, NOISE_FACTOR x the p99 relative
error; docs/precision.md). Zoo Llama, CPU: TOVA bfloat16 0.213, float16 0.040; H2O bfloat16 0.040, float16 0.0062
(H2O sums a token's weights over steps: steadier than TOVA's one row); float32 both ~5e-6 before the floor.
Relative, not absolute: the two policies' score scales differ 50-fold, their relative errors 4-fold.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec, Strategy
from pytest_kvcompile.models.checkpoints import with_cache
from pytest_kvcompile.models.layers import LatentLayer, StateLayer, layer_caches
from pytest_kvcompile.models.zoo import shared_kv_layers, sliding_layers
from pytest_kvcompile.oracles.policies import (  # noqa: F401 (the policies, re-exported: one rule's module)
    EMPTY,
    H2O,
    POLICIES,
    TOVA,
    KNormPrefill,
    LastRecent,
    Policy,
    PrefillPolicy,
    SnapKVPrefill,
    StreamingLLM,
    StreamingLLMPrefill,
    TOVAPrefill,
    keep,
    order,
    policy_for,
)
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.oracles.truth import Widened, load_lm

# --------------------------------------------------------------------------- the oracle


def _swaps(ties, layer: int, ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, int] | None:
    """(cost, entries swapped) of keeping `theirs` instead of `ours` at `layer` ([1, kv_heads, n] kept sets): each
    entry one keeps and the other evicts must be a side of one of this step's near-tied swaps on that head (`ties`:
    `_Masks._near_ties`), costing the cheapest such swap; None where one is not (a difference beyond the noise)."""
    cost, count = 0.0, 0
    for head in range(ours.size(1)):
        near = [t for t in ties if t[0] == layer and head in t[1]]
        sides = {}
        for _, _, kept, evicted, c in near:
            sides[kept], sides[evicted] = min(c, sides.get(kept, c)), min(c, sides.get(evicted, c))
        changed = (ours[0, head] ^ theirs[0, head]).nonzero()[:, 0].tolist()
        if any(p not in sides for p in changed):
            return None
        cost, count = cost + sum(sides[p] for p in changed) / 2, count + len(changed) // 2
    return cost, count


def kv_sources(config) -> dict[int, int]:
    """KV-sharing layer -> the layer whose K/V it reads: the last earlier non-shared layer of its layer type
    (Gemma3n/Gemma4 ``num_kv_shared_layers``, `zoo.shared_kv_layers`); empty without KV sharing."""
    shared, sliding = shared_kv_layers(config), set(sliding_layers(config))
    first = min(shared, default=config.num_hidden_layers)
    return {i: max(j for j in range(first) if (j in sliding) == (i in sliding)) for i in shared}


#: Near-tie tolerance on policy scores in float32 (and float64), relative to the larger score (module docstring,
#: "Near ties"); 16-bit runs measure theirs (`calibrate_scores`, set by the run's StoredOracle).
EVICTION_TIE_TOLERANCE = {"float32": 1e-4}
MAX_STATES = 64  # live alternatives `teacher_forced` follows at most
FLIPS_PER_STEP = 3  # near-tied swaps one alternative may take in one step (`_Branch.forks`)


class _Masks:
    """Per-layer state of one oracle generation: which positions each KV head still sees, and scores.

    `sources`: KV-sharing layer -> the layer whose keys it reads; `rope`: layer -> the model's RoPE inverse
    frequencies and whether they rotate its keys' last dims (MLA), given for ``positions="shifted"`` only;
    `tolerance`: record this step's near-tied cuts in `ties` (None: record none)."""

    def __init__(self, policy: Policy, sources=None, rope=None, tolerance: float | None = None):
        self.policy, self.sources, self.rope, self.tolerance = policy, sources or {}, rope, tolerance
        self.alive: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, n] bool, after the step's eviction
        self.scores: dict[int, torch.Tensor] = {}
        self.seen: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, n] bool: the candidates of this step
        self.ties: list[tuple[int, tuple[int, ...], int, int, float]] = []  # (layer, kv heads, kept, evicted, cost)

    def fork(self, flips=()) -> _Masks:
        """A copy taking the other side at each tie of `flips` (entries of `ties`)."""
        new = copy.copy(self)
        new.alive, new.scores, new.seen, new.ties = dict(self.alive), dict(self.scores), dict(self.seen), []
        for layer, heads, kept, evicted, _ in flips:
            alive = new.alive[layer] = new.alive[layer].clone()
            alive[0, list(heads), kept], alive[0, list(heads), evicted] = False, True
        return new

    def attend(self, layer: int, query, key, value, scaling: float, mask=None, softcap=None, sinks=None):
        """Explicit attention over every key ever seen, evicted ones masked on top of the model's `mask`; then evict.

        query [1, heads, t, d]; key, value [1, kv_heads, n, d]: the whole sequence so far; mask [1, 1, t, n]
        (bool, or additive float: 0 = visible), None: causal. `sinks` [heads]: learned attention sinks (GPT-OSS),
        one more logit per head in the softmax's denominator that attends to nothing; the policies score the keys'
        weights, the sink's share dropped (no position to keep or evict).
        """
        _, heads, t, d = query.shape
        kv_heads, n = key.shape[1], key.shape[2]
        source = self.sources.get(layer)
        if source is None:
            new = torch.ones(1, kv_heads, t, dtype=torch.bool, device=key.device)
            alive = self.seen[layer] = torch.cat((self.alive.get(layer, new[..., :0]), new), dim=-1)
        else:  # KV sharing: the candidates its source layer attends over in this step
            alive = self.seen[source]
        pos = torch.arange(n, device=key.device)
        if mask is None:
            mask = pos[None, :] <= pos[n - t:, None]  # [t, n]: query at n - t + i sees keys <= itself
        elif mask.dtype != torch.bool:
            mask = mask == 0
        q, k = query.view(1, kv_heads, heads // kv_heads, t, d), key[:, :, None]
        if self.rope is not None:
            q, k = _shift(q, k, alive, *self.rope[layer])
        logits = (q @ k.transpose(-1, -2)) * scaling  # [1, kv_heads, group, t, n]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~(alive[:, :, None, None, :] & mask), -torch.inf)
        wide = torch.promote_types(query.dtype, torch.float32)
        if sinks is None:
            weights = logits.softmax(dim=-1, dtype=wide)
        else:
            sink = sinks.to(logits.dtype).view(1, kv_heads, heads // kv_heads, 1, 1).expand(*logits.shape[:-1], 1)
            weights = torch.cat((logits, sink), dim=-1).softmax(dim=-1, dtype=wide)[..., :-1]
        out = weights.to(value.dtype) @ value[:, :, None]  # [1, kv_heads, group, t, d]

        result = out.reshape(1, heads, t, value.size(-1)).transpose(1, 2), None  # MLA: v_head_dim != d
        if source is not None:  # no cache of its own: nothing to score or evict
            return result
        if self.policy.prefill_only and layer in self.alive:  # decode after a one-time compression: keep all
            self.alive[layer] = alive
            return result
        prev = torch.cat((self.scores.get(layer, weights.new_zeros(1, kv_heads, 0)),
                          weights.new_zeros(1, kv_heads, t)), dim=-1)
        score = self.policy.score(prev, weights, pos.expand(1, kv_heads, n), keys=key)
        budget = self.policy.n_kept(n) if self.policy.prefill_only else self.policy.budget
        cand = torch.where(alive, pos, EMPTY)
        protected = self.policy.protected(cand, torch.tensor(n - 1))
        ranked = order(cand, score, protected)
        self.alive[layer] = torch.zeros_like(alive).scatter(-1, ranked[..., :budget], True) & alive
        self.scores[layer] = score
        if self.tolerance is not None and self.policy.scored and n > budget:
            self._near_ties(layer, cand, score, protected, ranked, budget)
        return result

    def _near_ties(self, layer, cand, score, protected, ranked, budget):
        """Record the near-tied swaps of this cut: every kept and evicted candidate (neither protected nor empty) whose
        scores are within `tolerance` of each other relative to the larger, with the swap's cost (its margin in units
        of `tolerance`, 0 = exact tie); per KV head, or once per layer for a per-layer policy."""
        usable = (cand[0] >= 0) & ~protected[0].expand_as(cand[0])  # [kv_heads, n]
        kept = torch.zeros_like(usable).scatter(-1, ranked[0, :, :budget], True)
        s = score[0].double()
        for head in range(cand.size(1)) if self.policy.per_head else (0,):
            heads = (head,) if self.policy.per_head else tuple(range(cand.size(1)))
            a, b = (usable[head] & kept[head]).nonzero()[:, 0], (usable[head] & ~kept[head]).nonzero()[:, 0]
            s_a, s_b = s[head, a][:, None], s[head, b][None, :]
            margin = (s_a - s_b) / torch.maximum(s_a.abs(), s_b.abs()).clamp(min=1e-300)
            for i, j in (margin <= self.tolerance).nonzero().tolist():
                cost = max(float(margin[i, j]), 0.0) / self.tolerance if self.tolerance else 0.0
                self.ties.append((layer, heads, int(a[i]), int(b[j]), cost))


def _rotate(x, angle, last: bool = False):
    """x rotated by `angle` [..., r / 2] (radians, fp32) the way the model's RoPE rotates (rotate_half layout) on its
    r rotary dims: the first r (partial rotary, Phi-3), or the last r (`last`: MLA's shared RoPE key, DeepSeek-V3,
    whose interleaved weights transformers has de-interleaved to rotate_half before the attention sees them); the
    other dims pass through."""
    r = 2 * angle.size(-1)
    if r < x.size(-1):
        rot, rest = (x[..., -r:], x[..., :-r]) if last else (x[..., :r], x[..., r:])
        rot = _rotate(rot, angle)
        return torch.cat((rest, rot) if last else (rot, rest), dim=-1)
    emb = torch.cat((angle, angle), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


def _shift(q, k, alive, inv_freq, last: bool = False):
    """pos-shift: keys (after the model's RoPE at their original position p) rotated further by rank - p, so they
    sit at their rank among the step's candidates `alive`; each query at its own key's rank.
    q [1, kv_heads, group, t, d], k [1, kv_heads, 1, n, d], alive [1, kv_heads, n]; `last`: `_rotate`'s."""
    n, t = alive.size(-1), q.size(-2)
    delta = (alive.long().cumsum(-1) - 1 - torch.arange(n, device=alive.device)).float()  # rank - position
    wide = torch.promote_types(inv_freq.dtype, q.dtype)  # a widened truth's stored buffer: its float64 value
    angle = delta[..., None].to(wide) * inv_freq.to(alive.device, wide)  # [1, kv_heads, n, r / 2]
    return _rotate(q, angle[:, :, None, n - t:], last), _rotate(k, angle[:, :, None], last)


ATTENTION_NAME = "kvcompile_eviction_oracle"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, eviction=None, softcap=None,
               **kwargs):
    """transformers attention function: delegates to the generation's `_Masks`, with the model's own mask,
    scaling (default 1/sqrt(head_dim), as transformers' eager functions), softcapping and sinks (`s_aux`, GPT-OSS)."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    sinks = kwargs.get("s_aux")
    return eviction.attend(module.layer_idx, query, key, value, scaling, attention_mask, softcap, sinks)


def _mask(*args, **kwargs):
    """The model's own attention mask, always as a bool [b, 1, t, n] (transformers' `sdpa_mask`, no causal skip)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


@dataclass
class _Branch:
    """One generation in progress: its cache (every key), masks, and its cost so far: the noise events it needs to
    explain the given tokens, each in units of its tolerance (a logit gap / the tie tolerance, a swap's score
    margin / the eviction tie tolerance), so the most plausible alternatives are the ones kept."""

    cache: object
    masks: _Masks
    cost: float = 0.0
    flips: int = 0  # non-default choices taken so far
    #: (the policy computed in the run's dtype, its own branch): this branch takes that one's kept sets where they
    #: differ from its own by near-tied swaps only (`EvictionOracle.guided_by`); it never forks
    guide: tuple[EvictionOracle, _Branch] | None = None

    def forks(self, most: int) -> list[_Branch]:
        """Itself, then copies taking the other side of this step's near-tied swaps, cheapest first (up to
        `FLIPS_PER_STEP` swaps at once, no candidate swapped twice), `most` in all."""
        if self.guide is not None:
            return [self]
        ties = sorted(self.masks.ties, key=lambda t: t[4])
        subsets = []
        for r in range(1, FLIPS_PER_STEP + 1):  # r swaps at once among the cheapest most, 12, 6 (r = 1, 2, 3)
            for c in itertools.combinations(ties[: most if r == 1 else 24 // 2 ** (r - 1)], r):
                touched = [(layer, h, p) for layer, heads, a, b, _ in c for h in heads for p in (a, b)]
                if len(touched) == len(set(touched)):
                    subsets.append((sum(t[4] for t in c), r, c))
        subsets.sort(key=lambda x: x[:2])
        return [self] + [_Branch(copy.deepcopy(self.cache), self.masks.fork(c), self.cost + cost, self.flips + r)
                         for cost, r, c in subsets[: most - 1]]


@dataclass(frozen=True)
class Forced:
    """A `teacher_forced` run: the logits [steps, vocab] (fp32, CPU), the most alternatives alive at once,
    whether the cap (`MAX_STATES`) dropped some, and the step at which every alternative was pruned (None: never)."""

    logits: torch.Tensor
    states: int
    capped: bool
    pruned_at: int | None
    alternatives: tuple[torch.Tensor, ...] = ()  # per step, every live alternative's row [alternatives, vocab]


class EvictionOracle:
    """transformers' eager model keeping EVERY key, with evicted ones masked per layer and KV head.

    Any model whose attention goes through transformers' AttentionInterface (Llama, Mistral, Gemma3, Gemma4 text
    with KV sharing, GPT-2, ...). Attention weights are computed explicitly (no SDPA) and the policy decides
    evictions with the same rule as any engine (`order`). One prompt at a time, greedy, raw-logit argmax.
    `eviction_tie_tolerance` (float32's EVICTION_TIE_TOLERANCE; None: no forks) drives `teacher_forced`; an oracle
    checking 16-bit tokens (the float64 truth of a bfloat16 run) gets that dtype's measured value (`calibrate_scores`).
    """

    def __init__(self, spec: ModelSpec, strategy: Strategy):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.spec, self.policy = spec, policy_for(strategy)
        states = [c.layer for c in layer_caches(spec.config) if isinstance(c, StateLayer)]
        if states:
            raise ModelNotSupported(
                f"{strategy} evicts attention keys, and model '{spec.name}' has recurrent layers "
                f"({', '.join(map(str, states))}) whose state already holds every past token: no cache of it can "
                "drop one, so there is no eviction to compare with (docs/state-caches.md)")
        AttentionInterface.register(ATTENTION_NAME, _attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        self.model = load_lm(spec, widened=True, attn_implementation=ATTENTION_NAME)
        model = self.model.model if isinstance(self.model, Widened) else self.model
        arch = type(model).__name__.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
        config = self.model.config
        self.sources = kv_sources(config)  # KV-sharing layer -> its source (Gemma3n/Gemma4; none elsewhere)
        self.rope = None
        if getattr(self.policy, "positions", "original") == "shifted":
            rotary = next((m for name, m in self.model.named_modules() if name.endswith("rotary_emb")), None)
            if rotary is None:
                raise ModelNotSupported(f"positions='shifted' re-rotates keys: {arch} has no rotary embedding")
            types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
            latent = {c.layer for c in layer_caches(config) if isinstance(c, LatentLayer)}  # RoPE on the last dims
            self.rope = {i: (getattr(rotary, f"{kind}_inv_freq") if hasattr(rotary, f"{kind}_inv_freq")
                             else rotary.inv_freq, i in latent) for i, kind in enumerate(types)}  # per type (Gemma)
        once = " (once, after prefill)" if self.policy.prefill_only else ""
        self.source = f"transformers eager {arch}, all keys kept, evicted ones masked by {self.policy.strategy}{once}"
        factor = float(getattr(rotary, "attention_scaling", 1.0)) if self.rope is not None else 1.0
        if factor != 1.0:  # YaRN & co.: re-rotating through the scaled cos/sin, not a pure rotation, is off by factor^2
            kind = getattr(rotary, "rope_type", "scaled")
            self.source += (f"; keys re-rotated to their rank by a pure rotation, keeping {kind} RoPE's attention "
                            f"factor {factor:.4f} once (a re-rotation through the scaled cos/sin gives "
                            f"{factor ** 2:.4f}x keys)")
        self.eviction_tie_tolerance = EVICTION_TIE_TOLERANCE["float32"]
        self._guide: Callable[[], EvictionOracle] | None = None  # `guided_by`
        self._memo: dict[tuple[tuple[int, ...], int], tuple[Reference, _Masks]] = {}
        self._forced: dict[tuple, Forced] = {}

    def __repr__(self) -> str:
        return f"<oracle: {self.source}, model '{self.spec.name}'>"

    def reference(self, prompt, max_new_tokens: int) -> Reference:
        return self.run(prompt, max_new_tokens)[0]

    def kept(self, prompt, max_new_tokens: int) -> list[torch.Tensor]:
        """Per layer with a cache of its own (KV-sharing layers have none): the positions each KV head still holds
        after the run, [kv_heads, budget or fewer], sorted (for a prefill-only policy: n_kept + steps - 1)."""
        masks = self.run(prompt, max_new_tokens)[1]
        return [torch.stack([a.nonzero()[:, 0] for a in alive[0]]) for _, alive in sorted(masks.alive.items())]

    def evicted(self, prompt, max_new_tokens: int) -> int:
        """How many entries the greedy run evicted in all, over layers (with a cache of their own) and KV heads."""
        return sum(int((~alive).sum()) for alive in self.run(prompt, max_new_tokens)[1].alive.values())

    def guided_by(self, spec: ModelSpec, strategy: Strategy) -> None:
        """Verifying 16-bit tokens (this oracle the float64 truth): besides the forks, `teacher_forced_run` follows one
        alternative whose cuts are the policy's computed in `spec`'s dtype, wherever they differ from the truth's by
        near-tied swaps only. An engine computing the policy in that dtype keeps those sets, with more swaps in one
        step than the forks combine (a long prompt's prefill cut: kvpress's SnapKV in bfloat16 on a 240-token
        prompt). Its oracle is built on first use."""
        self._guide = functools.cache(lambda: EvictionOracle(spec, strategy))

    def guide(self) -> EvictionOracle | None:
        """The 16-bit oracle `guided_by` gave (built now if not yet), or None."""
        return self._guide() if self._guide is not None else None

    def _guided_step(self, branch: _Branch, inputs) -> torch.Tensor:
        """`_step` of a guided branch: its 16-bit guide steps too, and where the guide kept another set at this step
        by near-tied swaps only (this step's `ties`), the branch keeps the guide's; otherwise the guide resumes from
        the branch's (as `eviction_noise.calibrate_scores` does)."""
        low, follow = branch.guide
        low._step(follow, inputs)
        row = self._step(branch, inputs)
        for layer, ours in branch.masks.alive.items():
            theirs = follow.masks.alive[layer].to(ours.device)
            if torch.equal(ours, theirs):
                continue
            taken = _swaps(branch.masks.ties, layer, ours, theirs)
            if taken is None:
                follow.masks.alive[layer] = ours.to(theirs.device, copy=True)
            else:
                branch.masks.alive[layer], branch.cost, branch.flips = theirs, branch.cost + taken[0], \
                    branch.flips + taken[1]
        return row

    def _start(self, tolerance: float | None = None) -> _Branch:
        from transformers import DynamicCache

        # A cache of full layers, config-free: every key of every layer stays, sliding windows come from the mask.
        return _Branch(DynamicCache(), _Masks(self.policy, self.sources, self.rope, tolerance))

    def _step(self, branch: _Branch, inputs) -> torch.Tensor:
        """Feed `inputs` (token ids) to the branch: the last position's logits, fp32 on CPU."""
        branch.masks.ties = []
        ids = torch.tensor([list(inputs)], device=self.spec.device)
        logits = self.model(input_ids=ids, **with_cache(branch.cache), use_cache=True, eviction=branch.masks)
        return logits.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def run(self, prompt, steps: int) -> tuple[Reference, _Masks]:
        """The greedy run (one path: at a near tie the rule's own choice, never a fork), memoized."""
        key = (tuple(prompt), steps)
        if key not in self._memo:
            branch, inputs, tokens, rows = self._start(), key[0], [], []
            for _ in range(steps):
                rows.append(self._step(branch, inputs))
                tokens.append(int(rows[-1].argmax()))
                inputs = tokens[-1:]
            logits = torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)
            ref = Reference(key[0], tuple(tokens), logits, self.source,
                            forced=lambda got, tol, p=key[0]: self.teacher_forced(p, got, tol))
            self._memo[key] = ref, branch.masks
        return self._memo[key]

    def teacher_forced(self, prompt, tokens, tie_tolerance: float) -> torch.Tensor:
        """Logits [len(tokens), vocab] (fp32, CPU): row i predicts tokens[i] after prompt + tokens[:i], the given
        tokens fed (not the oracle's argmax), evicting step by step as `run` does, near-tied cuts forked
        (`teacher_forced_run`)."""
        return self.teacher_forced_run(prompt, tokens, tie_tolerance).logits

    def alternatives(self, prompt, tokens, tie_tolerance: float) -> list[torch.Tensor]:
        """Per step, the rows [alternatives, vocab] of every alternative alive there along `tokens`: after an eviction
        near tie an engine may be on any of them, so its ``score()`` rows are compared with the closest."""
        return list(self.teacher_forced_run(prompt, tokens, tie_tolerance).alternatives)

    @torch.inference_mode()
    def teacher_forced_run(self, prompt, tokens, tie_tolerance: float) -> Forced:
        """`teacher_forced` with its bookkeeping, memoized.

        At each step every live alternative is fed the given input; one whose row puts the given token more than
        `tie_tolerance` behind its best is pruned; each survivor forks at this step's near-tied cuts (module
        docstring). The cap: at most MAX_STATES alternatives live, the cheapest (`_Branch`: the summed noise events,
        each in units of its tolerance; then the fewest non-default choices). Row i is the row of the
        live alternative with the smallest gap for tokens[i]. If every alternative is pruned at step k, the one
        with the smallest gap there goes on alone (no pruning, no forks) to fill the rows after k.
        """
        tokens = tuple(int(t) for t in tokens)
        key = (tuple(prompt), tokens, float(tie_tolerance), self.eviction_tie_tolerance)
        if key in self._forced:
            return self._forced[key]
        live, rows, states, capped, pruned_at = [self._start(self.eviction_tie_tolerance)], [], 1, False, None
        low = self.guide() if self.eviction_tie_tolerance is not None else None
        if low is not None:
            live.append(dataclasses.replace(self._start(self.eviction_tie_tolerance), guide=(low, low._start())))
        alternatives: list[torch.Tensor] = []
        for i, token in enumerate(tokens):
            inputs = tokens[i - 1:i] if i else key[0]
            out = [self._guided_step(b, inputs) if b.guide else self._step(b, inputs) for b in live]
            gaps = [float(row.max() - row[token]) for row in out]
            best = min(range(len(live)), key=gaps.__getitem__)
            rows.append(out[best])
            alternatives.append(torch.stack(out))
            if pruned_at is not None:
                continue
            survivors = [b for b, gap in zip(live, gaps) if gap <= tie_tolerance]
            if not survivors:
                pruned_at, live = i, [live[best]]
                live[0].masks.tolerance = None
                continue
            for b, gap in zip(live, gaps):
                b.cost += gap / tie_tolerance if tie_tolerance > 0 else 0.0
            children = sorted((c for b in survivors for c in b.forks(MAX_STATES)),
                              key=lambda b: (b.guide is None, b.cost, b.flips))  # the guided one is never capped
            capped |= len(children) > MAX_STATES
            live = children[:MAX_STATES]
            states = max(states, len(live))
        logits = torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)
        self._forced[key] = Forced(logits, states, capped, pruned_at, tuple(alternatives))
        return self._forced[key]
