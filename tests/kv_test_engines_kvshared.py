"""KV-shared prefill-skip engines for the project's own tests: the reference engine on the fast eager
backend, and a deliberately broken one (tests/test_reference_kv_shared.py shows the suites catch it).

Import-path engines get no --kv-compile-backend (only built-in engines do), hence the eager subclass.
"""

import dataclasses

from reference_impls.kv_shared import KVSharedPrefillSkip


class Eager(KVSharedPrefillSkip):
    """Correct: the reference engine, compiled with the eager backend."""

    kv_declaration = dataclasses.replace(KVSharedPrefillSkip.kv_declaration, description="test engine: skip, eager")

    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")


class SkipsSharedLayers(Eager):
    """Bug: "shared layers write no cache, so prefill can skip them" -- it drops them at prefill for
    every position, the last one too, so the first new token comes from the non-shared layers only."""

    kv_declaration = dataclasses.replace(Eager.kv_declaration, description="test engine: shared layers dropped")

    def __init__(self, spec):
        super().__init__(spec)
        self.prefilling = False
        for i in self.model.kv_sources:
            self.model.model.layers[i].register_forward_hook(
                lambda layer, args, out: args[0] if self.prefilling else out)

    def _prefill(self, prompts):
        self.prefilling = True
        try:
            return super()._prefill(prompts)
        finally:
            self.prefilling = False


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine (Eager: the
# twins' base, the built-in reference engine run eagerly; the built-in is what the tests hold to passing).
MUST_FAIL = ("SkipsSharedLayers",)
MUST_PASS: tuple[str, ...] = ()
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("Eager",)
