"""Engines for the verdict rules (tests/test_verdicts.py, issue 10): correct engines the suite must pass, and one
engine per class of bug that fooled an earlier suite, each written only against the public engine contract."""

import torch
from transformers import DynamicCache

from kv_test_engines import CompiledGreedy, Greedy, SecondBest, StaleCache, _last_logits
from kv_test_engines_memory import DynamicBytes
from pytest_kvcompile import Bounds, Declaration, Strategy
from pytest_kvcompile.models.checkpoints import with_cache


# --- correct engines --------------------------------------------------------------------------------------------
class Recompute(Greedy):
    """Correct: no cache at all, every step recomputes the whole sequence (in the run's dtype)."""

    kv_declaration = Declaration(batching=True, scoring=True, description="test engine: no cache, full recompute")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        ids, tokens, rows = list(prompt), [], []
        for step in range(steps):
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            ids.append(tokens[-1])
        return tokens, torch.stack(rows)


class TinyNoise(Greedy):
    """Correct up to numerics: logits perturbed by noise far below the tie tolerance."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        gen = torch.Generator().manual_seed(len(prompt))
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[0, -1]
            logits = logits + 1e-6 * torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


# --- 1. nothing after a near tie goes unverified ------------------------------------------------------------------
class FlipThenGarbage(SecondBest):
    """Bug: takes the runner-up at step 2 (a near tie under a wide tolerance), then every later token is off by one."""

    kv_declaration = Declaration(batching=True, description="test engine: one flip, then garbage (no scoring)")

    def after_flip(self, rest):
        return [(t + 1) % self.spec.vocab_size for t in rest]


class FlipsAtEveryCloseCall(Greedy):
    """Bug (numerics drift): takes the runner-up whenever it is within 5 logits of the best."""

    kv_declaration = Declaration(batching=True, description="test engine: flips at every close call")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[0, -1]
            rows.append(logits)
            top = logits.topk(2)
            close = float(top.values[0] - top.values[1]) < 5
            tokens.append(int(top.indices[1] if close else top.indices[0]) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class ScoreOffByOne(Greedy):
    """Bug: generate() is right, but score() returns logits shifted by one step (row i predicts token i+1)."""

    def score(self, prompt, continuation):
        rows = super().score(prompt, continuation)
        return torch.cat((rows[1:], rows[-1:]))


class ScoreLogSoftmax(Greedy):
    """Bug: score() returns log-probabilities, not logits (argmax agrees, rows do not)."""

    def score(self, prompt, continuation):
        return super().score(prompt, continuation).log_softmax(-1)


# --- 2. compiles are observed, not declared -----------------------------------------------------------------------
class CompiledUndeclared(CompiledGreedy):
    """Bug: torch.compile(dynamic=False) around the step and no compiled=True: recompiles on every new length."""

    kv_declaration = Greedy.kv_declaration

    def __init__(self, spec):
        super().__init__(spec)
        self.last = torch.compile(_last_logits, backend="eager", dynamic=False)


class EagerOnRecompile(CompiledUndeclared):
    """Bug: the same, hidden after its first calls by torch.compiler.set_stance("eager_on_recompile"): new shapes
    then run eagerly and nothing recompiles."""

    kv_declaration = Declaration(batching=True, scoring=True, compiled=True,
                                 description="test engine: eager on recompile")
    calls = 0

    def generate(self, prompts, max_new_tokens):
        self.calls += 1
        if self.calls <= 3:
            return super().generate(prompts, max_new_tokens)
        with torch.compiler.set_stance("eager_on_recompile"):
            return super().generate(prompts, max_new_tokens)


def _item_step(logits):
    torch._dynamo.graph_break()  # a graph break (an error under fullgraph=True)
    return logits[:, -1]


class SwallowsCompileErrors(CompiledGreedy):
    """Bug: compiles with fullgraph=True, which fails on a graph break, and silently falls back to eager."""

    kv_declaration = Declaration(batching=True, scoring=True, compiled=True, description="test engine: swallows errors")

    def __init__(self, spec):
        super().__init__(spec)
        self.step = torch.compile(_item_step, backend="eager", fullgraph=True)
        self.last = self.step_or_eager

    def step_or_eager(self, logits):
        try:
            return self.step(logits)
        except Exception:
            return _last_logits(logits)


class GraphBreaks(SwallowsCompileErrors):
    """Bug (speed): the compiled step graph-breaks in every call."""

    kv_declaration = Declaration(batching=True, scoring=True, compiled=True, description="test engine: graph break")

    def __init__(self, spec):
        Greedy.__init__(self, spec)
        self.step = torch.compile(_item_step, backend="eager", dynamic=True)
        self.last = self.step_or_eager


class StopsCompiling(SwallowsCompileErrors):
    """Bug: after a few calls the engine serves every call under torch.compiler.set_stance("force_eager")."""

    kv_declaration = Declaration(batching=True, scoring=True, compiled=True, description="test engine: stops compiling")

    def __init__(self, spec):
        Greedy.__init__(self, spec)
        self.step = torch.compile(_last_logits, backend="eager", dynamic=True)
        self.last = self.step_or_eager
        self.calls = 0

    def generate(self, prompts, max_new_tokens):
        self.calls += 1
        if self.calls <= 3:
            return super().generate(prompts, max_new_tokens)
        with torch.compiler.set_stance("force_eager"):
            return super().generate(prompts, max_new_tokens)


# --- 3. lengths and prefixes that exercise the cache --------------------------------------------------------------
class KeepsLast256(Greedy):
    """Bug: the cache silently keeps only the last 256 positions (a 256-slot ring sized for 'enough')."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[0, -1]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, -255:], layer.values[:, :, -255:]
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class PrefixCacheBug(Greedy):
    """Bug: a prefix cache keyed by a prompt's first 16 tokens; a later prompt with the same first 16 tokens
    reuses the earlier prompt's KV up to the shorter length - 1, not just the 16 shared tokens (equivalently:
    it computes as if those positions held the earlier prompt's tokens)."""

    kv_declaration = Declaration(description="test engine: prefix cache keyed by 16 tokens")

    def __init__(self, spec):
        super().__init__(spec)
        self.prefixes = {}

    def generate(self, prompts, max_new_tokens):
        out = []
        for p in map(list, prompts):
            old = self.prefixes.get(tuple(p[:16])) if len(p) > 16 else None
            start = min(len(old), len(p)) - 1 if old else 0
            effective = (old[:start] if old else []) + p[start:]
            out.append(self._run(effective, max_new_tokens, forced=None)[0])
            if len(p) > 16:
                self.prefixes[tuple(p[:16])] = p
        return out


