"""Enough positions to decide (runs whose verdict numbers are measured: bfloat16, float16, or an engine storing its KV
cache lower; the plugin deselects it elsewhere). The run-level rules compare the engine's near ties, and its score()
rows beyond the computations' median error, over every distinct verified position with the rates the dtype's equivalent
computations show (verdicts/run_rules.py: RunRate; oracles/precision.py). Their power depends on the positions:
this check runs the engine on the calibration's own prompts (the positions those rates were measured on: 32 steps
each, in batches of up to 8 where the engine batches) until an engine flipping 5x as often as the computations fails the
near-tie rule with probability >= 90% (`precision.positions_needed`; every other check's positions add to it). Each
sequence is verified like any token check; an engine declaring score() has it checked on each (kv_check_score).

Cost: the positions it takes, per engine and model: about 200-600 in bfloat16, 500-4096 in float16 (docs/precision.md:
the power table), each an engine decode step, a float64 oracle step (shared by engines: cached) and, with score(),
a scored step."""

import pytest

from pytest_kvcompile.models.prompts import Prompt
from pytest_kvcompile.oracles import precision
from pytest_kvcompile.verdicts.failures import Where

BATCH = 8


@pytest.mark.kv_only("measured_rates")
def test_near_tie_rate(kv_engine, kv_oracle, kv_check_tokens, kv_check_score):
    if kv_engine.noise is None:
        pytest.skip(f"the verdict numbers on model '{kv_engine.spec.name}' were given, not measured (a checkpoint "
                    "transformers cannot run): there is no measured rate for these positions to test against")
    block, steps, _ = precision.CALIBRATION
    needed = precision.positions_needed(kv_engine.noise) // steps  # whole prompts
    found = precision.calibration_prompts(kv_engine.spec.vocab_size, -(-needed // len(block)))[:needed]
    prompts = [Prompt(f"calibration{i}", tuple(ids)) for i, ids in enumerate(found)]
    declaration = kv_engine.ref.declaration
    size = min(BATCH, declaration.bounds and declaration.bounds.max_batch or BATCH) if declaration.batching else 1
    note = f"{needed * steps} positions for the run-level rates' power"
    for start in range(0, len(prompts), size):
        call = prompts[start:start + size]
        lengths = tuple(len(p) for p in call)
        for i, (prompt, got) in enumerate(zip(call, kv_engine.generate(call, steps))):
            reference = kv_oracle.reference(prompt.ids, steps)
            kv_check_tokens(reference, got, prompt, Where(index=i, lengths=lengths, note=note))
            kv_check_score(reference, got, prompt)
