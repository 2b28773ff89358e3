"""Stale state: one engine object fed different prompts back to back (same shapes included)
gives what fresh runs give. Static caches that are not reset between calls fail here."""

import pytest

from pytest_kvcompile.prompts import variant


def test_stale_state(kv_engine, kv_oracle, kv_prompts, kv_record):
    long = max(kv_prompts, key=len)
    short = min(kv_prompts, key=len)
    sequence = [long, variant(long, kv_engine.spec.vocab_size, salt=1), short, long]
    seen = []
    results = []
    for call, prompt in enumerate(sequence):
        got = kv_engine.generate([prompt])[0]
        reference = kv_oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        where = f"call {call + 1} of {len(sequence)} on one engine object, after prompts {seen or '(none)'}"
        kv_engine.check(reference, got, prompt, where, kv_record)
        seen.append(f"{prompt.name} (length {len(prompt)})")
        results.append(got)
    assert results[0] == results[-1], (
        f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{long.name}' gave {results[0]} on call 1 "
        f"but {results[-1]} on call {len(sequence)} (after {seen[1:-1]}): state leaks between generate() calls"
    )


@pytest.mark.kv_requires("batching")
def test_stale_state_batched(kv_engine, kv_oracle, kv_prompts, kv_record):
    """A long prompt alone, then a batch whose short prompt is left-padded over the slots the long one used:
    a static cache that forgets to reset which slots are valid shows the old ones to the padded row."""
    long, short = max(kv_prompts, key=len), min(kv_prompts, key=len)
    kv_engine.generate([long])
    batch = [short, variant(long, kv_engine.spec.vocab_size, salt=2)]
    lengths = [len(p) for p in batch]
    for i, (prompt, got) in enumerate(zip(batch, kv_engine.generate(batch))):
        reference = kv_oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        kv_engine.check(reference, got, prompt, f"index {i} of a batch of lengths {lengths}, on one engine object "
                        f"after prompts ['{long.name} (length {len(long)})']", kv_record)