class NeverEvicts(Greedy):
    """Bug (vacuous): declares last_recent with a budget no prompt of the run reaches, and never evicts."""

    kv_declaration = Declaration(strategy=Strategy.of("last_recent", budget=600),
                                 description="test engine: budget 600, never evicts")


# --- 4. absolute positions are visible ----------------------------------------------------------------------------
class ContinuesPositions(Greedy):
    """Bug: positions continue from the previous call (a position counter never reset); invisible under RoPE."""

    kv_declaration = Declaration(description="test engine: positions carried across calls")

    def __init__(self, spec):
        super().__init__(spec)
        self.offset = 0

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens = DynamicCache(config=self.model.config), torch.tensor([prompt]), []
        pos = self.offset
        for _ in range(steps):
            positions = torch.arange(pos, pos + inputs.size(1))[None]
            logits = self.model(input_ids=inputs, **with_cache(cache), position_ids=positions).logits[0, -1]
            pos += inputs.size(1)
            tokens.append(int(logits.argmax()))
            inputs = torch.tensor([[tokens[-1]]])
        self.offset = pos
        return tokens, None


class PadPositions(Greedy):
    """Bug: a left-padded row's positions start at the pad count (position ids not derived from the mask)."""

    kv_declaration = Declaration(batching=True, description="test engine: positions ignore left padding")

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens):
        width = max(map(len, prompts))
        inputs = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cache, out = DynamicCache(config=self.model.config), [[] for _ in prompts]
        for step in range(max_new_tokens):
            positions = torch.arange(width + step - inputs.size(1), width + step)[None].expand(len(prompts), -1)
            logits = self.model(input_ids=inputs, attention_mask=mask, **with_cache(cache),
                                position_ids=positions).logits[:, -1]
            nxt = logits.argmax(-1)
            for row, tok in zip(out, nxt.tolist()):
                row.append(tok)
            inputs, mask = nxt[:, None], torch.cat((mask, torch.ones(len(prompts), 1, dtype=mask.dtype)), dim=1)
        return out


