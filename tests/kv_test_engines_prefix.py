"""Twins of issue 41: the paged prefix cache of reference_impls/paged_prefix.py with one realistic bug each, a bounded
cache that grows to its capacity (correct, and twins declaring it wrongly), and a decode buffer that wraps.

Each bug is one overridden step of `PagedPrefixCache`; tests/test_prefix_cache.py runs them through the suites.
They run uncompiled (`step` itself): the bugs are in the bookkeeping, not in what dynamo does."""

import dataclasses

import torch

from pytest_kvcompile import Declaration, PrefixCache
from reference_impls.paged_prefix import BLOCK_SIZE, BlockManager, PagedPrefixCache, Sequence, step


class PagedEager(PagedPrefixCache):
    """Correct: ref-paged-prefix with its step run eagerly (a fast twin base)."""

    kv_declaration = dataclasses.replace(PagedPrefixCache.kv_declaration, compiled=False,
                                         description="test engine: ref-paged-prefix, eager")

    def __init__(self, spec, num_blocks=None):
        super().__init__(spec, **({"num_blocks": num_blocks} if num_blocks else {}))
        self.compiled_step = step


class StaleFullHitLogits(PagedEager):
    """Bug: keeps the logits of each prompt's last position under the key of the prompt's last full block, and answers a
    prompt whose every block is cached with them instead of computing its last token: a prompt ending where an
    earlier, longer prompt's last full block ends gets that prompt's end."""

    def __init__(self, spec):
        super().__init__(spec)
        self.stored = {}

    def _admit(self, prompt):
        found, _, _ = self.blocks.match(prompt)
        key = self.blocks.key[found[-1]] if found else None
        if found and len(found) * self.block_size == len(prompt) and key in self.stored:
            for block in found:
                self.blocks.take(block)
            self.active.append(Sequence(list(found), list(prompt), len(prompt)))
            return self.stored[key]
        logits = super()._admit(prompt)
        full = len(prompt) // self.block_size
        if full:
            self.stored[self.blocks.key[self.active[-1].table[full - 1]]] = logits
        return logits


class UnchainedBlocks(BlockManager):
    def chain(self, parent, tokens):
        return hash(tokens)


class UnchainedHashes(PagedEager):
    """Bug: a block is keyed by its own tokens only, not chained over the prefix before it: the same tokens at the
    start of a prompt hit a block computed after another prefix (other positions, other context)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.blocks = UnchainedBlocks(len(self.blocks.refs), self.block_size)


class UnprotectedBlocks(BlockManager):
    def take(self, block):  # a hit neither protects the block from eviction nor refreshes it
        self.refs[block] += 1

    def allocate(self):
        block = super().allocate()
        self.free.pop(block, None)
        return block


class EvictsInUse(PagedEager):
    """Bug: eviction takes the least recently used block even while a call reads it (a cache hit neither references
    it nor refreshes it), so a call whose cached prefix is the oldest overwrites its own prefix."""

    def __init__(self, spec):
        super().__init__(spec)
        self.blocks = UnprotectedBlocks(len(self.blocks.refs), self.block_size)


class NoCopyOnWrite(PagedEager):
    """Bug: a prompt sharing the first tokens of a registered block writes its next tokens into that block itself
    instead of a copy, so the prompt that registered it later reads another prompt's K/V."""

    def _share(self, sequence, block, positions):
        self.blocks.take(block)
        sequence.table.append(block)


class DecodeBufferWraps(PagedEager):
    """Bug: a sequence's generated tokens share a buffer of WRAP positions: from the (WRAP+1)-th on, each new token
    overwrites the oldest generated token's K/V. Right for every call of up to WRAP new tokens."""

    WRAP = 96

    def _slots(self, sequence, length):
        slots, pos, start = super()._slots(sequence, length), torch.arange(length), sequence.prompt
        return slots[torch.where(pos >= start + self.WRAP, start + (pos - start) % self.WRAP, pos)]


# ---------------------------------------------------------------------------------------------- growing, bounded

CAPACITY_BLOCKS, GROW = 64, 8  # a pool growing by 8 blocks of 16 when none is free, up to 64 (1,024 positions)


class GrowingBlocks(BlockManager):
    def grow(self, count):
        first = len(self.refs)
        self.refs += [0] * count
        self.key += [None] * count
        self.parent += [None] * count
        self.tokens += [()] * count
        for block in range(first, first + count):
            self.free[block] = None
            self.free.move_to_end(block, last=False)


class GrowingPrefixCache(PagedEager):
    """Correct and bounded: the pool starts empty and grows by GROW blocks whenever no block is free but registered
    ones (it keeps every prefix while it can), up to CAPACITY_BLOCKS, then evicts (least recently used): memory grows
    with every new prompt until the capacity."""

    kv_declaration = Declaration(
        batching=True, scoring=True, kv_cache_bytes=True,
        prefix_cache=PrefixCache(capacity_tokens=CAPACITY_BLOCKS * BLOCK_SIZE, block_size=BLOCK_SIZE),
        description="test engine: paged prefix cache whose pool grows up to 64 blocks of 16")

    def __init__(self, spec):
        super().__init__(spec, num_blocks=1)
        self.blocks = GrowingBlocks(0, self.block_size)
        for buffers in self.model.pool:
            buffers.k, buffers.v = buffers.k[:0].clone(), buffers.v[:0].clone()

    def _allocate(self):
        first_free = next(iter(self.blocks.free), None)  # unregistered free blocks come first
        if (first_free is None or self.blocks.key[first_free] is not None) and len(self.blocks.refs) < CAPACITY_BLOCKS:
            self.blocks.grow(GROW)
            for buffers in self.model.pool:
                more = GROW * self.block_size
                buffers.k = torch.cat((buffers.k, buffers.k.new_zeros(more, *buffers.k.shape[1:])))
                buffers.v = torch.cat((buffers.v, buffers.v.new_zeros(more, *buffers.v.shape[1:])))
        return super()._allocate()


class PromptOnlyPrefixCache(GrowingPrefixCache):
    """Correct and bounded (issue 59): the same pool, keeping only prompt blocks (registered at admission); generated
    tokens' blocks are released unregistered. It must evict only once the prompts alone have offered more than its
    capacity: counting generated positions as offered calls it a leak."""

    def _finish(self, state):
        for sequence in state.sequences:
            for block in sequence.table:
                self.blocks.release(block)
        self.active = []


class GrowingUndeclared(GrowingPrefixCache):
    """Twin: the same bounded cache declaring no PrefixCache: its growth is a leak to the memory check."""

    kv_declaration = dataclasses.replace(GrowingPrefixCache.kv_declaration, prefix_cache=None)


class CapacityExceeded(GrowingPrefixCache):
    """Twin: declares a quarter of the capacity it grows to."""

    kv_declaration = dataclasses.replace(
        GrowingPrefixCache.kv_declaration,
        prefix_cache=PrefixCache(capacity_tokens=CAPACITY_BLOCKS * BLOCK_SIZE // 4, block_size=BLOCK_SIZE))


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine
# (PagedEager: the twins' base, the built-in reference engine run eagerly; the built-in is what the tests hold to
# passing).
MUST_FAIL = ("StaleFullHitLogits", "UnchainedHashes", "EvictsInUse", "NoCopyOnWrite", "DecodeBufferWraps",
    "GrowingUndeclared", "CapacityExceeded")
MUST_PASS = ("GrowingPrefixCache", "PromptOnlyPrefixCache")
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("PagedEager", "UnchainedBlocks", "UnprotectedBlocks", "GrowingBlocks")
