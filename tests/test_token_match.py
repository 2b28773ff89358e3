"""The comparison rule of token_match on hand-made oracle logits (no model needed)."""

import pytest
import torch

from pytest_kvcompile import Kind, Reference, TokenMismatch, Where, check_tokens
from pytest_kvcompile.oracles.token_match import check_score, token_verdict

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
    verdict = token_verdict(REF, [0, 0, 1, 2], tie_tolerance=1e-3)
    assert verdict.divergences == [] and verdict.mismatch is None and not verdict.drift


def test_a_flip_within_tolerance_is_a_near_tie_and_every_later_step_is_verified():
    verdict = token_verdict(REF, [0, 1, 1, 2], tie_tolerance=1e-3)
    assert [(d.step, d.near_tie) for d in verdict.divergences] == [(1, True)]
    assert verdict.divergences[0].gap == pytest.approx(1e-4, rel=1e-2)
    bad = token_verdict(REF, [0, 1, 0, 2], tie_tolerance=1e-3)  # garbage after the tie is caught
    assert (bad.mismatch.step, bad.mismatch.expected, bad.mismatch.got) == (2, 1, 0)


def test_later_steps_are_judged_by_the_oracle_given_the_engines_own_prefix():
    # Along the engine's branch (token 1 at step 1) the oracle would pick 0 at step 2, not 1.
    def given(tokens):
        rows = torch.tensor(ROWS)
        if tokens[1] == 1:
            rows[2] = torch.tensor([5.0, 0.0, 0.0])
        return rows

    ref = reference(ROWS, given)
    assert token_verdict(ref, [0, 1, 0, 2], 1e-3).mismatch is None
    assert token_verdict(ref, [0, 1, 1, 2], 1e-3).mismatch.step == 2


def test_the_same_flip_beyond_tolerance_is_a_mismatch():
    verdict = token_verdict(REF, [0, 1, 1, 2], tie_tolerance=1e-5)
    assert verdict.mismatch.step == 1 and not verdict.mismatch.near_tie


def test_too_many_near_ties_in_one_sequence_is_drift():
    ref = reference([[1.0, 0.9999, 0.0]] * 4)
    assert not token_verdict(ref, [1, 1, 0, 0], 1e-3, max_near_ties=2).drift
    verdict = token_verdict(ref, [1, 1, 1, 0], 1e-3, max_near_ties=2)
    assert verdict.drift and verdict.mismatch is None
    with pytest.raises(TokenMismatch, match=r"drifts from the oracle .* 3 near ties in one sequence of 4 steps, more "
                                            r"than the 2 allowed \(--kv-max-near-ties\)"):
        check_tokens(ref, [1, 1, 1, 0], tie_tolerance=1e-3, max_near_ties=2)
    with pytest.raises(TokenMismatch) as info:
        check_tokens(ref, [1, 1, 1, 0], tie_tolerance=1e-3, max_near_ties=2)
    failure = info.value.failure
    assert (info.value.kind, failure.kind, failure.step, failure.max_near_ties) == (Kind.DRIFT, Kind.DRIFT, None, 2)
    assert [t[0] for t in failure.near_ties] == [0, 1, 2] and "raise --kv-max-near-ties" in failure.hint


def test_check_tokens_message_carries_the_values():
    with pytest.raises(TokenMismatch) as info:
        check_tokens(REF, [0, 0, 0, 2], tie_tolerance=1e-3, engine="e", model="m", prompt="prompt 'p'",
                     where=Where(index=1, lengths=(3, 9)), window=4, context="  engine object: fresh")
    message = str(info.value)
    for expected in ("engine 'e' diverges from the oracle on model 'm', prompt 'p' (length 3), index 1 of a batch",
                     "step 2 of 4", "expected token 1, got 0", "logit gap of 5 > tie tolerance 0.001",
                     "oracle top-3 at this step: 1 (5), 0 (0), 2 (0)", "oracle: [0, 0, 1, 2]", "engine: [0, 0, 0, 2]",
                     "crossed the sliding window (4 keys)", "check padding, attention masks", "engine object: fresh"):
        assert expected in message, f"{expected!r} missing from:\n{message}"
    failure = info.value.failure  # the same verdict as data: the reports read it, the hint comes from it
    assert (failure.kind, failure.step, failure.expected, failure.got, failure.gap, failure.tolerance) == \
        (Kind.MISMATCH, 2, 1, 0, 5.0, 1e-3)
    assert (failure.where.index, failure.where.lengths, failure.window, failure.top3[0]) == (1, (3, 9), 4, (1, 5.0))
    assert failure.oracle == (0, 0, 1, 2) and failure.tokens == (0, 0, 0, 2) and failure.hint in message


