"""Prefix caches: KV kept across calls and shared between prompts by prefix (vLLM's automatic prefix caching,
SGLang's radix cache, llama.cpp's prompt cache, paged blocks). Their bugs give a prompt another prompt's state: a block
reused past the shared prefix, a block keyed by its own tokens only (not by what came before it), a cached block
written by a later prompt (no copy-on-write), a full hit answered with stored logits, a block evicted while a call
still reads it.

One engine object serves every call of a check, and every response is judged against the oracle (not only against
the engine's own other answers); a prompt served twice must also agree with itself up to a near tie
(``kv_engine.differs``). Prompt lengths land on block boundaries: k*B-1, k*B and k*B+1 for the block size the engine
declares (``Declaration.prefix_cache = PrefixCache(block_size=B, ...)``), else for B = 1, 16, 32 and 64.

- shared prefixes: two prompts sharing their first k tokens, in both orders, then the first again;
- a full hit: a prompt that is exactly a prefix of an earlier one (block-aligned: every block cached, and its last
  token must still be computed for the first logits), then again;
- a later block after different earlier blocks: x + s + tail, y + s + tail and s + tail, where s fills whole blocks;
- eviction: the cache filled near its capacity (``PrefixCache.capacity_tokens``; undeclared: FLOOD positions), then
  its oldest prompt extended (a call needing blocks while its own cached prefix is the least recently used), more
  prompts past twice the capacity, then the oldest again;
- the same prompt cold, warm, and batched with itself and a prompt sharing its prefix."""

from __future__ import annotations

import pytest

from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.verdicts.failures import Kind, Where, fail

SHARED = (1, 15, 16, 17, 31, 32, 33, 63, 64, 65)  # k*B-1, k*B, k*B+1 of B = 16, 32, 64 (and 1): no declared size
SPANS = (16, 32, 64)  # whole blocks of B = 1, 2, 4, 8, 16, 32, 64: no declared size
TAIL = 8
FLOOD = 2048  # positions offered to an engine declaring no capacity (vLLM's smallest CPU pools hold more: declare it)
FLOOD_LENGTH = 256  # the flood's prompt length, or less where the model's positions end sooner
MAX_FLOOD_CALLS = 40


def _block(kv_engine) -> int | None:
    declared = kv_engine.ref.declaration.prefix_cache
    return declared.block_size if declared else None


def _fits(kv_engine, lengths) -> tuple[int, ...]:
    """`lengths` whose prompts (plus TAIL and the new tokens) fit the model's positions."""
    limit = kv_engine.max_positions or 10**9
    return tuple(n for n in lengths if n >= 1 and n + TAIL + kv_engine.max_new_tokens <= limit)


def _boundaries(kv_engine) -> tuple[int, ...]:
    block = _block(kv_engine)
    lengths = SHARED if block is None else sorted({1} | {k * block + d for k in (1, 2) for d in (-1, 0, 1)})
    return _fits(kv_engine, lengths)


def _judge(kv_engine, oracle, check_tokens, prompt: Prompt, got: list[int], where: Where,
           earlier: tuple[list[int], str] | None = None) -> None:
    """One answer: against the oracle where there is one, and against the prompt's `earlier` answer (its tokens and
    when they came, in words): the same prompt must not be served different state (beyond a near tie)."""
    reference = None
    if oracle is not None:
        reference = oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        check_tokens(reference, got, prompt, where)
    if earlier is not None and (why := kv_engine.differs(prompt, earlier[0], got, reference)):
        fail(Kind.INCONSISTENT,
             f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{prompt.name}' gave {earlier[0]} "
             f"{earlier[1]} and {got} at {where.describe()} (they differ {why}): a prefix cache or reused KV blocks "
             "serve different state for the same prompt")


