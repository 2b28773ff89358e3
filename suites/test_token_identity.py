"""Token identity: the engine's greedy continuation equals the oracle's, up to near ties.

The assertion is ``kv_engine.check`` (``token_match.assert_tokens_match``): it raises TokenMismatch with
engine, model, prompt, step, gap and hint. tests/test_suites_catch_bugs.py shows both checks failing on
broken engines (a wrong late token, a padding bug)."""

import pytest


def test_token_identity(kv_engine, kv_oracle, kv_prompt, kv_record):
    got = kv_engine.generate([kv_prompt])[0]
    reference = kv_oracle.reference(kv_prompt.ids, kv_engine.max_new_tokens)
    kv_engine.check(reference, got, kv_prompt, "alone", kv_record)


@pytest.mark.kv_requires("batching")
def test_token_identity_batched(kv_engine, kv_oracle, kv_batch, kv_record):
    outputs = kv_engine.generate(kv_batch)
    lengths = [len(p) for p in kv_batch]
    for i, (prompt, got) in enumerate(zip(kv_batch, outputs)):
        reference = kv_oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        kv_engine.check(reference, got, prompt, f"index {i} of a batch of lengths {lengths}", kv_record)
