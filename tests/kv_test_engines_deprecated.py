"""Twins of issue 40: correct engines that call transformers with a deprecated spelling. CI's newest-transformers
job (``-p deprecations_as_errors``) must fail them; without it they pass (tests/test_deprecations.py)."""

import torch
from transformers import DynamicCache

from kv_test_engines import Greedy


class OldCacheKeyword(Greedy):
    """``model(..., past_key_values=cache)``: deprecated in transformers 5.24 (``cache=``), a FutureWarning."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.model(input_ids=inputs, past_key_values=cache, use_cache=True).logits[0, -1]
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class OldCacheField(Greedy):
    """Reads ``output.past_key_values``: transformers 5.24 renamed the field ``cache`` and *logs* the deprecation
    (no warning), which the job's logging handler re-issues."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache, rows, tokens = out.past_key_values, [out.logits[0, -1]], []
        for step in range(steps):
            tokens.append(int(rows[-1].argmax()) if forced is None else forced[step])
            if step + 1 < steps:
                out = self.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                cache = out.past_key_values
                rows.append(out.logits[0, -1])
        return tokens, torch.stack(rows)


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("OldCacheKeyword", "OldCacheField")
MUST_PASS: tuple[str, ...] = ()
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
