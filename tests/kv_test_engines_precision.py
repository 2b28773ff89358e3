"""Engines for the 16-bit verdict rule (issue 23, pytest_kvcompile/oracles/precision.py), written against the public
contract: correct engines that compute the model another way (they must pass in bfloat16 and float16 on every zoo
model), engines whose bug lives in precision or head mapping (they must fail in both), and the rule's own twins, which
take one token just inside / just outside what the rule allows. Issue 44: numerics one format coarser than the model
(a KV cache, its values, RoPE angles, the softmax scale), which the run-level rates must catch, and score() rows
drifting just inside / outside the dtype's typical noise without a token flipping."""

import math
import types

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kv_test_engines import Greedy
from pytest_kvcompile import Declaration, ModelNotSupported
from pytest_kvcompile.models.checkpoints import with_cache


# --- correct engines ----------------------------------------------------------------------------------------------
class ChunkedPrefill(Greedy):
    """Correct: the prompt is prefilled in chunks of 5 through one cache, then decoded token by token."""

    kv_declaration = Declaration(batching=True, scoring=True, description="test engine: prefill in chunks of 5")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, tokens, rows = DynamicCache(config=self.model.config), [], []
        for start in range(0, len(prompt), 5):
            logits = self.model(input_ids=torch.tensor([prompt[start:start + 5]]), **with_cache(cache)).logits[0, -1]
        for step in range(steps):
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            logits = self.model(input_ids=torch.tensor([[tokens[-1]]]), **with_cache(cache)).logits[0, -1]
        return tokens, torch.stack(rows)


class LeftPaddedBatched(Greedy):
    """Correct: a batch is one left-padded forward (2-D mask, positions counted over real tokens), then decoded
    together; score() runs the same path as a batch of one."""

    kv_declaration = Declaration(batching=True, scoring=True, description="test engine: left-padded batches")

    def generate(self, prompts, max_new_tokens):
        return self._batch(prompts, max_new_tokens, None)[0]

    def score(self, prompt, continuation):
        return self._batch([prompt], len(continuation), continuation)[1][0]

    @torch.inference_mode()
    def _batch(self, prompts, steps, forced):
        width = max(map(len, prompts))
        inputs = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cache, out, rows = DynamicCache(config=self.model.config), [[] for _ in prompts], []
        for step in range(steps):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -inputs.size(1):]
            logits = self.model(input_ids=inputs, attention_mask=mask, position_ids=positions,
                                **with_cache(cache)).logits[:, -1]
            rows.append(logits)
            nxt = logits.argmax(-1) if forced is None else torch.full((len(prompts),), forced[step])
            for row, token in zip(out, nxt.tolist()):
                row.append(token)
            inputs, mask = nxt[:, None], torch.cat((mask, torch.ones(len(prompts), 1, dtype=mask.dtype)), dim=1)
        return out, torch.stack(rows, dim=1) if rows else torch.empty(len(prompts), 0, self.spec.vocab_size)


# --- bugs ---------------------------------------------------------------------------------------------------------
COARSER = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float8_e4m3fn}  # one format coarser than the run's


class _RoundedCache(Greedy):
    """A greedy loop whose KV cache is rounded to `formats()` = (keys' format, values' format) after every step, while
    the engine declares the run's dtype (a cache stored lower that nobody declared)."""

    kv_declaration = Declaration(batching=True, scoring=True, description="test engine: KV cache stored lower")

    def formats(self):
        return self.spec.dtype, self.spec.dtype

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        (key, value), inputs, tokens, rows = self.formats(), torch.tensor([prompt]), [], []
        cache = DynamicCache(config=self.model.config)
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache)).logits[0, -1]
            for layer in cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys = layer.keys.to(key).to(layer.keys.dtype)
                    layer.values = layer.values.to(value).to(layer.values.dtype)
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class Float8Cache(_RoundedCache):
    """Bug: the KV cache is kept in float8 (e4m3), rounded at every write, while the engine declares the run's dtype
    (a quantized cache nobody declared)."""

    kv_declaration = Declaration(batching=True, description="test engine: KV cache rounded to float8_e4m3fn")

    def formats(self):
        return torch.float8_e4m3fn, torch.float8_e4m3fn


