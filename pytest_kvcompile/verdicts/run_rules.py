"""Run rules: what fails a run beyond its single tests (an engine whose token checks verified nothing, near ties or
score() rows more often than a correct engine's rate allows over the whole run), and tests skipped everywhere."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvcompile.config.tolerances import FALSE_ALARM, POWER_MULTIPLE, binomial_tail, power, run_rate_exceeded
from pytest_kvcompile.verdicts.failures import Kind, Problem
from pytest_kvcompile.verdicts.rows import Row


def run_problems(rows: list[Row], max_near_tie_rate: float | None) -> list[Problem]:
    """What fails the run beyond single tests (verdicts/failures.py: Problem, its engine a field): an engine x model
    whose token checks ran but verified no token (vacuous), unless it was skipped for a declared reason or the oracle
    was unreliable; an engine whose near ties per verified token exceed `max_near_tie_rate` over the run (None, 16-bit
    'auto', or an engine declaring a lower kv_cache_dtype: an engine x model whose near ties a correct engine reaches
    with probability < 1e-4 at the measured flip rate, oracles/precision.py)."""
    problems = []
    for row in rows:
        at = dict(engine=row.engine, model=row.model, device=row.device, dtype=row.dtype)
        if row.token_checks and not row.verified_tokens and not row.declared_skips and not row.oracle_errors:
            reasons = sorted({c.reason for c in row.checks.values() if c.reason})
            problems.append(Problem(Kind.VACUOUS, message=(
                f"{row.token_checks} token check(s) ran but no token was verified: a check that cannot apply "
                f"proves nothing (skips: {'; '.join(reasons) or 'none recorded'})"), **at))
        if row.evicting and not row.evictions:
            problems.append(Problem(Kind.NO_EVICTION, message=(
                f"its eviction strategy evicted nothing on any of the {row.evicting} verified sequence(s), so they "
                "proved nothing about eviction (the prompt set adds budget+1 and 2*budget+3 tokens within the model's "
                "position limit: a larger budget cannot be exercised on this model)"), **at))
        spec = row.speculation
        if spec and not 0 < spec.accepted < spec.drafted:
            missing = ("nothing was drafted" if not spec.drafted else "no draft was accepted"
                       if not spec.accepted else "no draft was rejected")
            problems.append(Problem(Kind.VACUOUS, message=(
                f"it declares speculative decoding, but over its {spec.steps} reported verify step(s) {missing}: "
                "the steps proved nothing about keeping accepted drafts and rolling back rejected ones"), **at))
    by_engine: dict[tuple, list[int]] = {}
    for row in rows:
        at = dict(engine=row.engine, model=row.model, device=row.device, dtype=row.dtype)
        for found in run_rates(row, max_near_tie_rate):
            if found.failed:
                problems.append(Problem(found.kind, message=found.failure(), **at))
        if max_near_tie_rate is None or row.kv_stored:  # measured: a RunRate above
            continue
        found = by_engine.setdefault((row.engine, row.device, row.dtype), [0, 0])
        found[0] += row.near_tie_tokens
        found[1] += row.verified_tokens
    for (engine, device, dtype), (ties, verified) in sorted(by_engine.items()):
        if verified and ties / verified > max_near_tie_rate:
            problems.append(Problem(Kind.RUN_DRIFT, engine, device, dtype, message=(
                f"{ties} near ties in {verified} verified tokens ({ties / verified:.1%}) exceed "
                f"--kv-max-near-tie-rate={max_near_tie_rate:g}: numerics drift over the run (the near ties are listed "
                "above)")))
    return problems


#: What makes an engine's numerics noisier than the dtype's own computations: the failing run rules' advice.
NOISIER = ("a KV cache or activations kept in a format coarser than {dtype} (declare Declaration.kv_cache_dtype if "
           "the cache is stored lower on purpose), RoPE angles or the softmax scale computed in {dtype} rather than "
           "float32, softmax or matmul accumulation in {dtype}: compare its attention and cache step by step with "
           "transformers' {dtype} path on the prompt of a near tie")


@dataclass(frozen=True)
class RunRate:
    """A run-level rate of one engine x model where the verdict numbers are measured (16-bit, or a KV cache stored
    lower: oracles/precision.py): `events` in `positions` (of `sequences` distinct sequences: one verified again
    counts once), against the share `measured` of positions where the noisiest equivalent computation shows the same
    event in calibration, and its 97.5% upper bound `bound`. The rule fails where a computation at the bound shows
    this many events with probability (`p_value`) < FALSE_ALARM, as a sequence's near-tie budget does. `power`: the
    chance that an engine POWER_MULTIPLE x as noisy (POWER_MULTIPLE x `measured`) fails it at these positions.

    Near ties (`kind` RUN_DRIFT): the engine's token is not the truth's best, against the flip rate. score() rows
    (LOGIT_DRIFT): its logits are farther from the truth than `threshold` (the computations' median error on the
    truth's top-8 logit differences), against the beyond rate."""

    kind: Kind
    events: int
    positions: int
    sequences: int
    measured: float
    bound: float
    dtype: str
    threshold: float = 0.0
    stored: str = ""  # what the engine declares it computes lower, in words (Row.kv_stored), if anything

    @property
    def computations(self) -> str:
        """Which computations the engine is held to: the model's dtype, with what it declares computing lower."""
        return f"{self.dtype} ({self.stored})" if self.stored else self.dtype

    @property
    def rate(self) -> float:
        return self.events / self.positions if self.positions else 0.0

    @property
    def p_value(self) -> float:
        return binomial_tail(self.positions, self.bound, self.events)

    @property
    def failed(self) -> bool:
        return run_rate_exceeded(self.events, self.positions, self.bound)

    @property
    def power(self) -> float:
        return power(self.positions, self.bound, min(1.0, POWER_MULTIPLE * self.measured))

    @property
    def what(self) -> str:
        if self.kind == Kind.RUN_DRIFT:
            return f"near ties {self.events} in {self.positions} verified positions"
        return (f"score() beyond {self.threshold:.3g} of the truth at {self.events} of {self.positions} scored "
                "positions")

    def line(self) -> str:
        """`what` beside the computations' rate, the p-value and the power, for the report."""
        return (f"{self.what} ({self.sequences} sequences): {self.rate:.2%} vs correct {self.computations} "
                f"computations {self.measured:.2%} (bound {self.bound:.2%}): p = {self.p_value:.2g}"
                f"{f' < {FALSE_ALARM:g}: FAILS' if self.failed else ''}; an engine {POWER_MULTIPLE}x as noisy fails "
                f"here with probability {self.power:.0%}")

    def failure(self) -> str:
        """The failing rule's message: the rates, the p-value, what to try."""
        if self.kind == Kind.RUN_DRIFT:
            found = (f"{self.events} near ties in {self.positions} verified positions ({self.sequences} distinct "
                     f"sequences), {self.rate:.2%}, where correct {self.computations} computations of this model "
                     f"flip at {self.measured:.2%} (bound {self.bound:.2%}; the near ties are listed above)")
        else:
            found = (f"its score() rows are farther than {self.threshold:.3g} (the median error of the "
                     f"{self.computations} computations) from the float64 truth on its top-8 logit differences at "
                     f"{self.events} of {self.positions} scored positions, {self.rate:.2%}, where the noisiest "
                     f"computation is that far at {self.measured:.2%} (bound {self.bound:.2%}): its logits drift "
                     "more than the dtype's computations do, whether or not a token flips")
        return (f"{found}: p = {self.p_value:.2g} < {FALSE_ALARM:g}, numerics noisier than the dtype's own over the "
                f"run; try: {NOISIER.format(dtype=self.computations)}")


def run_rates(row: Row, max_near_tie_rate: float | None = None) -> list[RunRate]:
    """The measured run-level rates of `row` (RunRate): near ties over its distinct verified sequences unless the
    near-tie rate is given (`max_near_tie_rate`, and the engine stores no KV lower), score() rows over its distinct
    scored ones; none without measured noise."""
    noise = row.noise
    if not noise:
        return []
    found = []
    if max_near_tie_rate is None or row.kv_stored:
        distinct = row.sequences.values()
        found.append(RunRate(Kind.RUN_DRIFT, sum(t for _, t in distinct), sum(v for v, _ in distinct), len(distinct),
                             noise.flip_rate, noise.flip_rate_bound, row.dtype, stored=row.kv_stored))
    scored = row.scored.values()
    if scored and noise.beyond_rate_bound is not None:
        found.append(RunRate(Kind.LOGIT_DRIFT, sum(b for _, b in scored), sum(n for n, _ in scored), len(scored),
                             noise.beyond_rate, noise.beyond_rate_bound, row.dtype, noise.logit_threshold,
                             row.kv_stored))
    return found


def skipped_everywhere(rows: list[Row]) -> list[str]:
    """Checks skipped for every engine and model of the run, with a reason: nothing was checked by them."""
    seen: dict[str, tuple[list[int], set[str]]] = {}
    for row in rows:
        for name, counts in row.checks.items():
            ran, reasons = seen.setdefault(name, ([0], set()))
            ran[0] += counts.ran
            if counts.reason:
                reasons.add(counts.reason)
    lines = []
    for name, (ran, reasons) in sorted(seen.items()):
        if not ran[0] and reasons:
            ordered = sorted(reasons)
            more = f" (and {len(ordered) - 3} more)" if len(ordered) > 3 else ""
            lines.append(f"{name}: {'; '.join(ordered[:3])}{more}")
    return lines

