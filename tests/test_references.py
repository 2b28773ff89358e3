"""References recorded once and reused (issue 54, oracles/recorded.py): --kv-record-references=DIR records, a later
--kv-references=DIR run judges from the recording alone, and a folder recorded for another run is a usage error
naming what differs."""

import json
from pathlib import Path

import pytest

from conftest import run_suites
from pytest_kvcompile.oracles.recorded import Recorded, References

CHECK = ("--kv-engine=hf-eager", "-k", "token_identity and short7 and not batched")


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_recorded_references_judge_a_later_run_and_refuse_another(kvtester, tmp_path):
    folder = tmp_path / "refs"
    recording = run_suites(kvtester, *CHECK, f"--kv-record-references={folder}")
    assert recording.ret == 0, recording.stdout.str()[-3000:]
    entries = References(folder).entries()
    assert [(e.model, e.dtype, e.device) for e in entries] == [("llama", "float32", "cpu")]
    recorded = _files(folder / "oracle")
    assert recorded  # the oracle's store lives in the folder...
    assert not any(name.startswith("digests") for name in recorded)  # ...not this machine's file digests

    later = run_suites(kvtester, *CHECK, f"--kv-references={folder}")
    assert later.ret == 0, later.stdout.str()[-3000:]
    later.stdout.fnmatch_lines(["PASS  hf-eager: *"])
    assert _files(folder / "oracle") == recorded  # every judgment found in the recording: nothing computed anew

    other_dtype = run_suites(kvtester, *CHECK, f"--kv-references={folder}", "--kv-dtype=bfloat16")
    assert other_dtype.ret == pytest.ExitCode.USAGE_ERROR
    other_dtype.stderr.fnmatch_lines([f"*--kv-references={folder}: the references of model 'llama' were recorded "
                                      "for another run*--kv-dtype: recorded float32, this run bfloat16*"])

    entry = next((folder / "recorded").glob("*.json"))
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "code": "0123456789ab", "checkpoint": "f" * 64}))
    other_code = run_suites(kvtester, *CHECK, f"--kv-references={folder}")
    assert other_code.ret == pytest.ExitCode.USAGE_ERROR
    other_code.stderr.fnmatch_lines(["*the checkpoint's content (sha256 of its files): recorded ffff*; "
                                     "pytest-kvcompile's prompts and rules (its code): recorded 0123456789ab*"])

    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = run_suites(kvtester, *CHECK, f"--kv-references={empty}")
    assert nothing.ret == pytest.ExitCode.USAGE_ERROR
    nothing.stderr.fnmatch_lines([f"*--kv-references={empty}: no references recorded there*record them first with "
                                  f"the same options and --kv-record-references={empty}*"])
    both = run_suites(kvtester, *CHECK, f"--kv-references={folder}", f"--kv-record-references={folder}")
    assert both.ret == pytest.ExitCode.USAGE_ERROR
    both.stderr.fnmatch_lines(["*a run either records references or judges from recorded ones*"])


def test_an_entry_for_another_model_names_what_the_folder_holds(tmp_path):
    folder = References(tmp_path)
    now = Recorded("llama", "a" * 64, "float32", "cpu", "c0de", "2.13.0", "5.24.0")
    folder.record(Recorded("qwen", "b" * 64, "bfloat16", "cuda", "c0de", "2.13.0", "5.24.0"))
    assert "no references recorded for model 'llama' (it holds 'qwen' (bfloat16))" in folder.problem(
        now, "--kv-references", "--kv-record-references")
    folder.record(now)
    assert folder.problem(now, "--kv-references", "--kv-record-references") is None