@pytest.mark.parametrize(("where", "batch", "history"), [
    (Where(), False, False),
    (Where(index=0, lengths=(3, 9)), True, False),
    (Where(number=3, calls=6, before=("a (length 3)", "b (length 9)")), False, True),
    (Where(index=1, lengths=(3, 9), before=("a (length 3)",)), True, True),
    (Where(note="alone (vs batched: index 1 of a batch of lengths [3, 9], after prompts [a])"), False, False),
    ("index 1 of a batch of lengths [3, 9], after prompts [a]", False, False),
])
def test_the_hint_is_chosen_from_the_calls_fields_never_from_its_words(where, batch, history):
    """A row judged alone (even one compared with a batch, as batch consistency's) gets no batch hint; a string is
    shown, not parsed (issue 27: verdict logic passes facts as fields)."""
    with pytest.raises(TokenMismatch) as info:
        check_tokens(REF, [0, 0, 0, 2], tie_tolerance=1e-3, where=where)
    hint = info.value.failure.hint
    assert ("check padding, attention masks" in hint) == batch, hint
    assert ("caches and positions are reset per call" in hint) == history, hint
    assert Where.of(where).describe() in str(info.value)


def test_a_failure_survives_the_json_round_trip():
    from pytest_kvcompile import Failure

    with pytest.raises(TokenMismatch) as info:
        check_tokens(REF, [0, 1, 0, 2], tie_tolerance=1e-3, where=Where(index=1, lengths=(3, 9), number=2))
    failure = info.value.failure
    assert Failure.from_dict(failure.to_dict()) == failure
    assert failure.to_dict()["kind"] == "mismatch" and failure.to_dict()["hint"] == failure.hint
    assert failure.near_ties[0][:3] == (1, 0, 1)


def test_wrong_length_is_reported_not_compared():
    with pytest.raises(TokenMismatch, match="returned 3 tokens .* expected 4") as info:
        check_tokens(REF, [0, 0, 1])
    assert info.value.kind is Kind.LENGTH and "max_new_tokens" in info.value.failure.hint


def test_a_reference_without_its_oracle_cannot_verify_tokens_off_its_path():
    bare = Reference(REF.prompt, REF.tokens, REF.logits, "hand-made")
    assert token_verdict(bare, [0, 0, 1, 2], 1e-3).mismatch is None
    with pytest.raises(ValueError, match="built without its oracle"):
        token_verdict(bare, [0, 1, 1, 2], 1e-3)


def test_score_rows_are_checked_against_the_oracle_and_generate():
    rows = torch.tensor(ROWS)
    assert check_score(REF, [0, 0, 1, 2], rows + 1e-4, tie_tolerance=1e-3, score_tolerance=1e-2) < 1e-3
    with pytest.raises(TokenMismatch, match=r"differ from the oracle's by up to 1 > score tolerance 0.01") as info:
        check_score(REF, [0, 0, 1, 2], rows + 1.0, tie_tolerance=1e-3, score_tolerance=1e-2)
    assert info.value.kind is Kind.SCORE and info.value.failure.gap == pytest.approx(1.0)
    wrong = rows.clone()
    wrong[2] = torch.tensor([0.0, 0.0, 5.0])
    with pytest.raises(TokenMismatch, match=r"at step 2 generate\(\) produced 1 but score\(\) prefers 2 by 5"):
        check_score(REF, [0, 0, 1, 2], wrong, tie_tolerance=1e-3, score_tolerance=10.0)


