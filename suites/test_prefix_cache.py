"""Shared prefixes: prompts that share their first k tokens and then differ, served by one engine object in
both orders, and the same prompt again after others. Prefix caches (vLLM's, SGLang's radix cache) and engines
that reuse KV blocks live here: reusing a block past the shared prefix, or keying a cache by a prefix only,
gives the second prompt the first one's continuation.

k runs over block-size boundaries (1, 15, 16, 17, 31, 32, 33, 63, 64, 65); each prompt is k shared tokens plus
TAIL different ones. Every call is verified against the oracle, and each prompt gives the same tokens every time it
is served, up to a near tie (``kv_engine.differs``: the oracle's logits, else the engine's own score())."""

import pytest

from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.verdicts.failures import Kind, Where, fail

SHARED = (1, 15, 16, 17, 31, 32, 33, 63, 64, 65)
TAIL = 8


def _pair(k: int, vocab: int) -> tuple[Prompt, Prompt]:
    shared = of_length(k, vocab, salt=40).ids
    a = of_length(TAIL, vocab, salt=41).ids
    b = tuple((t + 1 + i) % vocab for i, t in enumerate(a))  # differs from `a` at every tail position
    return Prompt(f"shared{k}+a", shared + a), Prompt(f"shared{k}+b", shared + b)


def test_shared_prefixes(kv_engine, kv_oracle_or_none, kv_check_tokens):
    vocab = kv_engine.spec.vocab_size
    calls = []
    for k in SHARED:
        a, b = _pair(k, vocab)
        calls += [a, b, b, a]
    calls.append(_pair(SHARED[0], vocab)[0])  # the first prompt again, after all the others
    served: dict[str, tuple[list[int], int]] = {}
    for i, prompt in enumerate(calls):
        got = kv_engine.generate([prompt])[0]
        where = Where(number=i + 1, calls=len(calls), before=tuple(p.name for p in calls[max(0, i - 3):i]),
                     note="shared-prefix check")
        reference = None
        if kv_oracle_or_none is not None:
            reference = kv_oracle_or_none.reference(prompt.ids, kv_engine.max_new_tokens)
            kv_check_tokens(reference, got, prompt, where)
        why = kv_engine.differs(prompt, served[prompt.name][0], got, reference) if prompt.name in served else None
        if why:
            before, when = served[prompt.name]
            fail(Kind.INCONSISTENT,
                 f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{prompt.name}' gave "
                 f"{before} on call {when + 1} and {got} on {where.describe()} (they differ {why}): "
                 f"a prefix cache or reused KV blocks "
                 "serve different state for the same prompt")
        served.setdefault(prompt.name, (got, i))


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
            if kv_oracle_or_none is not None:
                reference = kv_oracle_or_none.reference(prompt.ids, kv_engine.max_new_tokens)
                kv_check_tokens(reference, got, prompt, where)
            elif why := kv_engine.differs(prompt, alone[i], got):
                fail(Kind.INCONSISTENT,
                     f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': prompt '{prompt.name}' gave "
                     f"{alone[i]} alone but {got} at {where.describe()}: they differ {why}")
