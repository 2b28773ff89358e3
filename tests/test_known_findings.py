"""Known findings as typed data (contract/findings.py): validation naming the fix, scope by the test's parameters,
a failure matched by its kind and typed fields only, never its message; every built-in engine's findings typed."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

import pytest

import pytest_kvcompile.engines
from pytest_kvcompile import Declaration, KnownFinding
from pytest_kvcompile.config.options import _known_finding
from pytest_kvcompile.contract.engine import declaration_of
from pytest_kvcompile.contract.findings import EVERY_CHECK, coerce_findings
from pytest_kvcompile.oracles.token_match import TokenMismatch
from pytest_kvcompile.verdicts.failures import Failure, Kind, Where

TOKEN = {"kv_engine_name": "e", "kv_model_name": "llama", "kv_prompt_name": "long48"}
NO_PROMPT = {"kv_engine_name": "e", "kv_model_name": "llama"}


def mismatch(kind=Kind.MISMATCH, model="llama", prompt="prompt 'long48'", gap=0.005, lengths=()) -> TokenMismatch:
    failure = Failure(kind, "e", model, prompt, 48, where=Where(index=0 if lengths else None, lengths=lengths),
                      step=3, gap=gap)
    return TokenMismatch("any words at all", failure)


def engine_error(raised="IndexError", lengths=(1,)) -> BaseException:
    error = pytest.fail.Exception("engine 'e' raised IndexError in generate(...)", pytrace=False)
    error.raised, error.lengths = raised, lengths
    return error


def kind_failure(kind: Kind) -> BaseException:
    error = pytest.fail.Exception("recompiled after warmup", pytrace=False)
    error.kind = kind.value
    return error


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"check": "", "kind": Kind.MISMATCH, "reason": "r"}, "name the check"),
    ({"check": "token_identity", "kind": Kind.MISMATCH, "reason": "r"}, "starting with 'test_'"),
    ({"check": "test_token_identity*", "kind": Kind.MISMATCH, "reason": "r"}, "no glob"),
    ({"check": "test_x", "kind": "mismatched", "reason": "r"}, "one of mismatch, drift"),
    ({"check": "test_x", "kind": Kind.VACUOUS, "reason": "r"}, "run rules fail the run"),
    ({"check": "test_x", "kind": Kind.MISMATCH, "reason": " "}, "give a reason"),
    ({"check": "test_x", "kind": Kind.MISMATCH, "reason": "r", "models": "llama"}, "models=('llama',)"),
    ({"check": "test_x", "kind": Kind.MISMATCH, "reason": "r", "raised": "IndexError"}, "kind=Kind.OTHER"),
    ({"check": "test_x", "kind": Kind.OTHER, "reason": "r", "raised": "Index Error"}, "type name"),
    ({"check": "test_x", "kind": Kind.SCORE, "reason": "r", "max_gap": 0.01}, "kind=Kind.MISMATCH"),
    ({"check": "test_x", "kind": Kind.MISMATCH, "reason": "r", "max_gap": -1}, "a logit gap > 0"),
    ({"check": "test_x", "kind": Kind.MISMATCH, "reason": "r", "prompt_length": 0}, ">= 1"),
    ({"check": "test_x", "kind": Kind.MISMATCH, "reason": "r", "batched": "yes"}, "True, False or None"),
])
def test_a_bad_field_names_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=None) as info:
        KnownFinding(**kwargs)
    assert fix in str(info.value)


def test_a_kind_may_be_given_by_its_value():
    assert KnownFinding("test_x", "recompile", "r").kind is Kind.RECOMPILE


def test_scope_is_the_check_exactly_and_its_model_and_prompt_parameters():
    finding = KnownFinding("test_token_identity", Kind.MISMATCH, "r", models=("llama",), prompts=("long48",))
    assert finding.in_scope("test_token_identity[e-llama-long48]", "test_token_identity", TOKEN)
    assert not finding.in_scope("test_token_identity_batched[e-llama]", "test_token_identity_batched", NO_PROMPT)
    assert not finding.in_scope("x", "test_token_identity", {**TOKEN, "kv_model_name": "mistral-sw"})
    assert not finding.in_scope("x", "test_token_identity", {**TOKEN, "kv_prompt_name": "len1"})
    anywhere = KnownFinding(EVERY_CHECK, Kind.MISMATCH, "r", models=("llama",))
    assert anywhere.in_scope("x", "test_stale_state", NO_PROMPT) and anywhere.covers_check("x", "test_fuzz")


def test_a_failure_is_matched_by_its_kind():
    finding = KnownFinding("test_token_identity", Kind.MISMATCH, "r")
    assert finding.matches(mismatch(), TOKEN)
    assert not finding.matches(mismatch(Kind.DRIFT), TOKEN)  # the wrong kind is not absorbed
    assert not finding.matches(ValueError("diverges from the oracle"), TOKEN)  # words decide nothing
    assert KnownFinding("test_x", Kind.RECOMPILE, "r").matches(kind_failure(Kind.RECOMPILE))
    assert not KnownFinding("test_x", Kind.RECOMPILE, "r").matches(kind_failure(Kind.MEMORY))


def test_an_engine_error_is_matched_by_its_exception_type():
    finding = KnownFinding("test_long_generation", Kind.OTHER, "r", raised="IndexError")
    assert finding.matches(engine_error(), NO_PROMPT)
    assert not finding.matches(engine_error("ValueError"), NO_PROMPT)
    assert not finding.matches(ValueError("raised IndexError in generate"), NO_PROMPT)  # the message is not data
    assert KnownFinding("test_x", Kind.OTHER, "r").matches(ValueError("any"))  # OTHER unnarrowed: any untyped one


def test_a_mismatch_is_narrowed_by_its_gap():
    finding = KnownFinding("test_token_identity", Kind.MISMATCH, "r", max_gap=0.01)
    assert finding.matches(mismatch(gap=0.0018), TOKEN)
    assert not finding.matches(mismatch(gap=0.155), TOKEN)
    assert not finding.matches(mismatch(gap=None), TOKEN)  # no oracle logits: nothing says it is a close call


def test_the_failing_call_narrows_by_prompt_length_and_batching():
    in_batch = KnownFinding("test_batch_consistency", Kind.MISMATCH, "r", prompt_length=1, batched=True)
    assert in_batch.matches(mismatch(lengths=(7, 1, 48)), NO_PROMPT)
    assert not in_batch.matches(mismatch(lengths=(7, 33, 16)), NO_PROMPT)
    assert not in_batch.matches(mismatch(), NO_PROMPT)  # alone, length 48
    alone = KnownFinding("test_stale_state", Kind.OTHER, "r", raised="IndexError", prompt_length=1, batched=False)
    assert alone.matches(engine_error(lengths=(1,)), NO_PROMPT)
    assert not alone.matches(engine_error(lengths=(1, 5)), NO_PROMPT)
    assert not alone.matches(engine_error(lengths=()), NO_PROMPT)  # a score() call: no generate() lengths


def test_a_check_without_a_prompt_parameter_reads_the_failures_prompt_and_model():
    finding = KnownFinding("test_stale_state", Kind.MISMATCH, "r", prompts=("long48/v1",))
    assert finding.matches(mismatch(prompt="prompt 'long48/v1'"), NO_PROMPT)
    assert not finding.matches(mismatch(prompt="prompt 'long48'"), NO_PROMPT)
    assert finding.matches(mismatch(prompt="prompt 'long48'"), TOKEN)  # the parameter decided it at collection
    scoped = KnownFinding("test_x", Kind.MISMATCH, "r", models=("mistral-sw",))
    assert not scoped.matches(mismatch(model="llama"), {})  # another model's failure


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11+")
def test_an_exception_group_matches_only_when_every_failure_in_it_does():
    finding = KnownFinding("test_fuzz", Kind.RECOMPILE, "r")
    from pytest_kvcompile.recompiles.recorder import RecompileError

    same = ExceptionGroup("two", [RecompileError("a"), RecompileError("b")])  # noqa: F821 (Python >= 3.11 only)
    mixed = ExceptionGroup("two", [RecompileError("a"), ValueError("x")])  # noqa: F821
    assert finding.matches(same) and not finding.matches(mixed)


def test_the_option_line_builds_a_typed_finding():
    line = _known_finding("mistralrs | test_token_identity[mistral-sw/2W+3=19] | mismatch(max_gap=0.01) | close")
    assert not line.deprecated
    finding = KnownFinding.from_line(line.check, line.kind, line.reason)
    assert finding == KnownFinding("test_token_identity", Kind.MISMATCH, "close", models=("mistral-sw",),
                                   prompts=("2W+3=19",), max_gap=0.01)
    assert finding.label == "test_token_identity[mistral-sw/2W+3=19] mismatch(max_gap=0.01)"
    stale = KnownFinding.from_line("test_stale_state[*/long48/v1]", "other(raised=IndexError, batched=false)", "r")
    assert (stale.models, stale.prompts, stale.raised, stale.batched) == ((), ("long48/v1",), "IndexError", False)
    with pytest.raises(ValueError, match="KIND 'mismatched': one of mismatch"):
        KnownFinding.from_line("test_x", "mismatched", "r")
    with pytest.raises(ValueError, match="'gap=1' is not a narrowing"):
        KnownFinding.from_line("test_x", "mismatch(gap=1)", "r")
    old = _known_finding("e | test_x* | cache too short | raised ValueError")
    assert old.deprecated and (old.check, old.reason, old.expected) == ("test_x*", "cache too short",
                                                                       "raised ValueError")
    with pytest.raises(ValueError, match="must be 'ENGINE"):
        _known_finding("e: flaky")


def test_a_deprecated_triple_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match="triples are deprecated: write KnownFinding"):
        decl = Declaration(known_findings=(("test_token_identity[[]e-llama-*]", "why", r"TokenMismatch: .*oracle"),))
    (finding,) = decl.known_findings
    assert (finding.check, finding.glob) == ("test_token_identity", "test_token_identity[[]e-llama-*]")
    assert finding.in_scope("test_token_identity[e-llama-long48]", "test_token_identity", TOKEN)
    assert not finding.in_scope("test_token_identity[e-gpt2-long48]", "test_token_identity", TOKEN)
    assert finding.matches(TokenMismatch("engine 'e' diverges from the oracle"))  # the deprecated path: its regex
    assert not finding.matches(ValueError("diverges from the oracle"))
    with pytest.raises(ValueError, match="write KnownFinding"):
        coerce_findings((("only a glob",),))


def _builtin_engine_modules():
    for info in pkgutil.iter_modules(pytest_kvcompile.engines.__path__):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield importlib.import_module(f"pytest_kvcompile.engines.{info.name}")
        except ImportError:  # an engine whose runtime is not installed here
            continue


def test_every_builtin_engines_findings_are_typed():
    """Every built-in engine's findings are KnownFindings that name a check of the suites and no message regex."""
    from pathlib import Path

    suites = Path(pytest_kvcompile.__file__).resolve().parents[1] / "suites"
    checks = {line.split("(")[0].removeprefix("def ") for path in suites.glob("test_*.py")
              for line in path.read_text().splitlines() if line.startswith("def test_")}
    seen = 0
    for module in _builtin_engine_modules():
        for value in vars(module).values():
            try:
                declaration = declaration_of(value)
            except TypeError:
                continue
            for finding in declaration.known_findings:
                seen += 1
                assert isinstance(finding, KnownFinding), (module.__name__, finding)
                assert not finding.legacy_pattern and not finding.glob, (module.__name__, finding)
                assert finding.check == EVERY_CHECK or finding.check in checks, (module.__name__, finding.check)
    assert seen >= 20
