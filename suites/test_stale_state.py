"""Stale state: one engine object fed different prompts back to back (same shapes included), each prompt twice
after different predecessors, gives what fresh runs give. Static caches that are not reset between calls, prefix
caches keyed wrongly and positions carried across calls fail here.

With an oracle every call is verified (``kv_check_tokens``); without one (a strategy declaring none) the check is
oracle-free: each prompt must give the same tokens both times, up to a near tie on the engine's own score()
(``kv_engine.differs``)."""

import pytest

from pytest_kvcompile.models.prompts import variant
from pytest_kvcompile.verdicts.failures import Kind, Where, fail


def test_stale_state(kv_engine, kv_oracle_or_none, kv_prompts, kv_check_tokens):
    long = max((p for p in kv_prompts if len(p) <= 64), key=len)
    short = min(kv_prompts, key=len)
    other = variant(long, kv_engine.spec.vocab_size, salt=1)
    sequence = [long, other, short, long, short, other]
    seen, first = [], {}
    for call, prompt in enumerate(sequence):
        got = kv_engine.generate([prompt])[0]
        where = Where(number=call + 1, calls=len(sequence), before=tuple(seen))
        reference = None
        if kv_oracle_or_none is not None:
            reference = kv_oracle_or_none.reference(prompt.ids, kv_engine.max_new_tokens)
            kv_check_tokens(reference, got, prompt, where)
        if prompt.name in first:
            before, when = first[prompt.name]
            why = kv_engine.differs(prompt, before, got, reference)
            if why:
                fail(Kind.INCONSISTENT,
                     f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{prompt.name}' "
                     f"gave {before} "
                     f"on call {when + 1} but {got} on {where.describe()} (they differ {why}): state leaks between "
                     f"generate() calls\n{kv_engine.served(len(kv_engine.history) - 1)}")
        else:
            first[prompt.name] = (got, call)
        seen.append(f"{prompt.name} (length {len(prompt)})")


@pytest.mark.kv_requires("batching")
def test_stale_state_batched(kv_engine, kv_oracle_or_none, kv_prompts, kv_check_tokens):
    """A long prompt alone, then a batch whose short prompt is left-padded over the slots the long one used:
    a static cache that forgets to reset which slots are valid shows the old ones to the padded row."""
    long = max((p for p in kv_prompts if len(p) <= 64), key=len)
    short = min(kv_prompts, key=len)
    batch = [short, variant(long, kv_engine.spec.vocab_size, salt=2)]
    fresh = [kv_engine.generate([p])[0] for p in batch]  # each prompt alone, after whatever came before
    kv_engine.generate([long])
    lengths = tuple(len(p) for p in batch)
    for i, (prompt, got) in enumerate(zip(batch, kv_engine.generate(batch))):
        where = Where(index=i, lengths=lengths, before=(f"{long.name} (length {len(long)})",))
        if kv_oracle_or_none is not None:
            reference = kv_oracle_or_none.reference(prompt.ids, kv_engine.max_new_tokens)
            kv_check_tokens(reference, got, prompt, where)
        else:
            why = kv_engine.differs(prompt, fresh[i], got)
            if why:
                fail(Kind.INCONSISTENT,
                     f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{prompt.name}' gave "
                     f"{fresh[i]} alone but {got} at {where.describe()}: they differ {why}")
