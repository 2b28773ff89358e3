"""Lines for people: a row's measured rules, fuzz coverage, speculation and concurrency rounds, as the terminal
summary and the Markdown and HTML reports print them."""

from __future__ import annotations

from pytest_kvcompile.verdicts.lowered import Lowered
from pytest_kvcompile.verdicts.rows import Coverage, EvictionNoise, MeasuredNoise, Round, RouterNoise, Row, Speculation


def coverage_line(found: Coverage) -> str:
    """The conditions on two consecutive calls the fuzzer's covering walk made true (run/fuzz.py: Coverage)."""
    parts = ", ".join(f"{p} {c}/{n}" for p, (c, n) in found.parts.items())
    return (f"{found.covered}/{found.possible} conditions on two consecutive calls covered ({parts}) in "
            f"{found.calls} calls, {found.seconds} s")


def speculation_line(found: Speculation) -> str:
    """A speculative engine's verify steps: drafted vs accepted, and each acceptance length with its count."""
    return found.line()


def concurrency_line(found: dict[str, Round]) -> str:
    """Per round of the concurrency suite, its responses: identical, within near ties, wrong."""
    return "; ".join(f"{label}: {c.identical} identical, {c.near_tie} within near ties, {c.wrong} wrong"
                     for label, c in found.items())


def noise_line(row: Row) -> str:
    """A row's 16-bit rule, or an engine's KV stored lower, as measured (oracles/precision.py: Noise)."""
    model, dtype, noise = row.model, row.dtype, row.noise or MeasuredNoise()
    if noise.kv_dtype or noise.matmul_inputs:
        lowered = Lowered(noise.kv_dtype, noise.matmul_inputs)
        return (f"{model} ({dtype}) with {lowered} ({lowered.fields}): tie "
                f"tolerance {noise.tolerance:.3g} ({noise.factor:g} x noise scale {noise.scale:.3g}), "
                f"near-tie rate {noise.flip_rate:.1%} (bound {noise.flip_rate_bound:.1%}), score() tolerance "
                f"{noise.score_tolerance:.3g}: what computing that way does to this model's logits, "
                "measured (oracles/computations.py: KVComputation); the engine is held to the larger of these and the "
                f"model's own numbers; {_cost(noise)}")
    oracle = next(iter(noise.per_computation.values()), {})
    spread = noise.factor if noise.score_spread is None else noise.score_spread
    attended = f" at up to {noise.attended} positions" if noise.attended else ""
    reach = f", or {noise.reach:.3g} x its spread there" if noise.reach else ""
    if noise.limited:
        attended += " (as far as the run's checks attend: a sequence past that is not judged)"
    return (f"{model} ({dtype}): tie tolerance {noise.tolerance:.3g} "
            f"({noise.factor:g} x noise scale {noise.scale:.3g}{attended}, or x "
            f"the noise at the position{reach}), near-tie rate of equivalent computations {noise.flip_rate:.1%} (bound "
            f"{noise.flip_rate_bound:.1%}), score() tolerance {noise.score_tolerance:.3g} (or "
            f"{spread:.3g} x the computations' error at the position); judged against float64 "
            f"on the {dtype} weights: transformers' own {dtype} path flips at {oracle.get('flips', 0)}/"
            f"{noise.positions} calibration positions; {_cost(noise)}")


def _cost(noise: MeasuredNoise) -> str:
    """What the calibration cost: its seconds and positions, and whether this run paid them."""
    if not noise.seconds:
        return "calibration time not recorded"
    paid = "as an earlier run measured it: read from the store" if noise.cached else "measured this run"
    return (f"calibration {noise.seconds:.3g} s for {noise.positions} positions ({paid}; kept in the store per "
            "model, dtype and code version)")


def eviction_noise_line(row: Row) -> str:
    """A row's measured eviction near-tie rule (oracles/eviction_noise.py: ScoreNoise)."""
    model, dtype, noise = row.model, row.dtype, row.eviction_noise or EvictionNoise()
    return (f"{model} ({dtype}) {noise.policy}: eviction near-tie tolerance {noise.tolerance:.3g} relative "
            f"({noise.factor:g} x p99 {noise.scale:.3g} of the score-difference errors of a {dtype} computation "
            f"vs float64 at {noise.cuts} calibration cuts; it kept another set at {noise.flips})")


def router_noise_line(row: Row) -> str:
    """A row's measured routing near-tie rule (oracles/routing.py: RouterNoise)."""
    model, dtype, noise = row.model, row.dtype, row.router_noise or RouterNoise()
    computed = f"computation with {noise.lowered}'s errors" if noise.lowered else f"{dtype} computations' errors"
    truth = "the truth" if noise.lowered else "float64"
    return (f"{model} ({dtype}) routers: routing near-tie tolerance {noise.tolerance:.3g} ({noise.factor:g} x p99 "
            f"{noise.scale:.3g} of the {computed} on {noise.decisions} router-score margins vs {truth}; the "
            f"noisiest routed {noise.flips} the other way): a token explained by one such decision taken the other "
            "way, or by a chain of two at its position, is a near tie")


def first_lines(text: str, n: int = 4, width: int = 300) -> str:
    return "\n".join(line[:width] for line in text.strip().splitlines()[:n])