# --- 5. memory is measured, not only self-reported ----------------------------------------------------------------
class PreallocatesSixteenX(DynamicBytes):
    """Bug: reports its dynamic cache exactly, but preallocates a buffer 16x the largest cache it served."""

    def generate(self, prompts, max_new_tokens):
        out = super().generate(prompts, max_new_tokens)
        self.arena = torch.empty(16 * max(1, self.kv_cache_bytes()), dtype=torch.uint8)
        return out


class MemoByPrompt(Greedy):
    """Bug: memoizes every prompt's cache (a 'prefix cache' that is never evicted): grows with new prompts only."""

    def __init__(self, spec):
        super().__init__(spec)
        self.memo = {}

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache = DynamicCache(config=self.model.config)
        self.memo[tuple(prompt)] = cache
        return super()._run(prompt, steps, forced, cache=cache)


# --- 6. nothing vacuous -------------------------------------------------------------------------------------------
class UnknownStrategy(Greedy):
    kv_declaration = Declaration(strategy=Strategy.of("h20", heavy=8, recent=8), description="test engine: typo")


class WithoutOracle(Greedy):
    """Correct, declaring a strategy no oracle covers: only the oracle-free checks can judge it."""

    kv_declaration = Declaration(batching=True, strategy=Strategy.of("without_oracle", name="quantized-kv"),
                                 description="test engine: no oracle")


class StaleWithoutOracle(StaleCache):
    """Bug: a cache never reset, declaring a strategy no oracle covers: the oracle-free checks must catch it."""

    kv_declaration = Declaration(batching=True, strategy=Strategy.of("without_oracle", name="quantized-kv"),
                                 description="test engine: stale cache, no oracle")


class SkipsEverything(Greedy):
    """Bug (vacuous): generate() skips the test (pytest.skip) instead of running."""

    def generate(self, prompts, max_new_tokens):
        import pytest

        pytest.skip("not today")


# --- fuzzing: a bug that needs a specific combination of calls ----------------------------------------------------
class LeaksAfterBatchOfThree(Greedy):
    """Bug: a single prompt right after a batch of exactly three, shorter than that batch's longest prompt, is
    left-padded to the old width without a mask (row state of the 3-row batch left behind). Every fixed suite
    check passes: none of them makes that call right after a batch of three."""

    kv_declaration = Declaration(batching=True, description="test engine: leaks after a batch of three")

    def __init__(self, spec):
        super().__init__(spec)
        self.last = (0, 0)

    def generate(self, prompts, max_new_tokens):
        rows, width = self.last
        self.last = (len(prompts), max(map(len, prompts), default=0))
        if rows == 3 and len(prompts) == 1 and len(prompts[0]) < width:
            return [self._run([0] * (width - len(prompts[0])) + list(prompts[0]), max_new_tokens, forced=None)[0]]
        return super().generate(prompts, max_new_tokens)


# --- declared limits (issue 28): ids a runtime never emits, shapes it refuses --------------------------------------
MASKED = 110  # an id the zoo llama's greedy oracle chooses (prompt 'short7', step 8; 'long48', step 6)


class MasksAnId(Greedy):
    """Correct under its declaration: its runtime masks id 110 (as CTranslate2's min_length masks EOS) and says so."""

    kv_declaration = Declaration(batching=True, scoring=True, never_emits=(MASKED,),
                                 description="test engine: greedy with id 110 masked, declared")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[0, -1].clone()
            logits[MASKED] = -torch.inf
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class MasksAnIdUndeclared(MasksAnId):
    """Bug twin: the same runtime mask, not declared: where the oracle's best is 110 it is a mismatch."""

    kv_declaration = Declaration(batching=True, description="test engine: greedy with id 110 masked, undeclared")


class DeclaresAnIdItEmits(Greedy):
    """Bug twin: declares it never emits 110, yet its plain greedy loop returns it."""

    kv_declaration = Declaration(batching=True, never_emits=(MASKED,),
                                 description="test engine: declares never_emits=(110,), emits it")


