"""Token identity: every step of the engine's greedy continuation is the oracle's choice given the engine's own
prefix, or a near tie (within the tie tolerance, at most --kv-max-near-ties per sequence).

The assertion is ``kv_check_tokens`` (``token_match.check_tokens``): it raises TokenMismatch with
engine, model, prompt, step, gap and hint. An engine declaring ``scoring`` also has its ``score()`` checked on
the tokens it generated: its rows against the oracle's logits, its argmax against ``generate()``
(``kv_check_score``: ``token_match.check_score``; in a measured run its steps beyond the dtype's typical noise count
toward the run's score() rate). tests/test_suites_catch_bugs.py and tests/test_verdicts.py show each
check failing on a broken engine."""

import pytest

from pytest_kvcompile.verdicts.failures import Where


def test_token_identity(kv_engine, kv_oracle, kv_prompt, kv_check_tokens, kv_check_score):
    got = kv_engine.generate([kv_prompt])[0]
    reference = kv_oracle.reference(kv_prompt.ids, kv_engine.max_new_tokens)
    kv_check_tokens(reference, got, kv_prompt, Where())
    kv_check_score(reference, got, kv_prompt)


@pytest.mark.kv_requires("batching")
def test_token_identity_batched(kv_engine, kv_oracle, kv_batch, kv_check_tokens):
    outputs = kv_engine.generate(kv_batch)
    lengths = tuple(len(p) for p in kv_batch)
    for i, (prompt, got) in enumerate(zip(kv_batch, outputs)):
        reference = kv_oracle.reference(prompt.ids, kv_engine.max_new_tokens)
        kv_check_tokens(reference, got, prompt, Where(index=i, lengths=lengths))

