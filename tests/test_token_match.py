"""The comparison rule of token_match on hand-made oracle logits (no model needed)."""

import pytest
import torch

from pytest_kvcompile import Reference, TokenMismatch, assert_tokens_match
from pytest_kvcompile.oracles.token_match import assert_score_matches, compare

ROWS = [[3.0, 0.0, 0.0], [1.0, 0.9999, -2.0], [0.0, 5.0, 0.0], [0.0, 0.0, 2.0]]


def reference(rows, given=None):
    """An oracle whose token at each step is the argmax of `rows`; `given(tokens)` gives its logits along other
    tokens (default: the same rows whatever the tokens, i.e. a model that ignores its prefix)."""
    logits = torch.tensor(rows, dtype=torch.float32)
    forced = (lambda tokens, tol: given(tokens)) if given else (lambda tokens, tol: logits)
    return Reference((5, 6, 7), tuple(int(t) for t in logits.argmax(-1)), logits, "hand-made", forced)


# 4 steps over a vocab of 3; step 1 is a near tie between tokens 0 and 1 (gap 1e-4).
REF = reference(ROWS)


def test_identical_tokens_have_no_divergence():
    verdict = compare(REF, [0, 0, 1, 2], tie_tolerance=1e-3)
    assert verdict.divergences == [] and verdict.mismatch is None and not verdict.drift


def test_a_flip_within_tolerance_is_a_near_tie_and_every_later_step_is_verified():
    verdict = compare(REF, [0, 1, 1, 2], tie_tolerance=1e-3)
    assert [(d.step, d.near_tie) for d in verdict.divergences] == [(1, True)]
    assert verdict.divergences[0].gap == pytest.approx(1e-4, rel=1e-2)
    bad = compare(REF, [0, 1, 0, 2], tie_tolerance=1e-3)  # garbage after the tie is caught
    assert (bad.mismatch.step, bad.mismatch.expected, bad.mismatch.got) == (2, 1, 0)


def test_later_steps_are_judged_by_the_oracle_given_the_engines_own_prefix():
    # Along the engine's branch (token 1 at step 1) the oracle would pick 0 at step 2, not 1.
    def given(tokens):
        rows = torch.tensor(ROWS)
        if tokens[1] == 1:
            rows[2] = torch.tensor([5.0, 0.0, 0.0])
        return rows

    ref = reference(ROWS, given)
    assert compare(ref, [0, 1, 0, 2], 1e-3).mismatch is None
    assert compare(ref, [0, 1, 1, 2], 1e-3).mismatch.step == 2


def test_the_same_flip_beyond_tolerance_is_a_mismatch():
    verdict = compare(REF, [0, 1, 1, 2], tie_tolerance=1e-5)
    assert verdict.mismatch.step == 1 and not verdict.mismatch.near_tie


def test_too_many_near_ties_in_one_sequence_is_drift():
    ref = reference([[1.0, 0.9999, 0.0]] * 4)
    assert not compare(ref, [1, 1, 0, 0], 1e-3, max_near_ties=2).drift
    verdict = compare(ref, [1, 1, 1, 0], 1e-3, max_near_ties=2)
    assert verdict.drift and verdict.mismatch is None
    with pytest.raises(TokenMismatch, match=r"drifts from the oracle .* 3 near ties in one sequence of 4 steps, more "
                                            r"than the 2 allowed \(--kv-max-near-ties\)"):
        assert_tokens_match(ref, [1, 1, 1, 0], tie_tolerance=1e-3, max_near_ties=2)


def test_assert_tokens_match_message_carries_the_values():
    with pytest.raises(TokenMismatch) as info:
        assert_tokens_match(REF, [0, 0, 0, 2], tie_tolerance=1e-3, engine="e", model="m", prompt="prompt 'p'",
                            where="index 1 of a batch of lengths [3, 9]", window=4, context="  engine object: fresh")
    message = str(info.value)
    for expected in ("engine 'e' diverges from the oracle on model 'm', prompt 'p' (length 3), index 1 of a batch",
                     "step 2 of 4", "expected token 1, got 0", "logit gap of 5 > tie tolerance 0.001",
                     "oracle top-3 at this step: 1 (5), 0 (0), 2 (0)", "oracle: [0, 0, 1, 2]", "engine: [0, 0, 0, 2]",
                     "crossed the sliding window (4 keys)", "check padding, attention masks", "engine object: fresh"):
        assert expected in message, f"{expected!r} missing from:\n{message}"


def test_wrong_length_is_reported_not_compared():
    with pytest.raises(TokenMismatch, match="returned 3 tokens .* expected 4"):
        assert_tokens_match(REF, [0, 0, 1])


def test_a_reference_without_its_oracle_cannot_verify_tokens_off_its_path():
    bare = Reference(REF.prompt, REF.tokens, REF.logits, "hand-made")
    assert compare(bare, [0, 0, 1, 2], 1e-3).mismatch is None
    with pytest.raises(ValueError, match="built without its oracle"):
        compare(bare, [0, 1, 1, 2], 1e-3)


def test_score_rows_are_checked_against_the_oracle_and_generate():
    rows = torch.tensor(ROWS)
    assert assert_score_matches(REF, [0, 0, 1, 2], rows + 1e-4, tie_tolerance=1e-3, score_tolerance=1e-2) < 1e-3
    with pytest.raises(TokenMismatch, match=r"differ from the oracle's by up to 1 > score tolerance 0.01"):
        assert_score_matches(REF, [0, 0, 1, 2], rows + 1.0, tie_tolerance=1e-3, score_tolerance=1e-2)
    wrong = rows.clone()
    wrong[2] = torch.tensor([0.0, 0.0, 5.0])
    with pytest.raises(TokenMismatch, match=r"at step 2 generate\(\) produced 1 but score\(\) prefers 2 by 5"):
        assert_score_matches(REF, [0, 0, 1, 2], wrong, tie_tolerance=1e-3, score_tolerance=10.0)
