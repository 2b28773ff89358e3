"""Engines for the project's own tests: one correct engine and deliberately broken ones.

Each broken engine carries one bug that a suite check must catch (see tests/test_suites_catch_bugs.py).
The correct engine is a plain greedy loop over the transformers model with a fresh DynamicCache.
"""

import torch
from transformers import DynamicCache

from pytest_kvcompile import Declaration
from pytest_kvcompile.models.checkpoints import pretrained, with_cache


class Greedy:
    """Correct: greedy decoding, a fresh cache per prompt; batches are served prompt by prompt."""

    kv_declaration = Declaration(batching=True, scoring=True, description="test engine: plain greedy loop")

    def __init__(self, spec):
        self.spec = spec
        self.model = pretrained(spec.path, spec.dtype).eval()

    def generate(self, prompts, max_new_tokens):
        return [self._run(p, max_new_tokens, forced=None)[0] for p in prompts]

    def score(self, prompt, continuation):
        return self._run(prompt, len(continuation), forced=continuation)[1]

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        inputs, tokens, rows = torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[0, -1]
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return [int(self.fix(step, t)) for step, t in enumerate(tokens)], torch.stack(rows)

    def fix(self, step, token):
        return token


class WrongLateToken(Greedy):
    """Bug: the token two steps before the end is off by one."""

    def generate(self, prompts, max_new_tokens):
        out = super().generate(prompts, max_new_tokens)
        for row in out:
            row[-2] = (row[-2] + 1) % self.spec.vocab_size
        return out


class StaleCache(Greedy):
    """Bug: the KV cache is created once and never reset, so later calls see earlier prompts."""

    kv_declaration = Declaration(batching=True, description="test engine: cache never reset")

    def __init__(self, spec):
        super().__init__(spec)
        self.cache = DynamicCache(config=self.model.config)

    def generate(self, prompts, max_new_tokens):
        return [self._run(p, max_new_tokens, forced=None, cache=self.cache)[0] for p in prompts]


class PaddingBug(Greedy):
    """Bug: batches are left-padded with token 0 and no attention mask, so short prompts attend to pads."""

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens):
        if len(prompts) == 1:
            return super().generate(prompts, max_new_tokens)
        width = max(map(len, prompts))
        inputs = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
        cache, out = DynamicCache(config=self.model.config), [[] for _ in prompts]
        for _ in range(max_new_tokens):
            nxt = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[:, -1].argmax(-1)
            for row, tok in zip(out, nxt.tolist()):
                row.append(tok)
            inputs = nxt[:, None]
        return out


class Flaky(Greedy):
    """Bug: every second call returns a different (wrong) last token."""

    calls = 0

    def generate(self, prompts, max_new_tokens):
        out = super().generate(prompts, max_new_tokens)
        Flaky.calls += 1
        if Flaky.calls % 2 == 0:
            for row in out:
                row[-1] = (row[-1] + 1) % self.spec.vocab_size
        return out


class SecondBest(Greedy):
    """Takes the oracle's runner-up at step 2, then decodes greedily from there. A near tie only
    if the tie tolerance is at least the gap there; `score()` stays honest."""

    def generate(self, prompts, max_new_tokens):
        out = []
        for p in prompts:
            _, logits = self._run(p, 3, forced=None)
            head = [int(logits[0].argmax()), int(logits[1].argmax()), int(logits[2].topk(2).indices[1])]
            rest = self._run(list(p) + head, max_new_tokens - 3, forced=None)[0] if max_new_tokens > 3 else []
            out.append((head + self.after_flip(rest))[:max_new_tokens])
        return out

    def after_flip(self, rest):
        """The greedy tokens after the flip, as returned (subclasses break them)."""
        return rest


class SecondBestBadScore(SecondBest):
    """As SecondBest, but its teacher-forced path picks the worst token at the last step: caught only through
    scoring."""

    def score(self, prompt, continuation):
        logits = super().score(prompt, continuation).clone()
        logits[-1, logits[-1].argmin()] = 1e4
        return logits


def _last_logits(logits):
    return logits[:, -1]