def _serve(kv_engine, oracle, check_tokens, calls: list[Prompt], note: str) -> None:
    """Each prompt alone, in order, on one engine object: judged against the oracle, and against its earlier answer."""
    served: dict[str, tuple[list[int], str]] = {}
    for i, prompt in enumerate(calls):
        got = kv_engine.generate([prompt])[0]
        where = Where(number=i + 1, calls=len(calls), before=tuple(p.name for p in calls[max(0, i - 3):i]), note=note)
        _judge(kv_engine, oracle, check_tokens, prompt, got, where, served.get(prompt.name))
        served.setdefault(prompt.name, (got, f"on call {i + 1}"))


def _pair(k: int, vocab: int) -> tuple[Prompt, Prompt]:
    shared = of_length(k, vocab, salt=40).ids
    a = of_length(TAIL, vocab, salt=41).ids
    b = tuple((t + 1 + i) % vocab for i, t in enumerate(a))  # differs from `a` at every tail position
    return Prompt(f"shared{k}+a", shared + a), Prompt(f"shared{k}+b", shared + b)


def test_shared_prefixes(kv_engine, kv_oracle_or_none, kv_check_tokens):
    """Two prompts sharing their first k tokens, a b b a, for every boundary k; then the first of all again."""
    vocab = kv_engine.spec.vocab_size
    calls = []
    for k in _boundaries(kv_engine):
        a, b = _pair(k, vocab)
        calls += [a, b, b, a]
    calls.append(calls[0])
    _serve(kv_engine, kv_oracle_or_none, kv_check_tokens, calls, "shared-prefix check")


def test_full_hit(kv_engine, kv_oracle_or_none, kv_check_tokens):
    """A prompt that is exactly a prefix of an earlier, longer one, then again: at k*B every block of it is cached (a
    full hit), and its first token needs the logits of its own last position, computed anew (vLLM recomputes it)."""
    vocab = kv_engine.spec.vocab_size
    calls = []
    for n in _boundaries(kv_engine):
        longer = of_length(n + TAIL, vocab, salt=50).ids
        prefix = Prompt(f"hit{n}", longer[:n])
        calls += [Prompt(f"hit{n}+tail", longer), prefix, prefix]
    _serve(kv_engine, kv_oracle_or_none, kv_check_tokens, calls, "full-hit check: a prompt that is an earlier "
           "prompt's prefix")


def test_later_block_after_different_prefix(kv_engine, kv_oracle_or_none, kv_check_tokens):
    """x + s + tail, y + s + tail, s + tail, then x + s + tail again (x, y, s of n tokens: whole blocks): s's blocks
    hold other K/V after y than after x, and at the start, so a block keyed by its own tokens (not chained over the
    prefix) gives a later prompt an earlier one's."""
    vocab, block = kv_engine.spec.vocab_size, _block(kv_engine)
    limit = kv_engine.max_positions or 10**9
    calls = []
    for n in SPANS if block is None else (block, 2 * block):
        if 2 * n + TAIL + kv_engine.max_new_tokens > limit:
            continue
        shared, tail = of_length(n, vocab, salt=62).ids, of_length(TAIL, vocab, salt=63).ids
        x = Prompt(f"x{n}+s{n}+tail", of_length(n, vocab, salt=60).ids + shared + tail)
        y = Prompt(f"y{n}+s{n}+tail", of_length(n, vocab, salt=61).ids + shared + tail)
        calls += [x, y, Prompt(f"s{n}+tail", shared + tail), x]
    if not calls:
        pytest.skip(f"model '{kv_engine.spec.name}' has too few positions for two blocks and a tail")
    _serve(kv_engine, kv_oracle_or_none, kv_check_tokens, calls, "a shared block after different earlier blocks")


