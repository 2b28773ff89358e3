"""Batch consistency: a prompt continues the same alone and inside a batch of different lengths.

A difference is accepted only when the oracle shows both runs are right (their flips are near ties): each run is
then asserted against the oracle by ``kv_check_tokens`` (``token_match.check_tokens``, raising
TokenMismatch). Without an oracle (a strategy declaring none) a difference is judged on the engine's own score()
(``kv_engine.differs``), and fails without one: it cannot be told from a near tie. tests/test_suites_catch_bugs.py
shows it failing on an engine with a padding bug.
"""

import pytest

from pytest_kvcompile.verdicts.failures import Kind, Where, fail


@pytest.mark.kv_requires("batching")
def test_batch_consistency(kv_engine, kv_oracle_or_none, kv_batch, kv_check_tokens):
    batched = kv_engine.generate(kv_batch)
    lengths = tuple(len(p) for p in kv_batch)
    for i, prompt in enumerate(kv_batch):
        alone = kv_engine.generate([prompt])[0]
        if alone == batched[i]:
            continue
        step = next(s for s, (a, b) in enumerate(zip(alone, batched[i])) if a != b)
        differs = f"differs from the same prompt alone at step {step} (alone {alone[step]}, batched {batched[i][step]})"
        where = Where(index=i, lengths=lengths, note=differs)
        if kv_oracle_or_none is None:
            why = kv_engine.differs(prompt, alone, batched[i])
            if why:
                fail(Kind.INCONSISTENT,
                     f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}', prompt '{prompt.name}': "
                     f"{where.describe()}: they differ {why}\n"
                     f"  hint: check padding, attention masks and per-row positions",
                     pytrace=False)
            continue
        reference = kv_oracle_or_none.reference(prompt.ids, kv_engine.max_new_tokens)
        kv_check_tokens(reference, got=alone, prompt=prompt,
                        where=Where(note=f"alone (vs batched: {where.describe()})"))
        kv_check_tokens(reference, batched[i], prompt, where)
