"""Fuzzing (``--kv-fuzz=N``, off by default): on one engine object a covering walk makes every condition on up to
four factors of two consecutive calls true (kinds of call followed by kinds of call), then hypothesis draws call
sequences and shrinks a failure to the shortest sequence that still fails (pytest_kvcompile/run/fuzz.py for the
kinds, rules and profiles). Every row is judged by the oracle under the verdict rules (without an oracle: an exact
repeat must give the same tokens); an engine that ran compiled code must compile nothing after the warmup calls."""

import pytest

from pytest_kvcompile.models.checkpoints import max_positions
from pytest_kvcompile.oracles.hf import budget_of
from pytest_kvcompile.run import fuzz
from pytest_kvcompile.verdicts.lines import coverage_line
from pytest_kvcompile.verdicts.rows import Coverage


@pytest.mark.kv_only("fuzz")
def test_fuzz(kv_engine, kv_oracle_or_none, kv_settings, kv_prompts, kv_record, kv_check_tokens):
    settings = kv_settings.fuzz
    if settings is None:  # deselected by the plugin; reached only when run by node id
        pytest.skip("fuzzing is off: pass --kv-fuzz=N")
    by_len = {len(p): p for p in kv_prompts}
    warmup = [[by_len[7]], [by_len[48]]] + ([[by_len[7], by_len[48]]] if kv_engine.ref.declaration.batching else [])
    for call in warmup:  # the compiled code (if any) now exists: it must serve every fuzz call without compiling
        kv_engine.generate(call, fuzz.WARMUP_STEPS)
    budget = budget_of(kv_engine.ref.declaration.strategy)
    limit = (max_positions(kv_engine.spec.config) or 512) - max(fuzz.NEW_TOKENS)
    lengths = fuzz.lengths_for(kv_engine.window, (budget,) if budget else (), limit)
    key = f"{kv_engine.name}|{kv_engine.spec.name}|{kv_settings.dtype}|{kv_settings.device}"
    covered: list[Coverage] = []
    examples = fuzz.run(kv_engine, kv_oracle_or_none, lengths, kv_engine.compiled_observed, settings, by_len[7],
                        kv_settings.cache_dir / "fuzz-db", key, kv_check_tokens,
                        on_coverage=lambda found: (covered.append(Coverage(**found)),
                                                   kv_record.metric(fuzz_coverage=covered[-1])))
    kv_record("fuzz", f"{kv_engine.name} / {kv_engine.spec.name}: covering walk: {coverage_line(covered[-1])}; then "
              f"{examples} hypothesis example(s) of up to {8 if settings.profile == 'ci' else 24} calls, profile "
              f"{settings.profile}, no failure")