def test_16bit_score_rows_may_be_as_far_off_as_the_equivalent_computations_spread_at_that_step():
    """The 16-bit local term of score(): where the equivalent computations are themselves 0.8 off at step 2 (a
    position the network amplifies rounding at), score() may be `spread` (Noise.score_spread, measured) x 0.8 off
    there and only there; the twin just outside fails, and so does the same error at a quiet step."""
    from pytest_kvcompile.oracles.precision import LocalNoise

    computed = torch.tensor(ROWS)[None].repeat(2, 1, 1)
    computed[1, 2, 1] += 0.8  # one computation's error at step 2
    noisy = Reference(REF.prompt, REF.tokens, REF.logits, "hand-made", REF.forced,
                      noise=lambda got: LocalNoise(computed))
    rows, spread = torch.tensor(ROWS), 2.5
    inside, outside, quiet = rows.clone(), rows.clone(), rows.clone()
    inside[2, 0] += 0.99 * spread * 0.8
    outside[2, 0] += 1.01 * spread * 0.8
    quiet[3, 0] += 0.99 * spread * 0.8
    kw = {"tie_tolerance": 1e-3, "score_tolerance": 0.1, "spread": spread}
    assert check_score(noisy, [0, 0, 1, 2], inside, **kw) > 1.9
    with pytest.raises(TokenMismatch, match=r"by up to 2.02\d* > 2, the equivalent 16-bit computations' own "
                                            r"error at this step x their measured spread \(score tolerance 0.1\) "
                                            r"\(at step 2"):
        check_score(noisy, [0, 0, 1, 2], outside, **kw)
    with pytest.raises(TokenMismatch, match=r"> score tolerance 0.1 \(at step 3"):
        check_score(noisy, [0, 0, 1, 2], quiet, **kw)


def test_assert_tokens_match_is_the_deprecated_spelling_of_check_tokens():
    from pytest_kvcompile import assert_tokens_match

    with pytest.warns(DeprecationWarning, match="call check_tokens"):
        assert assert_tokens_match(REF, [0, 0, 1, 2]).mismatch is None


# --- ids the engine declares it never emits (Declaration.never_emits) ---------------------------------------------
def test_an_excluded_id_is_out_of_the_oracles_choice_and_only_it():
    # the oracle's best at step 0 is 0 (by 3); an engine that never emits 0 takes the runner-up 1 (or 2: a tie there)
    verdict = token_verdict(REF, [1, 0, 1, 2], tie_tolerance=1e-3, excluded={0})
    assert verdict.mismatch is not None and verdict.mismatch.step == 1  # step 1: 0 is excluded, 1 is the best
    verdict = token_verdict(REF, [1, 1, 1, 2], tie_tolerance=1e-3, excluded={0})
    assert verdict.divergences == [] and verdict.excluded_steps == [0, 1]
    assert token_verdict(REF, [1, 1, 1, 2], tie_tolerance=1e-3).mismatch.step == 0  # undeclared: a mismatch
    # excluding an id does not excuse any other divergence: step 2's best is 1, whatever is excluded
    assert token_verdict(REF, [1, 1, 2, 2], tie_tolerance=1e-3, excluded={0}).mismatch.step == 2


def test_returning_an_excluded_id_is_a_mismatch_even_where_the_oracle_chose_it():
    verdict = token_verdict(REF, [0, 0, 1, 2], tie_tolerance=1e-3, excluded={0})  # the oracle's own tokens
    assert (verdict.mismatch.step, verdict.mismatch.got) == (0, 0)
    with pytest.raises(TokenMismatch, match=r"returned token 0 .* step 0 of 4, an id it declares it never emits "
                                            r"\(Declaration.never_emits: ids \[0\]") as caught:
        check_tokens(REF, [0, 0, 1, 2], tie_tolerance=1e-3, excluded=(0,))
    assert caught.value.failure.excluded == (0,) and caught.value.failure.gap is None
    assert "never_emits rules out" in caught.value.failure.hint