class RefusesLongPrompts(Greedy):
    """Correct under its declaration: a runtime that refuses prompts over 32 tokens, by design, and declares it."""

    kv_declaration = Declaration(batching=True, bounds=Bounds(max_prompt=32),
                                 description="test engine: refuses prompts over 32 tokens, declared")

    def generate(self, prompts, max_new_tokens):
        if max(map(len, prompts)) > 32:
            raise ValueError("Prefill length exceeds 32")
        return super().generate(prompts, max_new_tokens)


class RefusesLongPromptsUndeclared(RefusesLongPrompts):
    """Twin: the same refusal, undeclared: the long prompts' checks fail with the engine's error."""

    kv_declaration = Declaration(batching=True, description="test engine: refuses prompts over 32 tokens")


class DeclaresBoundsAnswersWrong(Greedy):
    """Bug twin (LitGPT 0.5.12's shape): declares Bounds(max_prompt=32), yet answers longer prompts from their last 32
    tokens instead of refusing them: the answers are judged, and fail."""

    kv_declaration = Declaration(batching=True, bounds=Bounds(max_prompt=32),
                                 description="test engine: declares max_prompt=32, answers longer prompts truncated")

    def generate(self, prompts, max_new_tokens):
        return super().generate([p[-32:] for p in prompts], max_new_tokens)


class HoldsItsPositions(Greedy):
    """Correct under its declaration: a static cache of 300 positions (fewer than the zoo's 512), declared as
    Bounds(max_positions=300); a call holding more is refused."""

    capacity = 300
    kv_declaration = Declaration(batching=True, bounds=Bounds(max_positions=capacity),
                                 description="test engine: a cache of 300 positions, declared")

    def generate(self, prompts, max_new_tokens):
        if max(map(len, prompts)) + max_new_tokens > self.capacity:
            raise ValueError(f"prompt + max_new_tokens exceeds the cache's {self.capacity} positions")
        return super().generate(prompts, max_new_tokens)


class WrongAtItsLastPositions(HoldsItsPositions):
    """Bug twin: the same declared cache, wrong past position 280 (a static cache whose last slots are mis-indexed),
    where only a long generation filled to the declared end reaches (the other checks stop at 266 positions)."""

    def generate(self, prompts, max_new_tokens):
        out = super().generate(prompts, max_new_tokens)
        vocab = self.spec.vocab_size
        return [[(t + 1) % vocab if len(p) + i >= 280 else t for i, t in enumerate(row)]
                for p, row in zip(prompts, out)]


class _MinMaxKV(DynamicCache):
    """A KV cache quantizing each key and value vector (one token, one head) asymmetrically to `bits` (quanto/HQQ
    style; the suite's own simulation is symmetric groups, oracles/precision.py: kv_round)."""

    bits = 8

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._round(key_states), self._round(value_states), layer_idx, *args, **kwargs)

    def _round(self, x):
        levels = 2 ** self.bits - 1
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / levels
        return ((x - low) / scale).round().clamp(0, levels) * scale + low


class KVInt8(Greedy):
    """Correct under its declaration: K and V stored as int8 (per vector, min-max), declared kv_cache_dtype='int8'."""

    kv_declaration = Declaration(batching=True, kv_cache_dtype="int8", description="test engine: KV in int8, declared")
    bits = 8

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache = type("KV", (_MinMaxKV,), {"bits": self.bits})(config=self.model.config)
        return super()._run(prompt, steps, forced, cache)


class KVInt8Undeclared(KVInt8):
    """Twin: the same int8 cache, undeclared: held to the model's own dtype."""

    kv_declaration = Declaration(batching=True, description="test engine: KV in int8, undeclared")


class KVInt4DeclaredInt8(KVInt8):
    """Bug twin: stores int4 while declaring int8: held to int8's measured noise, it must fail."""

    kv_declaration = Declaration(batching=True, kv_cache_dtype="int8",
                                 description="test engine: KV in int4, declares int8")
    bits = 4


class KVInt2(KVInt8):
    """Declares what it does, K and V in int2: so coarse on the zoo that no token check can tell a bug from it."""

    kv_declaration = Declaration(batching=True, kv_cache_dtype="int2", description="test engine: KV in int2, declared")
    bits = 2


