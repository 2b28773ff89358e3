"""Token identity: every step of the engine's greedy continuation is the oracle's choice given the engine's own
prefix, or a near tie (within the tie tolerance, at most --kv-max-near-ties per sequence).

The assertion is ``kv_engine.check`` (``token_match.assert_tokens_match``): it raises TokenMismatch with
engine, model, prompt, step, gap and hint. An engine declaring ``scoring`` also has its ``score()`` checked on
the tokens it generated: its rows against the oracle's logits, its argmax against ``generate()``
(``token_match.assert_score_matches``). tests/test_suites_catch_bugs.py and tests/test_verdicts.py show each
check failing on a broken engine."""

import pytest


def test_token_identity(kv_engine, kv_oracle, kv_prompt, kv_check):
    got = kv_engine.generate([kv_prompt])[0]
    reference = kv_oracle.reference(kv_prompt.ids, kv_engine.max_new_tokens)
    kv_check(reference, got, kv_prompt, "alone")
    kv_engine.check_score(reference, got, kv_prompt)


@pytest.mark.kv_requires("batching")
def test_token_identity_batched(kv_engine, kv_oracle, kv_batch, kv_check):
    outputs = kv_engine.generate(kv_batch)
    lengths = [len(p) for p in kv_batch]
    for i, (prompt, got) in enumerate(zip(kv_batch, outputs)):
        reference = kv_oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        kv_check(reference, got, prompt, f"index {i} of a batch of lengths {lengths}")

