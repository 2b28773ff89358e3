"""Sliding-window engines for the project's own tests: the reference ring-buffer engine on the fast
eager backend, and a deliberately broken one (tests/test_reference_sliding.py shows the suites catch it).

Import-path engines get no --kv-compile-backend (only built-in engines do), hence the eager subclass.
"""

import dataclasses

from reference_impls.sliding_window import SlidingWindowCache


class Eager(SlidingWindowCache):
    """Correct: the reference engine, compiled with the eager backend."""

    kv_declaration = dataclasses.replace(SlidingWindowCache.kv_declaration,
                                         description="test engine: ring buffers, eager")

    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")


class OffByOne(Eager):
    """Bug: the window is taken as W - 1 (the ring's W - 1 *past* keys mistaken for the window), so
    rings hold W - 1 slots and from position W - 1 on every query sees one key too few."""

    kv_declaration = dataclasses.replace(Eager.kv_declaration, description="test engine: window off by one")

    def __init__(self, spec):
        super().__init__(spec)
        self.model.window -= 1


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine (Eager: the
# twins' base, the built-in reference engine run eagerly; the built-in is what the tests hold to passing).
MUST_FAIL = ("OffByOne",)
MUST_PASS: tuple[str, ...] = ()
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("Eager",)
