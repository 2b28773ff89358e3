"""Engines for the torch.export watch (recompiles/hooks.py): exporting is the export world's compiling."""

import torch

from kv_test_engines import Greedy
from pytest_kvcompile import Declaration


class _Head(torch.nn.Module):
    def forward(self, logits):
        return logits * 1.0


def _export(length, dynamic=False):
    shapes = ({1: torch.export.Dim("n", min=1, max=512)},) if dynamic else None
    return torch.export.export(_Head(), (torch.zeros(1, length, 4),), dynamic_shapes=shapes, strict=False)


class ExportsOnce(Greedy):
    """Correct: one program exported while building (dynamic length), none after."""

    kv_declaration = Declaration(batching=True, description="test engine: exports once at build")

    def __init__(self, spec):
        super().__init__(spec)
        self.program = _export(5, dynamic=True)


class ReexportsPerLength(Greedy):
    """Bug: re-exports (non-strict: no dynamo frame runs) for every prompt length it has not seen, the way an
    engine with static shapes silently pays an export per shape instead of failing."""

    kv_declaration = Declaration(batching=True, description="test engine: re-exports per new length")

    def __init__(self, spec):
        super().__init__(spec)
        self.programs = {}

    def generate(self, prompts, max_new_tokens):
        for length in {len(p) for p in prompts} - set(self.programs):
            self.programs[length] = _export(length)
        return super().generate(prompts, max_new_tokens)


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("ReexportsPerLength",)
MUST_PASS = ("ExportsOnce",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
