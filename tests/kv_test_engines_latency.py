"""Engines for the latency and report tests: no model runs, so their speed is set by design.

``Instant`` answers at once; ``Sleepy`` sleeps SLEEP_S per generated token (prefill included),
deliberately slow for relative latency budgets to catch. Their tokens are zeros: token checks fail on them.
"""

import time

from pytest_kvcompile import Declaration

SLEEP_S = 0.004
BYTES_PER_POSITION = 64


class Instant:
    kv_declaration = Declaration(batching=True, kv_cache_bytes=True, description="test engine: answers at once")

    def __init__(self, spec):
        self.positions = 0

    def generate(self, prompts, max_new_tokens):
        self.positions = max(len(p) for p in prompts) + max_new_tokens
        return [[0] * max_new_tokens for _ in prompts]

    def kv_cache_bytes(self):
        return self.positions * BYTES_PER_POSITION


class Sleepy(Instant):
    """Deliberately slow: SLEEP_S per generated token."""

    def generate(self, prompts, max_new_tokens):
        time.sleep(SLEEP_S * max_new_tokens)
        return super().generate(prompts, max_new_tokens)


class MemoSleepy(Sleepy):
    """Slow, but remembers answers by prompt (a prompt cache): a repeated prompt comes back at once. Timing the same
    prompt every repeat would clock the memo, not the engine."""

    def __init__(self, spec):
        super().__init__(spec)
        self.memo = {}

    def generate(self, prompts, max_new_tokens):
        key = (tuple(map(tuple, prompts)), max_new_tokens)
        if key not in self.memo:
            self.memo[key] = super().generate(prompts, max_new_tokens)
        return self.memo[key]


class Opaque(Instant):
    """Holds nothing Python can see and reports nothing (a native runtime, as the memory checks see one)."""

    kv_declaration = Declaration(batching=True, description="test engine: no visible tensors, no reports")


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("Sleepy", "MemoSleepy")
MUST_PASS = ("Instant",)
MUST_SKIP = ("Opaque",)
HELPERS: tuple[str, ...] = ()
