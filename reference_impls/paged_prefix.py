"""Reference engine: a paged KV cache with automatic prefix caching (vLLM's design, in short), under torch.compile.

The pool. Per layer, K and V for `num_blocks` blocks of `block_size` (B) positions, allocated once as
[num_blocks * B, kv_heads, head_dim] (the shapes read off one eager step, so every architecture of loader.py fits).
A sequence's block table lists its blocks; position p lives in slot table[p // B] * B + p % B. A step writes its
keys and values at their slots (`index_copy_`) and reads the sequence's keys back through its slots
(`PagedWrites.update`); the mask works on positions (sliding windows are masks: every key is kept).

Prefix caching (`BlockManager`):

- A full block is registered under a key chained over the whole prefix, key_i = hash((key_{i-1}, its B tokens))
  (vLLM's block hash): the same B tokens after another prefix are another block.
- A prompt reuses the registered blocks of its longest cached prefix, its last token excluded: a full hit still
  computes the last token, whose logits start the generation.
- The match may go on inside one more registered block (its first m < B tokens are the prompt's next m): the
  prompt reuses those m positions through a copy of that block (copy-on-write), since it writes its own tokens
  where the registered block holds others.
- A block a call uses is referenced until the call ends; a released block stays registered, to be hit again, until
  the pool runs out: then the least recently used unreferenced block is evicted (its registration dropped). A call
  needing more blocks than are free raises.
- Registered blocks are never written: a call writes only past its cached prefix, into its fresh blocks and its
  copy. What a hit reads is what the registering call wrote.

States (a hybrid model's recurrent layers, bamba.py and qwen3_next.py): a state cannot be sliced to a prefix, so a
prefix hit resumes from a snapshot (vLLM's and SGLang's mamba prefix caches): each block keeps the states after its last
position, taken when a sequence computes past it. A hit on such a model ends at its last whole block (no copy-on-write
part: there is no state to resume from inside a block), the prompt is prefilled block by block from there (each chunk
ends on a block boundary, where its snapshot is taken), and the decode takes one when a sequence fills a block. A
sequence's live states are its own (a fresh one's zeros, a hit's a copy of the snapshot), dropped when the call ends:
what stays is the block pool and one state slot per block (`KVLayout(state_slots=num_blocks)`).

Compiles: one function, `step`, serves the prefill of each prompt (alone: each has its own cached prefix) and the
batched decode; batch, new tokens and keys are `mark_unbacked` (as in compiled_dynamic.py): one compile. Decode rows
are left-padded to the longest (pads read slot 0, masked). The bookkeeping (tables, keys, LRU) is Python between
steps.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pytest_kvcompile.contract.engine import Declaration, KVLayout, ModelSpec, PrefixCache
from pytest_kvcompile.recompiles.hooks import mark_unbacked, torch_check
from reference_impls.compile import compile_fresh
from reference_impls.engine import Engine
from reference_impls.loader import load_model
from reference_impls.model import STATE, KVCache, State, cache_shapes, state_shapes
from reference_impls.static_cache import LayerBuffers

# 2,048 positions: the suites' largest calls (4 prompts of up to 266 positions plus new tokens; a generation up to
# the zoo's 512 positions) fit, with room for the prefixes of earlier calls
BLOCK_SIZE, NUM_BLOCKS = 16, 128


class BlockManager:
    """Which blocks are registered under which key, referenced by how many sequences, and free in which order."""

    def __init__(self, count: int, size: int):
        self.size = size
        self.refs = [0] * count
        self.key: list[int | None] = [None] * count  # block -> its registration, None: unregistered
        self.parent: list[int | None] = [None] * count  # block -> the key before it, when registered
        self.tokens: list[tuple[int, ...]] = [()] * count  # block -> its B tokens, when registered
        self.registered: dict[int, int] = {}  # key -> block
        self.after: defaultdict[int | None, set[int]] = defaultdict(set)  # key -> registered blocks following it
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(count))  # unreferenced: evicted first first

    def chain(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        """A full block's key: its tokens and the key of the block before it (None for a sequence's first block)."""
        return hash((parent, tokens))

    def match(self, tokens: list[int]) -> tuple[list[int], int | None, int]:
        """The registered blocks of the longest cached prefix of `tokens`, then a registered block whose first m < B
        tokens are the next m of `tokens` (None, 0 if there is none)."""
        blocks: list[int] = []
        parent = None
        for start in range(0, len(tokens) - self.size + 1, self.size):
            block = self.registered.get(self.chain(parent, tuple(tokens[start:start + self.size])))
            if block is None:
                break
            blocks.append(block)
            parent = self.key[block]
        rest = tokens[len(blocks) * self.size:][:self.size]
        best, shared = None, 0
        for block in self.after[parent]:
            m = next((i for i, (a, b) in enumerate(zip(self.tokens[block], rest)) if a != b), len(rest))
            if m > shared:
                best, shared = block, m
        return blocks, best, shared

    def take(self, block: int) -> None:
        self.refs[block] += 1
        self.free.pop(block, None)

    def allocate(self) -> int:
        """A free block, unregistered ones first, else the least recently used registered one (evicted)."""
        if not self.free:
            raise RuntimeError(f"paged KV cache: all {len(self.refs)} blocks of {self.size} positions are in use by "
                               "this call; build the engine with more num_blocks")
        block = next(iter(self.free))
        if self.key[block] is not None:
            del self.registered[self.key[block]]
            self.after[self.parent[block]].discard(block)
            self.key[block] = None
        self.take(block)
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None  # the most recently used
            if self.key[block] is None:
                self.free.move_to_end(block, last=False)  # holds nothing to hit: reused first

    def register(self, table: list[int], tokens: list[int]) -> None:
        """Register every full block of a sequence (`tokens` written into `table`) not registered yet."""
        parent = None
        for i, block in enumerate(table[:len(tokens) // self.size]):
            block_tokens = tuple(tokens[i * self.size:(i + 1) * self.size])
            key = self.chain(parent, block_tokens)
            if self.key[block] is None and key not in self.registered:  # a duplicate's copy stays unregistered
                self.registered[key], self.key[block] = block, key
                self.parent[block], self.tokens[block] = parent, block_tokens
                self.after[parent].add(block)
            parent = key


class PagedWrites(KVCache):
    """One step over the pool: `update` writes a layer's new keys and values [b, t, kv_heads, d] at slots `write`
    [b * t] and returns the layer's keys and values at slots `read` [b, n] (every row's keys, left-padded); a
    recurrent layer reads its rows' `states` and leaves the new ones in `new_states`."""

    def __init__(self, pool: nn.ModuleList, write, read, states: dict[int, State]):
        self.pool, self.write, self.read, self.states = pool, write, read, states
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per caching layer (Gemma4's shared layers read)
        self.new_states: list[State] = []

    def state(self, layer):
        return self.states[layer]

    def update_state(self, layer, state):
        self.new_states.append(state)

    def update(self, layer, k, v):
        buffers = self.pool[len(self.layers)]
        buffers.k.index_copy_(0, self.write, k.flatten(0, 1))
        buffers.v.index_copy_(0, self.write, v.flatten(0, 1))
        self.layers.append((buffers.k[self.read], buffers.v[self.read]))
        return self.layers[-1]


class StateSlots(nn.Module):
    """One recurrent layer's state snapshots, one slot per block: conv [blocks, K-1, channels], ssm [blocks, ...]."""

    def __init__(self, row: State, count: int):
        super().__init__()
        self.register_buffer("conv", row.conv.new_zeros(count, *row.conv.shape[1:]), persistent=False)
        self.register_buffer("ssm", row.ssm.new_zeros(count, *row.ssm.shape[1:]), persistent=False)

    def load(self, slot: int) -> State:
        return State(self.conv[slot:slot + 1].clone(), self.ssm[slot:slot + 1].clone())

    def save(self, slot: int, state: State) -> None:
        self.conv[slot], self.ssm[slot] = state.conv[0], state.ssm[0]


class PagedModel(nn.Module):
    """A model of loader.py over the block pool: one step of any rows (`forward`)."""

    def __init__(self, llm: nn.Module, slots: int, blocks: int):
        super().__init__()
        self.llm = llm
        weight = llm.lm_head.weight
        self.pool = nn.ModuleList(LayerBuffers((slots, *k), weight.dtype, weight.device, (slots, *v))
                                  for k, v in cache_shapes(llm))  # every layer with a cache of its own
        self.recurrent = [i for i, kind in enumerate(llm.layer_types) if kind == STATE]
        self.zeros = state_shapes(llm)  # a fresh row's states, per recurrent layer
        self.snapshots = nn.ModuleList(StateSlots(row, blocks) for row in self.zeros)

    def forward(self, tokens, q_pos, k_pos, valid, write, read, states):
        """Last-position logits [b, vocab] of tokens [b, t] at positions q_pos [b, t], written at slots write [b * t],
        attending over the keys at slots read [b, n] (positions k_pos, real where valid; the last t are the new), and
        each recurrent layer's states after them, from `states` (per recurrent layer, [b, ...])."""
        b, t = tokens.shape
        n = read.size(1)
        torch_check(t >= 1)
        torch_check(n >= t)
        for x in (q_pos, k_pos, valid, read):
            torch_check(x.size(0) == b)
        torch_check(q_pos.size(1) == t)
        torch_check(k_pos.size(1) == n)
        torch_check(valid.size(1) == n)
        torch_check(write.size(0) == b * t)
        for state in states:
            for x in state:
                torch_check(x.size(0) == b)
        masks = self.llm.masks(q_pos, k_pos, valid)
        cache = PagedWrites(self.pool, write, read, dict(zip(self.recurrent, states)))
        return self.llm.run(tokens, q_pos, masks, cache), cache.new_states


def step(model, tokens, q_pos, k_pos, valid, write, read, states):
    return model(tokens, q_pos, k_pos, valid, write, read, states)


@dataclass
class Sequence:
    """One prompt of a call: its blocks in position order, the tokens written into them, its prompt's length, and its
    recurrent layers' states after them (one row each)."""

    table: list[int]
    tokens: list[int]
    prompt: int
    states: list[State] = field(default_factory=list)


@dataclass
class PagedState:
    sequences: list[Sequence]
    cache: list = field(default_factory=list)  # the base Engine's slot for per-layer K/V: the pool is counted instead


class PagedPrefixCache(Engine):
    """`ref-paged-prefix`: greedy generation over a paged KV cache shared across calls by prefix (module docstring)."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        compiled=True,
        kv_layout=KVLayout("static", max_cache_len=NUM_BLOCKS * BLOCK_SIZE, rows=1, windowed=False,
                           conv_window_offset=-1, state_slots=NUM_BLOCKS),
        prefix_cache=PrefixCache(capacity_tokens=NUM_BLOCKS * BLOCK_SIZE, block_size=BLOCK_SIZE),
        description=f"reference: paged KV cache ({NUM_BLOCKS} blocks of {BLOCK_SIZE}), automatic prefix caching "
                    "(chained block hashes, full hits recompute the last token, copy-on-write, LRU eviction; a "
                    "hybrid model's recurrent states snapshotted per block, a hit resuming from its last whole "
                    "block), torch.compile with unbacked dynamic shapes",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", block_size: int = BLOCK_SIZE,
                 num_blocks: int = NUM_BLOCKS):
        self.spec, self.block_size = spec, block_size
        self.model = PagedModel(load_model(spec, states=True), num_blocks * block_size, num_blocks)
        self.blocks = BlockManager(num_blocks, block_size)
        self.compiled_step = compile_fresh(step, compile_backend, writes_buffers=True)
        self.active: list[Sequence] = []  # the sequences of the call under way (released when it ends)

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, PagedState]:
        """Each prompt alone over its cached prefix, registered for the next prompts at once: last logits [b, vocab]."""
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        self._finish(PagedState(self.active))  # a call that raised half-way still holds its blocks
        return torch.stack([self._admit(list(prompt)) for prompt in prompts]), PagedState(self.active)

    def _admit(self, prompt: list[int]) -> torch.Tensor:
        """Start a sequence for `prompt` over its longest cached prefix (its last token excluded): the logits of its
        last position."""
        found, partial, shared = self._hit(prompt)
        for block in found:
            self.blocks.take(block)
        sequence = Sequence(list(found), prompt[:len(found) * self.block_size], len(prompt), self._resume(found))
        self.active.append(sequence)
        if partial is not None:
            self._share(sequence, partial, shared)
            sequence.tokens += prompt[len(sequence.tokens):len(sequence.tokens) + shared]
        rest = prompt[len(sequence.tokens):]
        while rest:  # at once; a model with states up to each block's end, where its snapshot is taken
            cut = self.block_size - len(sequence.tokens) % self.block_size if self.model.recurrent else len(rest)
            logits = self._step([sequence], [rest[:cut]])[0]
            rest = rest[cut:]
        self.blocks.register(sequence.table, sequence.tokens)
        return logits

    def _hit(self, prompt: list[int]) -> tuple[list[int], int | None, int]:
        """What `prompt` resumes from (`BlockManager.match`, its last token excluded); a model with recurrent layers
        only from the end of its last whole block, where a state snapshot was taken (no partial block)."""
        found, partial, shared = self.blocks.match(prompt[:-1])
        return (found, None, 0) if self.model.recurrent else (found, partial, shared)

    def _resume(self, found: list[int]) -> list[State]:
        """A new sequence's recurrent states: the snapshot at the end of its last cached block, or zeros."""
        if not found:
            return [State(*(x.clone() for x in row)) for row in self.model.zeros]
        return [slots.load(found[-1]) for slots in self.model.snapshots]

    def _share(self, sequence: Sequence, block: int, positions: int) -> None:
        """Copy-on-write: `sequence` reuses the first `positions` of a registered block through a copy of them, since
        it goes on writing where the registered block holds other tokens."""
        copy = self._allocate()
        src, dst = block * self.block_size, copy * self.block_size
        for buffers in self.model.pool:
            buffers.k[dst:dst + positions] = buffers.k[src:src + positions]
            buffers.v[dst:dst + positions] = buffers.v[src:src + positions]
        sequence.table.append(copy)

    def _allocate(self) -> int:
        return self.blocks.allocate()

    def _decode(self, tokens: torch.Tensor, state: PagedState) -> tuple[torch.Tensor, PagedState]:
        return self._step(state.sequences, [[token] for token in tokens.tolist()]), state

    def _finish(self, state: PagedState) -> None:
        """The call is over: register its sequences' full blocks (generated tokens included), release them all."""
        for sequence in state.sequences:
            self.blocks.register(sequence.table, sequence.tokens)
            for block in sequence.table:
                self.blocks.release(block)
            sequence.states = []  # what stays is the blocks' snapshots
        self.active = []

    def _slots(self, sequence: Sequence, length: int) -> torch.Tensor:
        """The slots of positions 0..length-1 of `sequence`, allocating the blocks it does not have yet."""
        while len(sequence.table) * self.block_size < length:
            sequence.table.append(self._allocate())
        pos = torch.arange(length)
        return torch.tensor(sequence.table)[pos // self.block_size] * self.block_size + pos % self.block_size

    def _step(self, sequences: list[Sequence], new: list[list[int]]) -> torch.Tensor:
        """Feed `new[i]` (the same count per row) to sequences[i]: last logits [rows, vocab]."""
        t = len(new[0])
        n = max(len(s.tokens) for s in sequences) + t
        rows = []
        for sequence, tokens in zip(sequences, new):
            start, end = len(sequence.tokens), len(sequence.tokens) + t
            slots, pad = self._slots(sequence, end), n - end
            rows.append((F.pad(slots, (pad, 0)), F.pad(torch.arange(end), (pad, 0)),
                         F.pad(torch.ones(end, dtype=torch.bool), (pad, 0)), slots[start:], torch.arange(start, end)))
            sequence.tokens += tokens
        read, k_pos, valid, write, q_pos = (torch.stack(x).to(self.spec.device) for x in zip(*rows))
        inputs = (torch.tensor(new, device=self.spec.device), q_pos, k_pos, valid, write.flatten(), read)
        for x in inputs:
            for dim in range(x.dim()):
                mark_unbacked(x, dim)
        states = [State(*(torch.cat(parts) for parts in zip(*layer)))  # per recurrent layer: every row's
                  for layer in zip(*(sequence.states for sequence in sequences))]
        for state in states:
            for x in state:
                mark_unbacked(x, 0)
        logits, states = self.compiled_step(self.model, *inputs, states)
        self._keep(sequences, states)
        return logits

    def _keep(self, sequences: list[Sequence], states: list[State]) -> None:
        """Each row's states after the step; where a row has just filled a block, its snapshot."""
        for row, sequence in enumerate(sequences):
            sequence.states = [State(*(x[row:row + 1].clone() for x in state)) for state in states]
            if states and len(sequence.tokens) % self.block_size == 0:
                block = sequence.table[len(sequence.tokens) // self.block_size - 1]
                for slots, state in zip(self.model.snapshots, sequence.states):
                    slots.save(block, state)

    def kv_cache_bytes(self) -> int:
        """Bytes of the pool (num_blocks x block_size positions x layers with a cache x K and V, whatever is in use)
        and of the recurrent layers' state slots (one per block)."""
        buffers = [x for layer in self.model.pool for x in (layer.k, layer.v)]
        buffers += [x for slots in self.model.snapshots for x in (slots.conv, slots.ssm)]
        return sum(x.numel() * x.element_size() for x in buffers)
