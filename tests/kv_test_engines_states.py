"""Engines for the hybrid models' recurrent state (issue 70; docs/state-caches.md): a correct greedy loop whose
prefill runs in chunks through transformers' cache, and one state bug each from the engines that serve these models.
Each must fail the suites on the zoo's recurrent models (tests/test_states.py) while the correct one passes.

The bugs live in the state, never in K/V: most twins change a recurrent layer's `conv_states` or
`recurrent_states` (transformers' LinearAttentionLayer) and leave the attention layers as they are; the last two
break the state snapshots of our own references (ref-paged-prefix resuming a prefix hit between snapshots,
ref-speculative keeping the state its rejected drafts advanced).
"""

import torch
from transformers import DynamicCache

from kv_test_engines import Greedy
from kv_test_engines_prefix import PagedEager
from pytest_kvcompile import Declaration
from pytest_kvcompile.models.checkpoints import positions, with_cache
from reference_impls.speculative import SpeculativeDecoding

CHUNK = 16  # prefill chunk: the suites' prompts of 48 cross two boundaries, each inside the conv window of 4


def state_layers(cache):
    """The cache's recurrent layers (those holding conv and recurrent states)."""
    return [layer for layer in cache.layers if hasattr(layer, "conv_states")]


class ChunkedState(Greedy):
    """Correct: a fresh DynamicCache per prompt, the prompt prefilled CHUNK tokens at a time through it (the conv window
    and the recurrent state carried from chunk to chunk), then greedy decoding."""

    kv_declaration = Declaration(batching=True, scoring=True,
                                 description="test engine: chunked prefill through transformers' hybrid cache")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        cache = self.fresh_cache()
        rows, tokens = [], []
        for start in range(0, len(prompt), CHUNK):
            chunk = prompt[start:start + CHUNK]
            logits = self.model(input_ids=torch.tensor([chunk]), **with_cache(cache), use_cache=True,
                                **self.positions(start, len(chunk))).logits[0, -1]
            self.after_chunk(cache, start + CHUNK >= len(prompt))
        for step in range(steps):
            if step:
                logits = self.model(input_ids=torch.tensor([[tokens[-1]]]), **with_cache(cache), use_cache=True,
                                    **self.positions(len(prompt) + step - 1, 1)).logits[0, -1]
            self.after_step(cache)
            rows.append(logits)
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
        self.last = cache
        return tokens, torch.stack(rows)

    def fresh_cache(self):
        return DynamicCache(config=self.model.config)

    def positions(self, start, length):
        return positions(start, length)

    def after_chunk(self, cache, last: bool):
        """Where a twin breaks the state between prefill chunks."""

    def after_step(self, cache):
        """Where a twin breaks the state after each forward of the decode."""


class NoPositionIds(ChunkedState):
    """Bug (transformers 5.24's on Bamba, found by this suite): the forwards get no position_ids, and BambaModel then
    numbers each forward's tokens from 0 whatever its cache holds (Nemotron-H, Falcon-H1, Zamba add the cache's
    length): every decode step's attention layers rotate the new token as position 0. generate() passes them, so
    transformers' own engines are right; a user's decode loop that leaves them to the model is not."""

    def positions(self, start, length):
        return {}


class ConvWindowLostAcrossChunks(ChunkedState):
    """Bug: the conv window is not carried from one prefill chunk to the next (zeroed, as a fresh request's), so the
    first K-1 inputs of every later chunk convolve with zeros instead of the previous chunk's last inputs."""

    def after_chunk(self, cache, last):
        if not last:
            for layer in state_layers(cache):
                for conv in layer.conv_states.values():
                    conv.zero_()


class StateSlotNotZeroed(ChunkedState):
    """Bug: a finished request's state slot is handed to the next request without zeroing: its conv window and
    recurrent state start from the previous request's last values (vLLM's and SGLang's state pools index slots)."""

    last = None

    def fresh_cache(self):
        cache = DynamicCache(config=self.model.config)
        if self.last is not None:
            for new, old in zip(cache.layers, self.last.layers):
                if hasattr(old, "conv_states"):
                    for i in old.conv_states:
                        new.lazy_initialization(conv_states=old.conv_states[i].clone(),
                                                recurrent_states=old.recurrent_states[i], state_idx=i)
                        new.conv_states[i].copy_(old.conv_states[i])
                        new.recurrent_states[i].copy_(old.recurrent_states[i])
                        new.has_previous_state[i] = True
        return cache


class StateStoredInBfloat16(ChunkedState):
    """Bug: the recurrent state is stored in bfloat16 between forwards in a float32 run, undeclared (vLLM's
    mamba_ssm_cache_dtype 'auto' on a model whose reference keeps it float32: PR #36649)."""

    def after_chunk(self, cache, last):
        self.after_step(cache)

    def after_step(self, cache):
        for layer in state_layers(cache):
            for state in layer.recurrent_states.values():
                if state is not None:
                    state.copy_(state.to(torch.bfloat16))


class SnapshotGapNotRecomputed(PagedEager):
    """Bug (ref-paged-prefix on a hybrid model): a prefix hit takes the K/V of every shared position, the last block's
    in part through copy-on-write, and the recurrent states from the snapshot at the end of the last whole block,
    without running the positions in between through them: the state misses the gap (the mamba prefix-cache bugs,
    vLLM #43559, SGLang PR #16053)."""

    def _hit(self, prompt):
        return self.blocks.match(prompt[:-1])


class StateAdvancedByRejectedDrafts(SpeculativeDecoding):
    """Bug (ref-speculative on a hybrid model): the rejected drafts' K/V is dropped, but each row's recurrent state
    goes on from the one after every token the verify step ran, rejected drafts included (vLLM #43559's MTP half)."""

    def _state_at(self, keep, fed):
        return torch.tensor([max(len(row), 1) - 1 for row in fed], device=keep.device)


# The roles of this module's engines (tests/test_tiers.py)
MUST_FAIL = ("NoPositionIds", "ConvWindowLostAcrossChunks", "StateSlotNotZeroed", "StateStoredInBfloat16",
             "SnapshotGapNotRecomputed", "StateAdvancedByRejectedDrafts")
MUST_PASS = ("ChunkedState",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("state_layers",)
