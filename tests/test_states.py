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


#: the references' state bugs (issue 70 item 4) beside their correct engines: a prefix hit (on both models) and a
#: verify step (on bamba: the same rollback code serves both)
REFERENCES = {"kv_test_engines_prefix:PagedEager": "SnapshotGapNotRecomputed",
              "ref-speculative": "StateAdvancedByRejectedDrafts"}
ON = {"SnapshotGapNotRecomputed": RECURRENT, "StateAdvancedByRejectedDrafts": ("bamba",)}
#: -k: the transformers-cache engines on the token checks; the references' twins and their correct engines on the
#: checks of their feature (the references' every suite, under inductor, on both models: CI's served job)
SELECT = ("(token_identity or stale_state) and not (PagedEager or SnapshotGap or ref-speculative or StateAdvanced) or "
          "(test_shared_prefixes or test_full_hit) and (PagedEager or SnapshotGap) or "
          "test_speculative_schedules and (ref-speculative-bamba or StateAdvancedByRejectedDrafts-bamba)")


def test_each_state_bug_fails_and_the_chunked_engine_passes(kvtester):
    report = kvtester.path / "states.json"
    result = run_suites(kvtester, *(f"--kv-engine={MODULE}:{e}" for e in ("ChunkedState", *TWINS)),
                        *(f"--kv-engine={e}" for e in REFERENCES),
                        *(f"--kv-engine={MODULE}:{twin}" for twin in REFERENCES.values()),
                        "--kv-zoo=recurrent", "--kv-compile-backend=eager", f"--kv-report-json={report}", "-k", SELECT)
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
    # the references keep states: a hit resumes from a snapshot, a verify step from the state after the kept tokens;
    # each twin fails where its bug is, the hint naming the layers, their state and what to check of it
    for correct, twin in REFERENCES.items():
        for model in ON[twin]:
            row = rows[correct, model]
            assert row["tests"]["failed"] == 0 and row["tests"]["passed"] >= 1, (correct, model, row["failures"])
            failures = rows[twin, model]["failures"]
            kinds = {f["kind"] for f in failures}  # inconsistent: a prompt served again, differently
            assert "mismatch" in kinds and kinds <= {"mismatch", "inconsistent"}, (twin, model, failures)
    hints = {twin: [f["failure"]["hint"] for model in ON[twin] for f in rows[twin, model]["failures"]
                    if f["kind"] == "mismatch"] for twin in REFERENCES.values()}
    layers = ("model 'bamba' has recurrent layers (layers 0, 2: mamba2, conv window 4 over 160 channels, state 4 x 32 "
              "x 16)", "model 'qwen3-next' has recurrent layers (layers 0, 1, 2: gated-deltanet")
    assert all(any(named in hint for named in layers) for hint in sum(hints.values(), [])), hints
    assert any(layers[1] in hint for hint in hints["SnapshotGapNotRecomputed"]), hints
    assert all("resumed on a prefix hit only from a snapshot taken at the hit point" in hint
               for hint in hints["SnapshotGapNotRecomputed"]), hints
    assert all("left where the row's kept tokens end after each verify step" in hint
               for hint in hints["StateAdvancedByRejectedDrafts"]), hints
