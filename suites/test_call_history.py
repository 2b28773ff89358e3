"""Where histories: bugs that need a particular call before the one that goes wrong (issue 24). On one engine
object, each check changes one thing the previous call fixed and verifies every row of every call:

- ``test_same_batch_size_new_length_mix``: batches of the same size with other length mixes (padding state kept
  per batch size or per shape shows the earlier call's padding to the new rows), then each prompt alone, then
  the size again;
- ``test_single_after_each_batch_size``: after a batch of each size 2..4 whose shortest row is short, single
  prompts of a short, a middle and a long length (state left by a batch, keyed by its size or its shortest row,
  read by the next single call).

Every call is verified against the oracle (``kv_check_tokens``); without an oracle a prompt must give what it gave alone
on a fresh history, up to a near tie on the engine's own score() (``kv_engine.differs``). A failure names the call,
what changed from the one before, and the calls before it."""

import pytest

from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.verdicts.failures import Kind, Where, fail

MIXES = ((7, 33, 16), (20, 5, 40), (16, 7, 33))  # three mixes of one batch size: each row's padding changes
AFTER_BATCH = (3, 20, 48)  # single prompts after each batch: short, middle, long
BATCH_ROWS = (5, 40, 12, 25)  # a batch of size b takes the first b: its shortest row is 5


def _prompt(n: int, vocab: int, salt: int) -> Prompt:
    return Prompt(f"history{n}.{salt}", of_length(n, vocab, salt=salt).ids)


def _verify(kv_engine, oracle, check, prompts: list[Prompt], outputs, changed: str, alone: dict) -> None:
    lengths = tuple(len(p) for p in prompts)
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        where = Where(index=i, lengths=lengths, number=len(kv_engine.history), note=changed)
        if oracle is not None:
            check(oracle.reference(prompt.ids, kv_engine.max_new_tokens), got, prompt, where)
        elif prompt.name in alone and (why := kv_engine.differs(prompt, alone[prompt.name], got)):
            fail(Kind.INCONSISTENT,
                 f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{prompt.name}' gave "
                 f"{alone[prompt.name]} alone and {got} at {where.describe()}: they differ {why}\n"
                 f"{kv_engine.served(len(kv_engine.history) - 1)}")


def _alone(kv_engine, prompts: list[Prompt]) -> dict[str, list[int]]:
    return {p.name: kv_engine.generate([p])[0] for p in prompts}


@pytest.mark.kv_requires("batching")
def test_same_batch_size_new_length_mix(kv_engine, kv_oracle_or_none, kv_check_tokens):
    vocab = kv_engine.spec.vocab_size
    batches = [[_prompt(n, vocab, 60 + k) for n in mix] for k, mix in enumerate(MIXES)]
    alone = _alone(kv_engine, [p for b in batches for p in b]) if kv_oracle_or_none is None else {}
    previous = None
    for k, batch in enumerate(batches):
        changed = (f"batch size {len(batch)} again, length mix {[len(p) for p in batch]} after {previous}"
                   if previous else f"first batch of size {len(batch)}")
        _verify(kv_engine, kv_oracle_or_none, kv_check_tokens, batch, kv_engine.generate(batch), changed, alone)
        previous = [len(p) for p in batch]
        if k == 1:  # then each prompt alone, then the size again
            for p in batch:
                _verify(kv_engine, kv_oracle_or_none, kv_check_tokens, [p], kv_engine.generate([p]),
                        f"alone, after batches of size {len(batch)}", alone)
            previous = f"single calls after {previous}"


@pytest.mark.kv_requires("batching")
def test_single_after_each_batch_size(kv_engine, kv_oracle_or_none, kv_check_tokens):
    vocab = kv_engine.spec.vocab_size
    singles = [_prompt(n, vocab, 70) for n in AFTER_BATCH]
    alone = _alone(kv_engine, singles) if kv_oracle_or_none is None else {}
    for size in (2, 3, 4):
        batch = [_prompt(n, vocab, 71 + size) for n in BATCH_ROWS[:size]]
        _verify(kv_engine, kv_oracle_or_none, kv_check_tokens, batch, kv_engine.generate(batch),
                f"a batch of size {size} after single calls", {})
        lengths = [len(q) for q in batch]
        for k, p in enumerate(singles):
            if k:  # each single right after the batch
                kv_engine.generate(batch)
            _verify(kv_engine, kv_oracle_or_none, kv_check_tokens, [p], kv_engine.generate([p]),
                    f"a single prompt right after a batch of size {size} with lengths {lengths}, shortest "
                    f"{min(lengths)}", alone)
