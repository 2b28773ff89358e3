"""Speculative decoders for tests/test_speculative.py: a correct variant of ref-speculative, and twins carrying one
bug each that suites/test_speculative.py must catch. Each changes one method of reference_impls/speculative.py."""

from __future__ import annotations

import dataclasses

from pytest_kvcompile.contract.speculative import Speculative
from reference_impls.speculative import DraftModel, SpeculativeDecoding, SpeculativePromptLookup


class SpeculativeK2(SpeculativeDecoding):
    """Correct: 2 drafts per step."""

    kv_declaration = dataclasses.replace(SpeculativeDecoding.kv_declaration,
                                         speculative=dataclasses.replace(
                                             SpeculativeDecoding.kv_declaration.speculative, k=2))

    def __init__(self, spec, *, compile_backend: str = "inductor"):
        super().__init__(spec, compile_backend=compile_backend, k=2)


class KeepsRejectedKV(SpeculativeDecoding):
    """Bug: every drafted position's K/V stays in the cache, rejected ones too (mlx-lm PR #1109: caches that cannot
    be trimmed)."""

    def _kept(self, drafts, accepted):
        return [0 if d is None else 1 + len(d) for d in drafts]


class BonusFromTheWrongPosition(SpeculativeDecoding):
    """Bug: after a rejection the bonus token is read one position late, from the logits that followed the rejected
    draft (vLLM PR #9730: bonus tokens when k > 1)."""

    def _accept(self, draft, choices):
        accepted, _ = super()._accept(draft, choices)
        return accepted, choices[min(accepted + 1, len(draft))]


class RollbackOffByOneAtLast(SpeculativeDecoding):
    """Bug: when the first rejected draft is the last one (j = k - 1), its K/V is kept (an off-by-one at the end of the
    step's window)."""

    def _kept(self, drafts, accepted):
        return [k + (d is not None and a == len(d) - 1 == self.k - 1) for k, d, a in
                zip(super()._kept(drafts, accepted), drafts, accepted)]


class OneRowsRollbackForAll(SpeculativeDecoding):
    """Bug: in a batch, the first row's rollback is applied to every row (rows keeping different lengths)."""

    def _kept(self, drafts, accepted):
        kept = super()._kept(drafts, accepted)
        first = next((k for k in kept if k), 0)
        return [first if d is not None else 0 for d in drafts]


class DraftKeepsRejected(DraftModel):
    """Bug: the draft model's own cache is not rolled back: it keeps its drafts the target rejected and runs the new
    context's tokens on top of them."""

    def _rollback(self, start, held):
        return len(held)


class DraftCacheNotRolledBack(SpeculativeDecoding):
    """Bug (draft-model speculation): its draft models' caches are never cropped (DraftKeepsRejected). Every token is
    still the target's, so only the acceptance the draft earns shows it."""

    draft_model = DraftKeepsRejected


class NeverDrafts(SpeculativeDecoding):
    """Declares speculative decoding but drafts nothing: every step is a plain decode, reported honestly as (0, 0)."""

    kv_declaration = dataclasses.replace(SpeculativeDecoding.kv_declaration, speculative=Speculative(k=4,
                                         acceptance=True))

    def __init__(self, spec, *, compile_backend: str = "inductor"):
        super().__init__(spec, compile_backend=compile_backend, k=0)


class LookupOffByOneAtLast(SpeculativePromptLookup):
    """Bug (prompt lookup): when the first rejected draft is the last one (j = k - 1), its K/V is kept. A lookup
    rarely proposes k - 1 right tokens on its own: only the forced lookup prompts reach it."""

    def _kept(self, drafts, accepted):
        return [k + (d is not None and a == len(d) - 1 == self.k - 1) for k, d, a in
                zip(super()._kept(drafts, accepted), drafts, accepted)]


class LookupNeverDrafts(SpeculativePromptLookup):
    """Declares prompt lookup but its lookup never proposes anything: every step a plain decode, reported honestly as
    (0, 0)."""

    def __init__(self, spec, *, compile_backend: str = "inductor"):
        super().__init__(spec, compile_backend=compile_backend)
        self.own = self.drafter = _NoMatch()


class LookupCountsARejectedDraft(SpeculativePromptLookup):
    """Bug (reporting only, issue 59): acceptance() says one draft more was kept than was when a sequence's first
    verify step rejects (vLLM's spec-decode metrics had this class: a bonus token counted as accepted). Tokens and
    cache are right. The engine written from the docs that had it looked up once per sequence, so it over-counted at
    most once per sequence: read per sequence alone, its counts on a forced lookup are those of an engine whose first
    step is the prompt's own lookup (start 0) instead of one after the prefill's token (start 1)."""

    def acceptance(self):
        return [[(d, a + 1) if i == 0 and a < d else (d, a) for i, (d, a) in enumerate(row)]
                for row in super().acceptance()]


class _NoMatch:
    def propose(self, context, k):
        return []


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("KeepsRejectedKV", "BonusFromTheWrongPosition", "RollbackOffByOneAtLast", "OneRowsRollbackForAll",
    "DraftCacheNotRolledBack", "NeverDrafts", "LookupOffByOneAtLast", "LookupNeverDrafts", "LookupCountsARejectedDraft")
MUST_PASS = ("SpeculativeK2",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("DraftKeepsRejected",)
