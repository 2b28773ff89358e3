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
