"""Engines whose bug lives in the call history (issue 24, suites/test_call_history.py): each is right on a fresh
call and wrong only after a particular earlier call, or compiles again only on a call unlike the warmup's. Built on
the correct left-padded batched engine and the correct compiled greedy engine."""

import torch
from transformers import DynamicCache

from kv_test_engines import CompiledGreedy
from kv_test_engines_precision import LeftPaddedBatched
from pytest_kvcompile import Declaration
from pytest_kvcompile.models.checkpoints import with_cache


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
                             **with_cache(cache)).logits[:, -1].argmax(-1)
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


def _decode_logits(logits, room):
    """The decode step's last logits, checked against the room left in a preallocated output buffer."""
    return logits[:, -1] + 0 * room[:1, :1].sum()


class RecompilesPastWarmupSteps(CompiledGreedy):
    """Bug: the compiled decode step takes an output buffer sized to max_new_tokens rounded up to 32 (compiled with
    dynamic=False), so the first call decoding more tokens than the warmup did compiles again."""

    kv_declaration = Declaration(batching=True, scoring=True, compiled=True,
                                 description="test engine: recompiles past the warmup's decode steps")

    def __init__(self, spec):
        super().__init__(spec)
        self.decode = torch.compile(_decode_logits, backend="eager", dynamic=False)

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        room = torch.zeros(-(-steps // 32) * 32, 1)
        cache, inputs, tokens, rows = DynamicCache(config=self.model.config), torch.tensor([prompt]), [], []
        for step in range(steps):
            logits = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits
            logits = (self.decode(logits, room) if step else logits[:, -1])[0]
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            inputs = torch.tensor([[tokens[-1]]])
        return tokens, torch.stack(rows)


class _WrongRightAfter(LeftPaddedBatched):
    """Wrong only on a call of one kind right after a call of another (`after(rows, n, prompts before it)` of the call
    before, and `on(rows, n, prompts before it)`): the first row then loses its first token (an offset left by the
    call before)."""

    kv_declaration = Declaration(batching=True, description="test engine: wrong on one pair of call kinds")

    def __init__(self, spec):
        super().__init__(spec)
        self.last, self.seen = None, set()

    def generate(self, prompts, max_new_tokens):
        rows = [tuple(p) for p in prompts]
        last, self.last = self.last, (rows, max_new_tokens, frozenset(self.seen))
        hit = last is not None and self.after(*last) and self.on(rows, max_new_tokens, self.seen)
        self.seen |= set(rows)
        if hit and len(rows[0]) > 1:
            return super().generate([list(rows[0][1:])] + [list(r) for r in rows[1:]], max_new_tokens)
        return super().generate(prompts, max_new_tokens)


class WrongBatchOf2AfterLongSingle(_WrongRightAfter):
    """A batch of exactly 2 right after a single prompt of 128-255 tokens."""

    def after(self, rows, n, seen):
        return len(rows) == 1 and 128 <= len(rows[0]) <= 255

    def on(self, rows, n, seen):
        return len(rows) == 2


class WrongRepeatAfterBatchOf4(_WrongRightAfter):
    """A single exact repeat of an earlier prompt right after a batch of 4."""

    def after(self, rows, n, seen):
        return len(rows) == 4

    def on(self, rows, n, seen):
        return len(rows) == 1 and rows[0] in seen


class WrongLongDecodeAfterShortRows(_WrongRightAfter):
    """A call decoding more than 32 tokens right after a call whose shortest row had 2-15 tokens."""

    def after(self, rows, n, seen):
        return 2 <= min(map(len, rows)) <= 15

    def on(self, rows, n, seen):
        return n > 32


class WrongShortSingleAfterLongDecode(_WrongRightAfter):
    """A single prompt of 2-15 tokens right after a batch of 3 that decoded more than 32 tokens."""

    def after(self, rows, n, seen):
        return len(rows) == 3 and n > 32

    def on(self, rows, n, seen):
        return len(rows) == 1 and 2 <= len(rows[0]) <= 15


class WrongBatchOf2AfterLongRepeat(_WrongRightAfter):
    """A batch of exactly 2 whose shortest row has 32-63 tokens right after a call whose first row repeated an earlier
    prompt exactly and that decoded more than 32 tokens (four factors: the call before's relation and new tokens,
    this call's rows and length class)."""

    def after(self, rows, n, seen):
        return rows[0] in seen and n > 32

    def on(self, rows, n, seen):
        return len(rows) == 2 and 32 <= min(map(len, rows)) <= 63


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("PaddingKeptPerBatchSize", "WrongSingleAfterBatchOf3", "RecompilesPastWarmupSteps",
    "WrongBatchOf2AfterLongSingle", "WrongRepeatAfterBatchOf4", "WrongLongDecodeAfterShortRows",
    "WrongShortSingleAfterLongDecode", "WrongBatchOf2AfterLongRepeat")
MUST_PASS: tuple[str, ...] = ()
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
