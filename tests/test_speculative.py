"""Speculative decoding (issue 42): suites/test_speculative.py passes ref-speculative, a correct variant and the prompt
lookups of the reference and of transformers (hf-prompt-lookup), and fails each twin of
tests/kv_test_engines_speculative.py naming the check that caught it; the schedule, the judge of reported steps, the
lookup prompts and the vacuous-run rule as functions."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_suites
from pytest_kvcompile.contract.engine import Declaration
from pytest_kvcompile.contract.speculative import Speculative
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.oracles.speculation import (
    DraftRow,
    LookupPrompt,
    ScheduledDrafter,
    UnknownContext,
    choose_swap,
    judge,
    judge_lookup,
    lookup_prompt,
    schedule_rejects,
    simulate,
    swap_rejects,
)
from pytest_kvcompile.verdicts.lines import speculation_line
from pytest_kvcompile.verdicts.rows import Speculation, new_row
from pytest_kvcompile.verdicts.run_rules import run_problems
from reference_impls.speculative import PromptLookup

T = "kv_test_engines_speculative:"
TWINS = ("KeepsRejectedKV", "BonusFromTheWrongPosition", "RollbackOffByOneAtLast", "OneRowsRollbackForAll",
         "DraftCacheNotRolledBack", "NeverDrafts", "LookupOffByOneAtLast", "LookupNeverDrafts",
         "LookupCountsARejectedDraft")


#: -k: every check on the correct variant; on each twin the checks that must catch it (the rest would only cost time)
SELECT = ("test_speculative and (SpeculativeK2 or (schedules and not batched and (KeepsRejectedKV or "
          "BonusFromTheWrongPosition or RollbackOffByOneAtLast)) or (OneRowsRollbackForAll and schedules) or "
          "(DraftCacheNotRolledBack and (draft_model or schedules)) or (NeverDrafts and own_draft and not Lookup)) or "
          "(test_speculative_lookup and (ref-speculative-lookup or hf-prompt-lookup or LookupOffByOneAtLast or "
          "LookupNeverDrafts or LookupCountsARejectedDraft))")


# --- the suite against a correct variant and every twin: one pytester run (ref-speculative: the suites' own runs) ---
def test_speculative_suite_passes_a_correct_decoder_and_fails_each_twin(kvtester):
    report = kvtester.path / "r.json"
    result = run_suites(kvtester, f"--kv-engine={T}SpeculativeK2", "--kv-engine=ref-speculative-lookup",
                        "--kv-engine=hf-prompt-lookup",
                        *(f"--kv-engine={T}{twin}" for twin in TWINS),
                        "--kv-compile-backend=eager", "-k", SELECT, f"--kv-report-json={report}", "-p", "no:xdist")
    rows = {row["engine"]: row for row in json.loads(report.read_text())["rows"]}

    def failures(twin):
        return {f["test"].split("::")[1].split("[")[0]: f for f in rows[T + twin]["failures"]}

    assert rows[T + "SpeculativeK2"]["tests"] == {**rows[T + "SpeculativeK2"]["tests"], "passed": 4, "failed": 0}
    # rejected K/V kept: the tokens after the first rejection are computed over them
    assert failures("KeepsRejectedKV")["test_speculative_schedules"]["kind"] in ("mismatch", "memory")
    # the bonus read after the rejected draft: a token the target did not choose
    assert failures("BonusFromTheWrongPosition")["test_speculative_schedules"]["kind"] == "mismatch"
    # only a rejection at j = k - 1 keeps one position too many: the schedule that forces it catches it
    off = failures("RollbackOffByOneAtLast")["test_speculative_schedules"]
    assert off["kind"] in ("mismatch", "memory") and "reject first at 3" in off["message"], off["message"]
    # one row's rollback for all: single calls pass, rows keeping different lengths in one step fail
    shared = failures("OneRowsRollbackForAll")
    assert "test_speculative_schedules" not in shared and shared["test_speculative_schedules_batched"]["kind"] \
        == "mismatch"
    rollback = shared["test_speculative_schedules_batched"]["failure"]  # the hint: each row's drafts, per-row rollback
    assert "drafts kept per row (acceptance()): verify step " in rollback["hint"], rollback
    assert "the rows kept different numbers of drafts: roll each row's K/V (and positions) back by its own " \
        "acceptance" in rollback["hint"], rollback
    assert rollback["where"]["speculation"][rollback["where"]["index"]], rollback
    # the draft model's cache not cropped: every token right (the suite's drafter passes), the acceptance its draft
    # earns is not
    draft = failures("DraftCacheNotRolledBack")
    assert set(draft) == {"test_speculative_draft_model"} and draft["test_speculative_draft_model"]["kind"] \
        == "speculation", draft
    assert rows[T + "DraftCacheNotRolledBack"]["tests"]["passed"] == 2
    # drafting nothing passes every check and fails the run: no draft was accepted or rejected
    assert not failures("NeverDrafts")
    # prompt lookup: every forced length kept, on the reference; the rollback off by one at j = k - 1, which a lookup
    # of the tiny model's own text rarely reaches, caught by the prompt that forces it; a lookup finding nothing on a
    # prompt built to match, named
    for name in ("ref-speculative-lookup", "hf-prompt-lookup"):  # transformers' prompt lookup: its first step is the
        lookup = rows[name]  # prompt's own lookup (before any token), the reference's after the prefill's token
        assert lookup["tests"]["passed"] == 1 and not lookup["failures"] and lookup["speculation"]["lengths"].keys() \
            >= {"0/4", "1/4", "2/4", "3/4", "4/4"}, lookup
    off = failures("LookupOffByOneAtLast")["test_speculative_lookup"]
    assert off["kind"] in ("mismatch", "memory") and "lookup keeps 4" in off["message"], off["message"]
    never = failures("LookupNeverDrafts")["test_speculative_lookup"]
    assert never["kind"] == "speculation" and "drafted nothing, but the sequence's last 4 tokens occur once before" \
        in never["message"], never["message"]
    # acceptance over-counted by one on every rejecting step: its sequences disagree on where its first step starts
    counted = failures("LookupCountsARejectedDraft")["test_speculative_lookup"]
    assert counted["kind"] == "speculation" and "one engine, one convention: its steps give every token from a step " \
        "(start 0), but for prompt 'lookup keeps 0' the first token from the prefill (start 1)" in counted["message"], \
        counted["message"]
    problems = {p["engine"]: p for p in json.loads(report.read_text())["problems"]}
    assert set(problems) == {T + "NeverDrafts"} and problems[T + "NeverDrafts"]["kind"] == "vacuous"
    result.stdout.fnmatch_lines([  # in the order of the output: a failure, the reports' steps, the run rules
        f"*engine '{T}DraftCacheNotRolledBack' on model 'llama' kept another number of drafts than a correct "
        "speculative decoder*",
        "*kvcompile: speculative decoding, verify steps as reported*",
        f"{T}SpeculativeK2 / llama: * verify step(s) of up to 2 drafts: * drafted tokens accepted *; accepted/drafted "
        "per step: * 1/2 x*, 2/2 x*",
        f"*engine '{T}NeverDrafts' on model 'llama' (cpu, float32): it declares speculative decoding, but over its * "
        "reported verify step(s) nothing was drafted: *",
    ])


# --- the pieces ------------------------------------------------------------------------------------------------------
def _reference(tokens, vocab=8):
    logits = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        logits[i, t], logits[i, (t + 3) % vocab] = 5.0, -5.0  # the oracle ranks t first and t + 3 last
    return Reference((1, 2), tuple(tokens), logits, "test")


@pytest.mark.parametrize("lengths, k, n, steps", [
    ((4,), 4, 16, [(4, 4), (4, 4), (4, 4)]),
    ((0,), 4, 6, [(4, 0), (3, 0), (2, 0), (1, 0), (0, 0)]),
    ((3,), 4, 16, [(4, 3), (4, 3), (4, 3), (2, 2)]),
    ((4, 0), 4, 16, [(4, 4), (4, 0), (4, 4), (3, 0), (2, 2)]),
])
def test_a_schedule_makes_each_step_keep_its_length(lengths, k, n, steps):
    assert simulate(schedule_rejects(lengths, k, n), k, n) == steps


def test_the_scheduled_drafter_proposes_the_oracle_or_its_last_choice():
    row = DraftRow.of(_reference([5, 6, 7, 0, 1]), rejects={2}, vocab_size=8)
    drafter = ScheduledDrafter((row,))
    assert drafter.propose([1, 2, 5], 3) == [6, (7 + 3) % 8, 0]  # position 1, 2 (rejected: the last choice), 3
    assert drafter.propose([1, 2], 1) == [5]
    with pytest.raises(UnknownContext, match="starts with none of this call's 1 prompt"):
        drafter.propose([9, 9, 9], 2)


def test_judge_names_the_step_that_kept_another_number():
    tokens = [5, 6, 7, 0, 1, 2]
    row = DraftRow.of(_reference(tokens), rejects={2, 4}, vocab_size=8)
    good = judge(row, [(3, 1), (3, 1), (0, 0)], tokens)
    assert (good.checked, good.wrong) == (3, None)
    bad = judge(row, [(3, 2), (2, 0), (0, 0)], tokens)
    assert bad.wrong.startswith("verify step 1 of 3, after 1 generated token(s), drafted 3 and kept 2, but a "
                                "correct engine keeps 1: a draft the target must reject")
    assert "generate() returned 6" in judge(row, [(3, 1)], tokens).wrong  # steps that cannot have made the tokens
    diverged = judge(row, [(3, 1), (3, 0), (0, 0), (0, 0)], [5, 6, 7, 3, 1, 2])  # a near tie at position 3
    assert diverged.wrong is None and diverged.unjudged >= 1


def test_a_batched_speculative_mismatch_names_each_rows_drafts_and_per_row_rollback():
    from pytest_kvcompile.verdicts.failures import Failure, Kind, Where

    def hint(speculation, step, index=1):
        where = Where(index=index, lengths=(9, 9), speculation=speculation)
        return Failure(Kind.MISMATCH, "e", "llama", "p", 9, where, step=step, tokens=(0,) * 8).hint

    # the prefill's token first (start 1), then each verify step's kept drafts and its bonus: 8 tokens per row
    rows = (((4, 2), (4, 2), (0, 0)), ((4, 3), (4, 2)))  # row 0: 1 + 3 + 3 + 1 = 8; row 1: 1 + 4 + 3 = 8
    said = hint(rows, step=6)  # row 1: the prefill's 0, step 1 tokens 1-4, step 2 tokens 5-7
    assert ("its token 6 from row 1's verify step 2; drafts kept per row (acceptance()): verify step 1: row 0 2 of 4, "
            "row 1 3 of 4; verify step 2: row 0 2 of 4, row 1 2 of 4; the rows kept different numbers of drafts: roll "
            "each row's K/V (and positions) back by its own acceptance") in said, said
    same = hint((((4, 3), (4, 2)), ((4, 3), (4, 2))), step=6)
    assert "verify step 1: row 0 3 of 4, row 1 3 of 4" in same and "every row kept as many drafts" in same, same
    assert "check padding, attention masks" in hint((), step=6)  # no acceptance(): the batch's generic hint
    assert "drafts kept per row" not in hint(rows, step=0)  # the prefill's token: no verify step made it


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram():
    lookup = PromptLookup(ngram=3)
    assert lookup.propose([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3], 2) == [7, 6]  # the latest 3-gram match
    assert lookup.propose([5, 2, 3, 9, 8, 4, 3], 4) == [9, 8, 4, 3]  # no 3- or 2-gram: the 1-gram
    assert lookup.propose([1, 2, 3], 4) == [] and lookup.propose([1, 2, 3, 4, 3], 0) == []


def test_a_lookup_prompt_plants_a_continuation_the_target_keeps_for_exactly_j_tokens():
    def target(ids):  # greedy continuation: (the last token + 1) over and over; logits rank it first, it + 3 last
        tokens = [(ids[-1] + 1 + i) % 64 for i in range(8)]
        return _reference(tokens, 64)

    for j in range(6):
        found = lookup_prompt(target, j, 4, 64, tolerance=0.1)
        marker = found.ids[-4:]
        assert found.ids.count(marker[0]) == 2 and found.ids[found.ids.index(marker[0]) + 4:][:5] == found.proposal
        tokens = target(found.ids).tokens
        assert list(found.proposal[:j]) == list(tokens[:j]) and (j == 5 or found.proposal[j] != tokens[j]), found
    assert lookup_prompt(lambda ids: _reference([1], 64), 3, 4, 64, 0.1) is None  # the oracle ran too few tokens


def test_judge_lookup_holds_the_first_step_to_the_planted_continuation():
    lookup, tokens = LookupPrompt((1, 2), (5, 6, 7, 9, 9), accepts=3), [5, 6, 7, 0, 1, 2]
    assert judge_lookup(lookup, [(4, 3), (2, 1)], tokens, tokens).checked == 1  # prompt's own lookup: keeps 3
    assert judge_lookup(lookup, [(4, 2), (3, 1)], tokens, tokens).checked == 1  # after the prefill's token: 2
    wrong = judge_lookup(lookup, [(4, 4), (0, 0)], tokens, tokens).wrong
    assert "drafted 4 and kept 4, but the lookup proposes [5, 6, 7, 9]" in wrong and "the first 3" in wrong
    assert "drafted nothing" in judge_lookup(lookup, [(0, 0)] * 6, tokens, tokens).wrong
    rejected_first = LookupPrompt((1, 2), (5, 6, 7, 9, 9), accepts=0)
    assert judge_lookup(rejected_first, [(4, 1), (1, 0), (4, 1)], tokens, tokens).unjudged == 1  # start 1: not forced


def test_a_swapped_draft_is_rejected_where_the_continuation_holds_a_swapped_token():
    assert swap_rejects([5, 6, 5, 7], (5, 9)) == {0, 2}
    a, b = choose_swap([[1, 2, 3, 4, 5, 6, 7, 8, 2, 9], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4]], 4, 16)
    assert b not in {1, 2, 3, 4, 5, 6, 7, 8, 9} and a in {1, 2, 3, 4, 5, 6, 7, 8, 9}


def test_a_speculative_run_that_never_accepted_and_rejected_is_vacuous():
    def row(drafted, accepted):
        found = new_row("e", "m", "cpu", "float32")
        found.speculation = Speculation(4, 5, drafted, accepted, {"0/4": 5})
        return found

    assert [p.kind.value for p in run_problems([row(20, 0), row(20, 20), row(0, 0)], 0.01)] == ["vacuous"] * 3
    assert run_problems([row(20, 7)], 0.01) == []
    assert speculation_line(row(20, 7).speculation) == ("5 verify step(s) of up to 4 drafts: 7 of 20 drafted "
                                                           "tokens accepted (35%); accepted/drafted per step: 0/4 x5")


def test_a_bad_speculative_declaration_names_the_fix():
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        Speculative(k=0)
    with pytest.raises(ValueError, match="a tuple of 'drafter', 'draft_model'"):
        Speculative(k=2, drafters=("lookup",))
    with pytest.raises(ValueError, match="write speculative=Speculative"):
        Declaration(speculative=4)


def test_one_convention_per_engine_accounts_for_every_token():
    from pytest_kvcompile.oracles.speculation import Convention

    prefill_first = Convention()
    assert prefill_first.check([(4, 2), (4, 4)], 9, "prompt 'a'") is None  # 1 + 3 + 5: the prefill gave the first
    assert prefill_first.start == 1 and prefill_first.check([(4, 4), (0, 0)], 7, "prompt 'b'") is None
    over = prefill_first.check([(4, 3), (4, 4)], 9, "prompt 'c'")  # one kept draft too many: reads as start 0
    assert over and "but for prompt 'a' the first token from the prefill (start 1)" in over
    assert Convention().check([], 1, "no steps") is None
