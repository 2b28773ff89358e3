"""Engines whose bug lives in the call history (issue 24, suites/test_call_history.py): each is right on a fresh
call and wrong only after a particular earlier call. Built on the correct left-padded batched engine."""

import torch
from transformers import DynamicCache

from kv_test_engines_precision import LeftPaddedBatched
from pytest_kvcompile import Declaration


class PaddingKeptPerBatchSize(LeftPaddedBatched):
    """Bug: the padding mask of the first batch of each size is kept and reused for later batches of that size (a
    buffer keyed by batch size, refilled only when it is created)."""

    kv_declaration = Declaration(batching=True, description="test engine: padding kept per batch size")

    def __init__(self, spec):
        super().__init__(spec)
        self.masks = {}  # batch size -> real lengths of the first batch of that size

    @torch.inference_mode()
    def _batch(self, prompts, steps, forced):
        if len(prompts) == 1:
            return super()._batch(prompts, steps, forced)
        kept = self.masks.setdefault(len(prompts), [len(p) for p in prompts])
        width = max(map(len, prompts))
        inputs = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - min(n, width)) + [1] * min(n, width) for n in kept])  # the bug
        cache, out = DynamicCache(config=self.model.config), [[] for _ in prompts]
        for _ in range(steps):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -inputs.size(1):]
            nxt = self.model(input_ids=inputs, attention_mask=mask, position_ids=positions,
                             past_key_values=cache).logits[:, -1].argmax(-1)
            for row, token in zip(out, nxt.tolist()):
                row.append(token)
            inputs, mask = nxt[:, None], torch.cat((mask, torch.ones(len(prompts), 1, dtype=mask.dtype)), dim=1)
        return out, None


class WrongSingleAfterBatchOf3(LeftPaddedBatched):
    """Bug: a single prompt of 16-31 tokens right after a batch of exactly 3 whose shortest row is shorter than it
    sees only as many of its last tokens as that row had (a mask length left by the batch)."""

    kv_declaration = Declaration(batching=True, description="test engine: a mask length left by a batch of 3")

    def __init__(self, spec):
        super().__init__(spec)
        self.last = None

    def generate(self, prompts, max_new_tokens):
        last, self.last = self.last, [len(p) for p in prompts]
        n = len(prompts[0])
        if len(prompts) == 1 and last and len(last) == 3 and min(last) < n and 16 <= n <= 31:
            return super().generate([list(prompts[0])[-min(last):]], max_new_tokens)
        return super().generate(prompts, max_new_tokens)
