"""How an engine's answers are judged on one model (`Judge`): the run's verdict numbers (tie tolerance, near-tie
budget, score() tolerance, the measured noise they came from) and the model's facts the rules need (its window, the
ids the engine never emits), applied to tokens, to two answers of one engine, to score() rows and to a server's
log-probabilities (oracles/token_match.py has the rules). The engine under test (run/harness.py) calls the engine;
this module only judges what it answered."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvcompile.errors import skip
from pytest_kvcompile.models.prompts import Prompt
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.oracles.token_match import (
    Verdict,
    allowed_gap,
    check_logprobs,
    check_score,
    check_tokens,
    compared_rows,
    routed,
)
from pytest_kvcompile.verdicts.failures import Where


@dataclass(frozen=True)
class Judge:
    """The verdict numbers of one engine on one model, and the rules applied with them."""

    engine: str
    model: str
    max_new_tokens: int
    tie_tolerance: float
    window: int | None = None
    max_near_ties: int | None = None
    score_tolerance: float = 0.0
    excluded: tuple[int, ...] = ()  # ids the engine declares it never emits on this model
    noise: Any = None  # oracles.precision.Noise the numbers were measured from (16-bit, a KV stored lower)
    strategy: str = ""  # the engine's declared strategy, named where nothing can judge a difference
    decode: Callable[[Sequence[int]], str] | None = None  # ids as the model's tokenizer reads them (models/texts.py)
    states: str = ""  # the model's recurrent layers, for a failure's hint (models/layers.py: states_of)

    def near_tie_budget(self, steps: int) -> int | None:
        """Near ties one sequence of `steps` may hold: the run's budget, set for --kv-max-new-tokens steps; a longer
        sequence (a long generation) in 16-bit gets the measured noise's budget for its own length, never less."""
        if self.max_near_ties is None or self.noise is None or steps <= self.max_new_tokens:
            return self.max_near_ties
        return max(self.max_near_ties, self.noise.max_near_ties(steps))

    def tokens(self, reference: Reference, got: Sequence[int], prompt: Prompt, where: Where | str, context: str,
               engine_top: Any = None) -> Verdict:
        """token_match.check_tokens with these numbers: the verdict, or TokenMismatch. `context`: what the engine
        object served before; `engine_top`: its own top-k log-probabilities along `got` (a server), else None."""
        __tracebackhide__ = True
        self._covered(prompt, reference.steps)
        return check_tokens(reference, got, tie_tolerance=self.tie_tolerance,
                            max_near_ties=self.near_tie_budget(reference.steps), engine=self.engine, model=self.model,
                            prompt=f"prompt '{prompt.name}'", where=where, window=self.window, states=self.states,
                            context=context,
                            excluded=self.excluded, engine_top=engine_top, decode=self.decode)

    def _covered(self, prompt: Prompt, steps: int) -> None:
        """Skip, named, a sequence attending past what the noise its numbers came from was calibrated on (a smaller
        --kv-profile measures it only as far as its own checks attend: oracles/precision.py, Noise.covers)."""
        __tracebackhide__ = True
        attends = len(prompt) + steps
        if self.noise is not None and not self.noise.covers(attends):
            skip(f"engine '{self.engine}' on model '{self.model}': prompt '{prompt.name}' ({len(prompt)} tokens) and "
                 f"{steps} new tokens attend {attends} positions, past the {self.noise.dtype} noise's "
                 f"calibration ({self.noise.attended} positions: a smaller --kv-profile measures it only as far as its "
                 "own checks attend), so this sequence is not judged; run the check under --kv-profile=full")

    def difference(self, first: Sequence[int], second: Sequence[int],
                   reference: Reference | Callable[[], Reference | None] | None,
                   scored: Callable[[], Any] | None) -> str | None:
        """How two answers of one engine to one prompt differ beyond a near tie, or None (EngineUnderTest.differs):
        at their first difference, judged on the oracle's logits given their shared prefix (`reference`, or a callable
        giving it, asked only on a difference), else on the engine's declared score() of `first` (`scored`, asked
        only then; None: it declares none)."""
        step = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), None)
        if step is None:
            return None if len(first) == len(second) else f"in length ({len(first)} and {len(second)} tokens)"
        a, b = int(first[step]), int(second[step])
        if callable(reference):
            reference = reference()
        if reference is not None and not reference.scored:  # an engine oracle without score(): equality is the rule
            return (f"at step {step} ({a} vs {b}): the oracle declares no score(), so nothing tells the difference "
                    "from a near tie (the engine's own score() does not judge itself)")
        if reference is not None:
            row, judge = reference.given(first, self.tie_tolerance)[step], "the oracle"
        elif scored is not None:
            row, judge = scored()[step].float(), "the engine's own score()"
        else:
            return (f"at step {step} ({a} vs {b}): no oracle covers strategy {self.strategy} and the engine declares "
                    "no score(), so the difference cannot be told from a near tie")
        gap, allowed = abs(float(row[a] - row[b])), self.tie_tolerance
        if reference is not None:
            best, other = (a, b) if row[a] >= row[b] else (b, a)
            allowed = allowed_gap(reference, first, step, best, other, gap, self.tie_tolerance)
        if gap <= allowed or (reference is not None and routed(reference, first, step, other, self.tie_tolerance)):
            return None  # a near tie, or one near-tied routing decision taken the other way (oracles/routing.py)
        return (f"at step {step} ({a} vs {b}): {judge} separates the two by a logit gap of {gap:.4g} > {allowed:.4g}, "
                "not a near tie")

    def score(self, reference: Reference, got: Sequence[int], prompt: Prompt, scored: Any) -> float | None:
        """A declared score()'s rows along `got` against the oracle's, and its argmax against `got`."""
        __tracebackhide__ = True
        self._covered(prompt, len(got))
        return check_score(reference, got, scored, tie_tolerance=self.tie_tolerance,
                           score_tolerance=self.score_tolerance, engine=self.engine, model=self.model,
                           prompt=f"prompt '{prompt.name}'", excluded=self.excluded,
                           spread=self.noise.score_spread if self.noise is not None else None)

    def logprobs(self, reference: Reference, got: Sequence[int], prompt: Prompt, rows: Any) -> float:
        """A server's teacher-forced top-k log-probabilities along `got` against the oracle's."""
        __tracebackhide__ = True
        self._covered(prompt, len(got))
        return check_logprobs(reference, got, rows, tie_tolerance=self.tie_tolerance,
                              score_tolerance=self.score_tolerance, engine=self.engine, model=self.model,
                              prompt=f"prompt '{prompt.name}'", excluded=self.excluded)

    def beyond_noise(self, reference: Reference, got: Sequence[int], scored: Any) -> int:
        """Steps where `scored` (score() of `got`) is farther from the oracle's rows than the typical noise of the
        dtype's computations (oracles/precision.py: logit_threshold; measured runs and a scored oracle only)."""
        from pytest_kvcompile.oracles.precision import logit_errors

        truth = compared_rows(reference, got, scored, self.tie_tolerance, self.excluded).double().clone()
        if self.excluded:
            truth[:, list(self.excluded)] = -float("inf")  # out of the oracle's choice, as in the token checks
        return int((logit_errors(truth, scored) > self.noise.logit_threshold).sum())
