"""Batch consistency: a prompt continues the same alone and inside a batch of different lengths.

A difference is accepted only when the oracle shows both runs flip on near ties: each run is then
asserted against the oracle by ``kv_engine.check`` (``token_match.assert_tokens_match``, raising
TokenMismatch). tests/test_suites_catch_bugs.py shows it failing on an engine with a padding bug.
"""

import pytest


@pytest.mark.kv_requires("batching")
def test_batch_consistency(kv_engine, kv_oracle, kv_batch, kv_record):
    batched = kv_engine.generate(kv_batch)
    lengths = [len(p) for p in kv_batch]
    for i, prompt in enumerate(kv_batch):
        alone = kv_engine.generate([prompt])[0]
        if alone == batched[i]:
            continue
        step = next(s for s, (a, b) in enumerate(zip(alone, batched[i])) if a != b)
        reference = kv_oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        where = (f"index {i} of a batch of lengths {lengths}, which differs from the same prompt alone at step "
                 f"{step} (alone {alone[step]}, batched {batched[i][step]})")
        kv_engine.check(reference, alone, prompt, f"alone (vs batched: {where})", kv_record)
        kv_engine.check(reference, batched[i], prompt, where, kv_record)
