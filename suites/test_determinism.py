"""Determinism: the same call twice gives the same tokens; where they differ, only by a near tie under the rule of the
token checks (``kv_engine.differs``: the oracle's logits, asked for only on a difference, else the engine's own
score(); without either, exactly)."""

import pytest

from pytest_kvcompile.verdicts.failures import Kind, fail


def _oracle_reference(request, prompt, kv_engine):
    """The oracle's reference for `prompt`, or None without an oracle: a callable, so the oracle is built only when two
    outputs differ (these checks verify no token themselves)."""
    def reference():
        oracle = request.getfixturevalue("kv_oracle_or_none")
        return oracle.reference(prompt.ids, kv_engine.max_new_tokens) if oracle is not None else None

    return reference


def test_determinism(request, kv_engine, kv_prompts):
    prompt = max(kv_prompts, key=len)
    first = kv_engine.generate([prompt])[0]
    second = kv_engine.generate([prompt])[0]
    why = kv_engine.differs(prompt, first, second, _oracle_reference(request, prompt, kv_engine))
    if why:
        fail(Kind.INCONSISTENT,
             f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}', prompt '{prompt.name}': two identical "
             f"generate() calls differ {why}.\n  first:  {first}\n  second: {second}\n"
             "  hint: nondeterministic kernels, uninitialised cache memory, or state carried between calls")


@pytest.mark.kv_requires("batching")
def test_determinism_batched(request, kv_engine, kv_batch):
    first, second = kv_engine.generate(kv_batch), kv_engine.generate(kv_batch)
    for i, (prompt, a, b) in enumerate(zip(kv_batch, first, second)):
        why = kv_engine.differs(prompt, a, b, _oracle_reference(request, prompt, kv_engine))
        if why:
            fail(Kind.INCONSISTENT,
                 f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': index {i} of a batch of lengths "
                 f"{[len(p) for p in kv_batch]} differs between two identical calls {why}\n"
                 f"  first:  {a}\n  second: {b}")
