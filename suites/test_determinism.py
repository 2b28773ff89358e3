"""Determinism: the same call twice gives the same tokens, exactly."""

import pytest


def _first_difference(a, b):
    return next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_determinism(kv_engine, kv_prompts):
    prompt = max(kv_prompts, key=len)
    first = kv_engine.generate([prompt])[0]
    second = kv_engine.generate([prompt])[0]
    step = _first_difference(first, second)
    assert step is None, (
        f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}', prompt '{prompt.name}': two identical "
        f"generate() calls differ at step {step} ({first[step]} then {second[step]}).\n"
        f"  first:  {first}\n  second: {second}\n"
        "  hint: nondeterministic kernels, uninitialised cache memory, or state carried between calls"
    )


@pytest.mark.kv_requires("batching")
def test_determinism_batched(kv_engine, kv_batch):
    first, second = kv_engine.generate(kv_batch), kv_engine.generate(kv_batch)
    for i, (a, b) in enumerate(zip(first, second)):
        step = _first_difference(a, b)
        assert step is None, (
            f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': index {i} of a batch of lengths "
            f"{[len(p) for p in kv_batch]} differs between two identical calls at step {step} ({a[step]} then {b[step]})"
        )