def test_score_rows_may_mask_the_excluded_ids():
    masked = torch.tensor(ROWS)
    masked[:, 0] = -torch.inf
    check_score(REF, [1, 1, 1, 2], masked, tie_tolerance=1e-3, score_tolerance=1e-2, excluded=(0,))
    with pytest.raises(TokenMismatch, match="differ from the oracle's by up to inf"):
        check_score(REF, [1, 1, 1, 2], masked, tie_tolerance=1e-3, score_tolerance=1e-2)


def test_a_lazy_reference_judges_along_the_engines_tokens_and_decodes_only_for_a_failure():
    """Issue 54: the store's references for a one-forward oracle (oracles/reference.py: LazyReference) judge every
    step on the oracle's logits along the engine's own tokens; the oracle's greedy loop runs only for a failure's
    message (here: it would raise if a passing verdict asked for it)."""
    from pytest_kvcompile.oracles.reference import LazyReference

    decoded = []

    def greedy():
        decoded.append(1)
        return REF

    lazy = LazyReference(REF.prompt, 4, "hand-made", greedy, lambda tokens, tol: REF.logits)
    assert check_tokens(lazy, [0, 1, 1, 2], tie_tolerance=1e-3).near_ties[0].step == 1  # a near tie, judged
    assert decoded == [] and lazy.known is None and "not decoded" in repr(lazy)
    with pytest.raises(TokenMismatch, match=r"oracle: \[0, 0, 1, 2\]") as failed:
        check_tokens(lazy, [0, 0, 0, 2], tie_tolerance=1e-3)
    assert decoded == [1] and failed.value.failure.oracle == (0, 0, 1, 2) and lazy.known == (0, 0, 1, 2)
    with pytest.raises(TokenMismatch, match="returned 3 tokens .* expected 4"):
        check_tokens(lazy, [0, 0, 1], tie_tolerance=1e-3)


def test_a_long_sequence_is_shown_as_a_window_around_its_divergence():
    """Issue 59: a long generation's failure names its step with the tokens around it; the whole sequences stay in
    the failure's facts (the JSON and HTML reports)."""
    rows = torch.zeros(100, 3)
    rows[:, 0] = 1.0
    long = Reference((5, 6, 7), (0,) * 100, rows, "hand-made", lambda tokens, tol: rows)
    got = [0] * 100
    got[50] = 2
    with pytest.raises(TokenMismatch) as failed:
        check_tokens(long, got, tie_tolerance=1e-3)
    message = str(failed.value)
    assert "  oracle, steps 42-58 of 100: [... 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 ...]" in message
    assert "  engine, steps 42-58 of 100: [... 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0 ...]" in message
    assert str([0] * 100) not in message and "--kv-report-json" in message
    assert len(failed.value.failure.tokens) == len(failed.value.failure.oracle) == 100


def test_a_mismatch_on_a_model_with_a_tokenizer_shows_its_tokens_as_text():
    """`decode` (the model's tokenizer, models/texts.py): the expected and the engine's tokens and the text before."""
    words = {0: " Paris", 1: " Lyon", 2: ".", 5: "The", 6: " capital", 7: " is"}
    decode = lambda ids: repr("".join(words[i] for i in ids))  # noqa: E731
    with pytest.raises(TokenMismatch) as raised:
        check_tokens(REF, [1, 0, 1, 2], tie_tolerance=1e-3, decode=decode)
    lines = str(raised.value).splitlines()
    assert lines[2] == "  as text: expected ' Paris', got ' Lyon', after ...'The capital is' (the model's tokenizer)"
    with pytest.raises(TokenMismatch) as plain:  # no tokenizer: ids alone
        check_tokens(REF, [1, 0, 1, 2], tie_tolerance=1e-3)
    assert "as text" not in str(plain.value)