class CoarserKVCache(_RoundedCache):
    """Bug: K and V kept one format coarser than the model (bfloat16 in a float16 run: three mantissa bits fewer;
    float8 e4m3 in a bfloat16 run). Declares score(), like the correct Greedy loop it rounds."""

    def formats(self):
        return COARSER[self.spec.dtype], COARSER[self.spec.dtype]


class CoarserValues(_RoundedCache):
    """Bug: K kept in the model's dtype, V one format coarser (float16 K with bfloat16 V; bfloat16 K with float8 V)."""

    def formats(self):
        return self.spec.dtype, COARSER[self.spec.dtype]


def _rope_in_model_dtype(module, x, position_ids, *args, **kwargs):
    """A rotary embedding whose angles (position x inverse frequency) are computed in x's dtype, not float32."""
    freqs = position_ids[..., None].to(x.dtype) * module.inv_freq.to(device=x.device, dtype=x.dtype)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * module.attention_scaling).to(x.dtype), (angles.sin() * module.attention_scaling).to(x.dtype)


class RopeAnglesInModelDtype(Greedy):
    """Bug: RoPE angles computed in the model's dtype (8 or 11 significant bits: position 160 is off by up to 0.6 rad
    in bfloat16, 0.08 in float16), not float32 as transformers does. Models with one rotary table (Llama, Mistral)."""

    def __init__(self, spec):
        super().__init__(spec)
        tables = [m for m in self.model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        if not tables or any(not hasattr(m, "inv_freq") for m in tables):
            raise ModelNotSupported(f"test engine: no single RoPE table in model '{spec.name}'")
        for table in tables:
            table.forward = types.MethodType(_rope_in_model_dtype, table)


def _scale_rounded(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA whose softmax scale, folded with log2(e) as an exp2 softmax does, is held in float8 (e4m3)."""
    folded = (module.scaling if scaling is None else scaling) * math.log2(math.e)
    rounded = float(torch.tensor(folded).to(torch.float8_e4m3fn).float())
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=rounded / math.log2(math.e),
                                  **kwargs)


AttentionInterface.register("kv_test_scale_rounded", _scale_rounded)


class AttentionScaleRounded(Greedy):
    """Bug: the softmax scale folded with log2(e) (an exp2 softmax's constant) rounded to 8 bits: 1/sqrt(16) x log2(e)
    = 0.3607 held as 0.375, 4% too large. (Rounded to the model's own dtype, the zoo's scale 1/sqrt(16) is exact.)"""

    def __init__(self, spec):
        super().__init__(spec)
        self.model.set_attn_implementation("kv_test_scale_rounded")


def _tiled_heads(module, query, key, value, attention_mask, **kwargs):
    """SDPA with grouped-query heads mapped wrongly: query head h reads KV head h % kv_heads (tiled), not
    h // (heads / kv_heads) (transformers' repeat_kv)."""
    groups = query.size(1) // key.size(1)
    key, value = key.repeat(1, groups, 1, 1), value.repeat(1, groups, 1, 1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kv_test_tiled_heads", _tiled_heads)


class WrongHeadMapping(Greedy):
    """Bug: grouped-query attention maps query heads to the wrong KV heads (tiled instead of grouped)."""

    kv_declaration = Declaration(batching=True, description="test engine: GQA heads tiled, not grouped")

    def __init__(self, spec):
        super().__init__(spec)
        self.model.set_attn_implementation("kv_test_tiled_heads")


# --- the rule's twins ---------------------------------------------------------------------------------------------
class _OneFlip(Greedy):
    """Follows the float64 truth of the run's weights (oracles/precision.py) token for token, except at the first step
    where some token's gap behind the truth's best is a fraction of what the rule allows there (`WINDOW`, in units of
    the allowed gap: max(tolerance, the local noise term)); it takes that token once. No such step: the truth alone."""

    kv_declaration = Declaration(batching=True, description="test engine: one flip at a chosen distance from the rule")
    WINDOW = (0.0, 1.0)

    def __init__(self, spec):
        from pytest_kvcompile.oracles import precision
        from pytest_kvcompile.oracles.hf import HFEagerOracle

        super().__init__(spec)
        self.truth = HFEagerOracle(precision.high_precision(spec))
        self.computations = precision.Computations(spec)
        noise = precision.calibrate(spec, self.truth, self.computations)
        self.tolerance, self.reach = noise.tolerance, noise.reach

    def generate(self, prompts, max_new_tokens):
        return [self._one(list(p), max_new_tokens) for p in prompts]

    def _one(self, prompt, steps):
        from pytest_kvcompile.oracles.precision import LocalNoise

        tokens = list(self.truth.reference(prompt, steps).tokens)
        rows = self.truth.teacher_forced(prompt, tokens)
        local = LocalNoise(self.computations.along(prompt, tokens), self.reach)
        lo, hi = self.WINDOW
        for step in range(steps):
            row, best = rows[step].double(), int(rows[step].argmax())
            for token in row.argsort(descending=True)[1:8].tolist():
                gap = float(row[best] - row[token])
                allowed = max(self.tolerance, local.allowed(step, best, token, row))
                if lo * allowed < gap <= hi * allowed:
                    head = tokens[:step] + [token]
                    return head + list(self.truth.reference(prompt + head, steps - step - 1).tokens)
        return tokens


class FlipJustInside(_OneFlip):
    """Correct by the rule: one token 70-95% of the allowed gap behind the best. Must PASS (one near tie)."""

    WINDOW = (0.7, 0.95)


class FlipJustOutside(_OneFlip):
    """Wrong by the rule: one token 105-130% of the allowed gap behind the best. Must FAIL (a mismatch)."""

    WINDOW = (1.05, 1.3)


class _LogitsDrift(Greedy):
    """The tokens of the correct Greedy loop; its logits (generate's and score()'s) moved at every EVERY-th step: the
    best's seven runners-up lowered by DELTA (4x the computations' median error on llama, within the score()
    tolerance), so no token flips and only the run's score() rate (verdicts/run_rules.py: RunRate) can tell."""

    kv_declaration = Declaration(batching=True, scoring=True, description="test engine: logits drifting, no flip")
    EVERY = 1
    DELTA = {torch.float16: 0.1, torch.bfloat16: 0.6}  # llama: median error 0.024 / 0.155

    def _run(self, prompt, steps, forced, cache=None):
        tokens, rows = super()._run(prompt, steps, forced, cache)
        rows = rows.clone()
        for step in range(0, len(rows), self.EVERY):
            rows[step, rows[step].topk(8).indices[1:]] -= self.DELTA[self.spec.dtype]
        return tokens, rows


class LogitsDriftJustInside(_LogitsDrift):
    """Correct by the rule: one step in 16 moved (the run's score() rate stays within the dtype's computations')."""

    EVERY = 16


class LogitsDriftJustOutside(_LogitsDrift):
    """Wrong by the rule: one step in 2 moved (its score() rate twice the computations'). No token flips."""

    EVERY = 2


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("Float8Cache", "CoarserKVCache", "CoarserValues", "RopeAnglesInModelDtype", "AttentionScaleRounded",
    "WrongHeadMapping", "FlipJustOutside", "LogitsDriftJustOutside")
MUST_PASS = ("ChunkedPrefill", "LeftPaddedBatched", "FlipJustInside", "LogitsDriftJustInside")
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