class CompiledGreedy(Greedy):
    """Correct and compiled: the step's last-position logits go through torch.compile, and dynamo's
    automatic dynamic shapes cover new prompt lengths after one recompile in warmup."""

    kv_declaration = Declaration(batching=True, scoring=True, compiled=True, description="test engine: compiled step")

    def __init__(self, spec):
        super().__init__(spec)
        self.last = torch.compile(_last_logits, backend="eager")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.last(self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits)[0]
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class DeclaredCompiledButIsNot(Greedy):
    """Declares compiled=True, never calls torch.compile."""

    kv_declaration = Declaration(batching=True, compiled=True, description="test engine: compiles nothing")


class RecompilingGreedy(CompiledGreedy):
    """Bug: compiled with dynamic=False, so every new prompt length recompiles."""

    def __init__(self, spec):
        super().__init__(spec)
        self.last = torch.compile(_last_logits, backend="eager", dynamic=False)


class _LazyState:
    initialized = False


def _last_logits_lazy(logits, state):
    if not state.initialized:  # a cache initialised on first use, inside the compiled code
        state.initialized = True
    return logits[:, -1]


class LazyInitCompiled(CompiledGreedy):
    """Bug (transformers #46421's shape): state initialised lazily inside the compiled function, so its first
    compile guards on `initialized == False` and the same call recompiles once it is True."""

    def __init__(self, spec):
        super().__init__(spec)
        state, compiled = _LazyState(), torch.compile(_last_logits_lazy, backend="eager")
        self.last = lambda logits: compiled(logits, state)


class ThreadSafeGreedy(Greedy):
    """Correct and safe to call from several threads at once: every call has its own cache."""

    kv_declaration = Declaration(batching=True, scoring=True, thread_safe=True,
                                 description="test engine: greedy loop, thread-safe")


class SharedStateGreedy(ThreadSafeGreedy):
    """Bug: declares thread_safe but keeps the call's prompts on the object, so a concurrent call answers another's."""

    def generate(self, prompts, max_new_tokens):
        import time

        self.current = prompts
        time.sleep(0.02)  # concurrent calls overwrite self.current here
        return super().generate(self.current, max_new_tokens)


class Unbatched(Greedy):
    """Correct, but declares nothing optional."""

    kv_declaration = Declaration(description="test engine: no optional capabilities")


def greedy_function(spec):
    """A factory function (not a class) without any declaration."""
    return Greedy(spec)


# --- engines that break the contract -------------------------------------------------------------
class RaisesInInit:
    def __init__(self, spec):
        raise RuntimeError("weights not found: simulated engine init failure")


class RaisesInGenerate(Greedy):
    def generate(self, prompts, max_new_tokens):
        return self._explode(len(prompts))

    def _explode(self, n):
        raise ValueError(f"simulated kernel failure for batch of {n}")


class WrongCount(Greedy):
    def generate(self, prompts, max_new_tokens):
        return [row[:-1] for row in super().generate(prompts, max_new_tokens)]


class FloatTokens(Greedy):
    def generate(self, prompts, max_new_tokens):
        return [[float(t) for t in row] for row in super().generate(prompts, max_new_tokens)]


class OutOfVocab(Greedy):
    def generate(self, prompts, max_new_tokens):
        return [[self.spec.vocab_size + 5] * max_new_tokens for _ in prompts]


class ReturnsTensor(Greedy):
    def generate(self, prompts, max_new_tokens):
        return torch.tensor(super().generate(prompts, max_new_tokens))


class NoGenerate:
    def __init__(self, spec):
        pass


class CudaOnly(Greedy):
    kv_declaration = Declaration(devices=("cuda",), description="test engine: declares cuda only")


class BadDeclaration(Greedy):
    kv_declaration = {"batching": True}


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("WrongLateToken", "StaleCache", "PaddingBug", "Flaky", "SecondBest", "SecondBestBadScore",
    "DeclaredCompiledButIsNot", "RecompilingGreedy", "LazyInitCompiled", "SharedStateGreedy", "RaisesInInit",
    "RaisesInGenerate", "WrongCount", "FloatTokens", "OutOfVocab", "ReturnsTensor", "NoGenerate", "BadDeclaration")
MUST_PASS = ("Greedy", "CompiledGreedy", "ThreadSafeGreedy", "Unbatched", "greedy_function")
MUST_SKIP = ("CudaOnly",)
HELPERS: tuple[str, ...] = ()
