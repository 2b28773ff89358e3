"""The comparison rule of token_match on hand-made oracle logits (no model needed)."""

import pytest
import torch

from pytest_kvcompile import Reference, TokenMismatch, assert_tokens_match
from pytest_kvcompile.token_match import compare


def reference(rows):
    """An oracle whose token at each step is the argmax of the given rows."""
    logits = torch.tensor(rows, dtype=torch.float32)
    return Reference((5, 6, 7), tuple(int(t) for t in logits.argmax(-1)), logits, "hand-made")


# 4 steps over a vocab of 3; step 1 is a near tie between tokens 0 and 1 (gap 1e-4).
REF = reference([[3.0, 0.0, 0.0], [1.0, 0.9999, -2.0], [0.0, 5.0, 0.0], [0.0, 0.0, 2.0]])


def test_identical_tokens_have_no_divergence():
    verdict = compare(REF, [0, 0, 1, 2], tie_tolerance=1e-3)
    assert verdict.divergences == [] and verdict.mismatch is None and verdict.unverified_from is None


def test_a_flip_within_tolerance_is_a_near_tie_and_later_steps_are_unverified():
    verdict = compare(REF, [0, 1, 0, 0], tie_tolerance=1e-3)
    assert [(d.step, d.near_tie) for d in verdict.divergences] == [(1, True)]
    assert verdict.divergences[0].gap == pytest.approx(1e-4, rel=1e-2)
    assert verdict.unverified_from == 2


def test_the_same_flip_beyond_tolerance_is_a_mismatch():
    verdict = compare(REF, [0, 1, 1, 2], tie_tolerance=1e-5)
    assert verdict.mismatch.step == 1 and not verdict.mismatch.near_tie


def test_teacher_forcing_checks_every_step_after_a_near_tie():
    honest = lambda prompt, cont: REF.logits.clone()  # noqa: E731
    assert compare(REF, [0, 1, 0, 0], 1e-3, score=honest).mismatch is None

    def wrong_last(prompt, cont):
        logits = REF.logits.clone()
        logits[3] = torch.tensor([9.0, 0.0, 0.0])
        return logits

    verdict = compare(REF, [0, 1, 0, 0], 1e-3, score=wrong_last)
    assert (verdict.mismatch.step, verdict.mismatch.got, verdict.mismatch.teacher_forced) == (3, 0, True)


def test_assert_tokens_match_message_carries_the_values():
    with pytest.raises(TokenMismatch) as info:
        assert_tokens_match(REF, [0, 0, 0, 2], tie_tolerance=1e-3, engine="e", model="m", prompt="prompt 'p'",
                            where="index 1 of a batch of lengths [3, 9]", window=4)
    message = str(info.value)
    for expected in ("engine 'e' diverges from the oracle on model 'm', prompt 'p' (length 3), index 1 of a batch",
                     "step 2 of 4", "expected token 1, got 0", "logit gap of 5 > tie tolerance 0.001",
                     "oracle top-3 at this step: 1 (5), 0 (0), 2 (0)", "oracle: [0, 0, 1, 2]", "engine: [0, 0, 0, 2]",
                     "crossed the sliding window (4 keys)", "check padding, attention masks"):
        assert expected in message, f"{expected!r} missing from:\n{message}"


def test_wrong_length_is_reported_not_compared():
    with pytest.raises(TokenMismatch, match="returned 3 tokens .* expected 4"):
        assert_tokens_match(REF, [0, 0, 1])