def test_eviction(kv_engine, kv_oracle_or_none, kv_check_tokens):
    """The cache filled to within one call of its capacity, then its oldest prompt extended (its cached prefix is the
    least recently used while the call needs new blocks: evicting it under the call breaks the call), prompts past
    twice the capacity, then the oldest again (evicted by now, or still right). How full "full" is depends on what the
    engine caches (prompt and generated positions here); every answer is judged either way."""
    declared = kv_engine.ref.declaration.prefix_cache
    capacity = declared.capacity_tokens if declared else FLOOD
    limit = kv_engine.max_positions or 10**9
    block = _block(kv_engine) or 16
    length = min(FLOOD_LENGTH, (limit - kv_engine.max_new_tokens) // 2) // block * block
    per_call = length + kv_engine.max_new_tokens
    fill = more = max(1, capacity // per_call)  # filled to within one call of its capacity, then past it twice
    if length < block or fill + more + 2 > MAX_FLOOD_CALLS:
        pytest.skip(f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': overflowing a cache of "
                    f"{capacity} positions{' (its declared PrefixCache)' if declared else ''} takes {fill + more + 2} "
                    f"prompts of {length} tokens, more than {MAX_FLOOD_CALLS}: build the engine with a smaller cache "
                    "for the suite")
    vocab = kv_engine.spec.vocab_size
    flood = [Prompt(f"flood{i}/{length}", of_length(length, vocab, salt=70 + i).ids) for i in range(fill + more)]
    extended = Prompt(f"flood0+{length}", flood[0].ids + of_length(length, vocab, salt=69).ids)
    calls = [*flood[:fill], extended, *flood[fill:], flood[0]]
    held = f"{capacity} positions ({'declared' if declared else 'no PrefixCache declared: the suite assumes'})"
    _serve(kv_engine, kv_oracle_or_none, kv_check_tokens, calls, f"eviction check, a cache of {held}")


@pytest.mark.kv_requires("batching")
def test_shared_prefixes_batched(kv_engine, kv_oracle_or_none, kv_check_tokens):
    """Prompts sharing a prefix inside one batch (a prefix cache may share their blocks within the call)."""
    vocab = kv_engine.spec.vocab_size
    for k in (16, 17, 33):
        a, b = _pair(k, vocab)
        batch = [a, b, Prompt(f"shared{k}", a.ids[:k])]
        lengths = tuple(len(p) for p in batch)
        outputs = kv_engine.generate(batch)
        alone = [kv_engine.generate([p])[0] for p in batch]
        for i, (prompt, got) in enumerate(zip(batch, outputs)):
            where = Where(index=i, lengths=lengths, note=f"sharing their first {k} tokens")
            _judge(kv_engine, kv_oracle_or_none, kv_check_tokens, prompt, got, where, (alone[i], "alone"))


@pytest.mark.kv_requires("batching")
def test_cold_warm_alone_batched(kv_engine, kv_oracle_or_none, kv_check_tokens):
    """One prompt cold (never seen), warm (again), then in a batch with itself and a prompt sharing its first B+1
    tokens, then that prompt alone: every response against the oracle and against the prompt's first answer."""
    vocab, block = kv_engine.spec.vocab_size, _block(kv_engine) or 16
    first = Prompt(f"cold{2 * block + 3}", of_length(2 * block + 3, vocab, salt=80).ids)
    other = Prompt(f"cold{block + 1}+tail", first.ids[:block + 1] + of_length(TAIL, vocab, salt=81).ids)
    if not _fits(kv_engine, [len(first), len(other)]):
        pytest.skip(f"model '{kv_engine.spec.name}' has too few positions for prompts of {len(first)} tokens")
    answers: dict[str, tuple[list[int], str]] = {}
    calls = [[first], [first], [first, other, first], [other]]
    for number, call in enumerate(calls, 1):
        lengths = tuple(len(p) for p in call)
        for i, (prompt, got) in enumerate(zip(call, kv_engine.generate(call))):
            where = Where(index=i, lengths=lengths, number=number, calls=len(calls),
                          note=("cold" if number == 1 else "warm") + ", cold/warm check")
            _judge(kv_engine, kv_oracle_or_none, kv_check_tokens, prompt, got, where, answers.get(prompt.name))
            answers.setdefault(prompt.name, (got, "first"))
