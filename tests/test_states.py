"""Issue 70: the hybrid models' recurrent state (--kv-zoo=recurrent; docs/state-caches.md). Each state bug of
tests/kv_test_engines_states.py fails the token checks on the models it lives on, typed and named (model, prompt,
step), while the correct engine, whose prefill runs in chunks through the same cache, passes on both: one merged run,
each twin read from its JSON row. The memory check's state twins: tests/test_memory.py."""

import json

from conftest import run_suites

MODULE = "kv_test_engines_states"
RECURRENT = ("qwen3-next", "bamba")
#: twin -> the models its bug shows on (NoPositionIds: transformers 5.24's Bamba alone ignores the cache's length)
TWINS = {
    "NoPositionIds": ("bamba",),
    "ConvWindowLostAcrossChunks": RECURRENT,
    "StateSlotNotZeroed": RECURRENT,
    "StateStoredInBfloat16": RECURRENT,
}


def test_each_state_bug_fails_and_the_chunked_engine_passes(kvtester):
    report = kvtester.path / "states.json"
    result = run_suites(kvtester, *(f"--kv-engine={MODULE}:{e}" for e in ("ChunkedState", *TWINS)),
                        "--kv-zoo=recurrent", f"--kv-report-json={report}", "-k", "token_identity or stale_state")
    rows = {(r["engine"].removeprefix(f"{MODULE}:"), r["model"]): r for r in json.loads(report.read_text())["rows"]}
    for model in RECURRENT:
        row = rows["ChunkedState", model]
        assert row["tests"]["failed"] == 0 and row["tests"]["passed"] >= 7, (model, row["tests"], row["failures"])
    for twin, models in TWINS.items():
        for model in RECURRENT:
            row = rows[twin, model]
            if model not in models:  # the bug is not there: it computes what the correct engine does
                assert row["tests"]["failed"] == 0, (twin, model, row["failures"])
                continue
            assert row["tests"]["failed"] >= 1, (twin, model, row["tests"])
            kinds = {(f["kind"], f["failure"]["model"]) for f in row["failures"]}
            assert kinds <= {(k, model) for k in ("mismatch", "drift", "score")}, (twin, kinds)
    # a conv window lost between prefill chunks: right on a prompt within one chunk, wrong on one crossing them
    lost = {f["failure"]["prompt"] for f in rows["ConvWindowLostAcrossChunks", "bamba"]["failures"]}
    assert "prompt 'long48'" in lost and "prompt 'len7'" not in lost, lost
    result.stdout.fnmatch_lines([f"*TokenMismatch: engine '{MODULE}:NoPositionIds' diverges from the oracle on model "
                                 "'bamba', prompt *: step *"])
    # the hint names the recurrent layers and their state, and what to check of it
    result.stdout.fnmatch_lines([f"*TokenMismatch: engine '{MODULE}:ConvWindowLostAcrossChunks' diverges from the "
                                 "oracle on model 'qwen3-next', prompt 'long48' *",
                                 "*hint: *; model 'qwen3-next' has recurrent layers (layers 0, 1, 2: gated-deltanet, "
                                 "conv window 4 over 128 channels, state 4 x 16 x 16), whose state is carried, never "
                                 "cropped or sliced: check that it is carried across prefill chunks*"])