class _Float8KV(DynamicCache):
    """A KV cache storing each key and value vector (one token, one head) in `fmt` with its own scale (amax / the
    format's largest value: SGLang's per-head scales, finer than vLLM's per-tensor default)."""

    fmt = torch.float8_e4m3fn

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._round(key_states), self._round(value_states), layer_idx, *args, **kwargs)

    def _round(self, x):
        scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.finfo(self.fmt).max
        return (x.float() / scale).to(self.fmt).float().mul(scale).to(x.dtype)


class KVFloat8(Greedy):
    """Correct under its declaration: K and V stored as float8 e4m3 with per-vector scales, declared
    kv_cache_dtype='float8_e4m3fn' (vLLM's fp8 cache)."""

    kv_declaration = Declaration(batching=True, kv_cache_dtype="float8_e4m3fn",
                                 description="test engine: KV in float8 e4m3 (scaled), declared")
    fmt = torch.float8_e4m3fn

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache = type("KV", (_Float8KV,), {"fmt": self.fmt})(config=self.model.config)
        return super()._run(prompt, steps, forced, cache)


class KVFloat8E5M2DeclaredE4M3(KVFloat8):
    """Bug twin: stores float8 e5m2 (2 mantissa bits) while declaring e4m3 (3): held to e4m3's measured noise, it
    must fail."""

    kv_declaration = Declaration(batching=True, kv_cache_dtype="float8_e4m3fn",
                                 description="test engine: KV in float8 e5m2, declares e4m3")
    fmt = torch.float8_e5m2


class MatmulInt8(Greedy):
    """Correct under its declaration: every linear layer's input quantised to int8 in symmetric blocks of 32 with a
    float32 scale (a kernel rounding differently from the suite's simulation, whose scale is a half: llama.cpp's
    q8_0), declared matmul_inputs='int8'."""

    kv_declaration = Declaration(batching=True, matmul_inputs="int8",
                                 description="test engine: matmul inputs int8 (blocks of 32), declared")
    levels = 127

    def __init__(self, spec):
        super().__init__(spec)
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (self._round(args[0]), *args[1:]))

    def _round(self, x):
        blocks = x.float().reshape(*x.shape[:-1], -1, 32)
        scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / self.levels
        return ((blocks / scale).round() * scale).reshape(x.shape).to(x.dtype)


class MatmulInt8Undeclared(MatmulInt8):
    """Twin: the same int8 matmul inputs, undeclared: held to the model's own dtype."""

    kv_declaration = Declaration(batching=True, description="test engine: matmul inputs int8, undeclared")


class MatmulInt4DeclaredInt8(MatmulInt8):
    """Bug twin: quantises matmul inputs to int4 while declaring int8: held to int8's measured noise, it must fail."""

    kv_declaration = Declaration(batching=True, matmul_inputs="int8",
                                 description="test engine: matmul inputs int4, declares int8")
    levels = 7


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("FlipThenGarbage", "FlipsAtEveryCloseCall", "ScoreOffByOne", "ScoreLogSoftmax", "CompiledUndeclared",
    "EagerOnRecompile", "SwallowsCompileErrors", "GraphBreaks", "StopsCompiling", "KeepsLast256", "PrefixCacheBug",
    "NeverEvicts", "ContinuesPositions", "PadPositions", "PreallocatesSixteenX", "MemoByPrompt", "UnknownStrategy",
    "StaleWithoutOracle", "SkipsEverything", "LeaksAfterBatchOfThree", "MasksAnIdUndeclared", "DeclaresAnIdItEmits",
    "RefusesLongPromptsUndeclared", "DeclaresBoundsAnswersWrong", "WrongAtItsLastPositions", "KVInt8Undeclared",
    "KVInt4DeclaredInt8", "KVInt2",
    "KVFloat8E5M2DeclaredE4M3", "MatmulInt8Undeclared", "MatmulInt4DeclaredInt8")
MUST_PASS = ("Recompute", "TinyNoise", "WithoutOracle", "MasksAnId", "RefusesLongPrompts", "HoldsItsPositions",
             "KVInt8", "KVFloat8", "MatmulInt8")
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
