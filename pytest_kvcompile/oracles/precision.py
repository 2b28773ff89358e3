"""Verdicts in reduced precision: what a bfloat16 or float16 engine may legitimately choose (issue 23).

**The truth.** The model's weights rounded to the run's 16-bit dtype (what every engine holds), evaluated in float64
(oracles/truth.py: `HighPrecisionSpec`, `load_lm`, `Widened`): the function the engine computes, without the engine's
own rounding. In a 16-bit run the oracle *is* this truth (the same oracle class, float64); transformers' own 16-bit
path is one of the computations below, never the judge, so a doubt about it never reds an engine.

**The noise.** Equivalent 16-bit computations of the same model (`COMPUTATIONS`: transformers eager with its cache,
which is the 16-bit oracle's own path; SDPA without a cache; SDPA in a left-padded batch; eager with the prompt
prefilled in chunks of 5) differ from the truth by rounding alone. What can flip a correct engine's choice between
the truth's best token b and another token e is the error a computation makes on the difference t[b] - t[e]. Per
model and dtype, along the truth's greedy path on `CALIBRATION` prompts and one of each `LONG_CALIBRATION` length (up
to the longest a check attends over: `calibrate`, stored with the oracle; a smaller --kv-profile's only as far as its
checks attend, and a sequence past that is not judged, `Noise.covers`):

- scale = the 99th percentile, over positions and computations, of the largest such error among the truth's top 8;
- flip rate = the largest share of positions where one computation's argmax is not the truth's;
- beyond rate = the largest share of positions where one computation's error exceeds the median error (of all
  positions and computations): about half, by definition; the score() rows' counterpart of the flip rate (a sign test:
  an engine no noisier than the noisiest computation is beyond that median at most as often; the median, where errors
  are densest, tells a wider spread from the same spread with the fewest positions).

Calibration runs blocks of prompts (`calibration_prompts`) until the noisiest computation flipped `MIN_FLIPS` times
(or `MAX_BLOCKS` blocks): a rate seen a few times has an upper bound several times itself, which no run could test
against; eight flips bound it within twice itself (bfloat16 stops after one block, float16 after two to five).

**The rule.** At a step where the engine's token e is not the truth's best b (gap g = t[b] - t[e], the truth
teacher-forced on the engine's own tokens), it is a near tie iff ``g <= NOISE_FACTOR x max(scale, local)``,
local = the largest error the same computations make on t[b] - t[e] at this very position, along the engine's own
tokens (`LocalNoise`): positions where the network amplifies rounding are noisy for every computation, and the
local term covers them without widening the rule elsewhere. NOISE_FACTOR covers computations the four do not
(fused kernels, other reduction orders); its twin in tests/ fails just outside it. Or, where larger, g <= reach x
spread: spread = the largest of the computations' RMS errors over the truth's top-TOP differences at this position
(how much the network amplifies rounding here, read from many directions rather than one), reach = how far one
computation's error on one difference was seen to reach beyond another attention family's spread at the same
position (`reach`, measured in the calibration). The one-difference term alone compares the engine's error, selected
large by the very divergence being judged, with a few unselected and correlated samples (the eager computations round
alike): a correct kernel rounding elsewhere (inductor's fused bfloat16 chains, issue 71) lands 2.5x past it at
amplified positions while being closer to float64 than eager on average (docs/precision.md). A sequence may hold as
many near ties as a correct engine flipping at the flip rate's upper bound shows with probability >= `FALSE_ALARM`
(binomial); so may a whole run, over all its distinct verified positions (verdicts/run_rules.py: `RunRate`), and the
run's score() rows beyond the median error, against the beyond rate. `positions_needed`: how many
positions give those run rules the power (`POWER`) to fail an engine `POWER_MULTIPLE` x as noisy; the suites' check
of them (suites/test_near_tie_rate.py) runs the engine on the calibration's own prompts. The numbers per zoo model:
docs/precision.md.

float32 keeps its constants (config/tolerances.py): its noise is ~1e-5, far inside them (measured in the same doc).

**A KV cache stored lower** (``Declaration.kv_cache_dtype``: float16, bfloat16, float8 (e4m3 or e5m2, rounded at
scale 1, saturating at the format's largest value: vLLM's default and the coarsest a correct fp8 cache rounds, since a
finer scale only keeps more small values out of the subnormals), or int8/int4/int2 quantized). The noise
of storing K and V that way is measured the same way (`calibrate` with `KVComputation`: transformers eager in the
run's dtype with every K and V rounded as it enters the cache, `kv_round`) and gives that engine its numbers
(`Rules.with_kv`): the tolerance, near-tie budget and score tolerance are the larger of the model's and the stored
KV's; a format whose flip rate's bound reaches `VACUOUS_FLIP_RATE` leaves nothing to check (its token checks are a
named skip). Integer formats are simulated as symmetric absmax groups of `KV_GROUP` values along head_dim (llama.cpp's
q8_0 and q4_0 blocks), every position quantized. It is one scheme, not a bound on every scheme: an asymmetric min-max
group's step is at most a symmetric one's, and recent positions kept in full precision (transformers'
QuantizedCache) lower the noise, but larger groups (quanto's 64) can raise it; the margin is NOISE_FACTOR, and an
engine whose scheme is noisier than this fails, as its own twin shows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pytest_kvcompile.config.tolerances import (
    FALSE_ALARM,
    MEASURED_DTYPES,
    POWER,
    POWER_MULTIPLE,
    binomial_tail,
    power,
)
from pytest_kvcompile.contract.engine import Lowered, ModelSpec, dtype_name
from pytest_kvcompile.models.checkpoints import max_positions
from pytest_kvcompile.oracles.computations import (  # noqa: F401 (re-exported: the rule's computations)
    CHUNK,
    COMPANION,
    COMPUTATIONS,
    KV_GROUP,
    Computations,
    KVComputation,
    kv_round,
)
from pytest_kvcompile.oracles.truth import HighPrecisionSpec, Widened, high_precision, load_lm  # noqa: F401 (re-exported)

REDUCED = MEASURED_DTYPES  # dtypes judged by this module's rule
NOISE_FACTOR = 1.5
TOP = 8  # the truth's top tokens whose differences to the best are measured
QUANTILE = 0.99  # of the per-position errors: the scale
# one block of calibration prompts: their lengths, steps per prompt, the seed of the first block
CALIBRATION = ((3, 17, 40, 90, 7, 130, 25, 60, 12, 33, 70, 5, 110, 48, 21, 9), 32, 230)
#: then one prompt of each length past the blocks' longest, so the noise covers every length a check attends over (the
#: prefix suite's flood and its extended prompts, the concurrency suite's long requests, the long generations up to
#: 1024 positions), each capped where the model's positions end (`long_prompts`; issue 59)
LONG_CALIBRATION = (256, 990)
MIN_FLIPS = 8  # calibration adds blocks until the noisiest computation flipped this often...
MAX_BLOCKS = 8  # ...or this many blocks (4096 positions)
# a KV format flipping this share of greedy choices (upper bound): its near ties, budgeted at that rate, let through
# nearly any token, so no token check can tell a bug from it
VACUOUS_FLIP_RATE = 0.25


def reduced(dtype: torch.dtype | str) -> bool:
    """Whether verdicts in `dtype` follow this module's rule (bfloat16, float16)."""
    return (dtype if isinstance(dtype, str) else dtype_name(dtype)) in REDUCED


def calibration_prompts(vocab_size: int, blocks: int) -> list[list[int]]:
    """The first `blocks` blocks of calibration prompts (`CALIBRATION`: one block is its lengths, drawn in order from
    one generator; a longer list starts with a shorter one)."""
    lengths, _, seed = CALIBRATION
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist()
            for _ in range(blocks) for length in lengths]


def long_prompts(vocab_size: int, positions: int | None, needed: int | None = None) -> list[list[int]]:
    """One calibration prompt of each `LONG_CALIBRATION` length, capped so that it and the steps fit in `positions`
    (the model's limit; None: none) beside the padded computation's longer companion, those not longer than the
    blocks' longest left out. `needed` (a smaller --kv-profile's checks attend this many positions at most): only
    the first of them up to one covering it, none where the blocks cover it (the same prompts as far as they go)."""
    lengths, steps, seed = CALIBRATION
    capped = sorted({min(n, positions - steps - COMPANION) if positions else n for n in LONG_CALIBRATION})
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in capped if n > max(lengths)]
    if needed is None:
        return prompts
    covered = max(lengths) + steps
    kept = []
    for prompt in prompts:
        if covered >= needed:
            break
        kept.append(prompt)
        covered = len(prompt) + steps
    return kept


def limited_to(spec: ModelSpec, needed: int | None) -> int | None:
    """The positions a calibration for checks attending `needed` positions covers where that leaves long prompts out
    (`long_prompts`), else None (the whole calibration: a run with every check)."""
    lengths, steps, _ = CALIBRATION
    positions = max_positions(spec.config)
    kept = long_prompts(spec.vocab_size, positions, needed)
    if needed is None or len(kept) == len(long_prompts(spec.vocab_size, positions)):
        return None
    return max([max(lengths), *map(len, kept)]) + steps


def difference_errors(truth: torch.Tensor, computed: torch.Tensor, best: torch.Tensor,
                      others: torch.Tensor) -> torch.Tensor:
    """|(c[b] - c[o]) - (t[b] - t[o])| for each row's best b [n] and other tokens o [n, k]: [..., n, k]."""
    error = computed - truth
    return (error.gather(-1, others.expand(*error.shape[:-1], others.size(-1)))
            - error.gather(-1, best[:, None].expand(*error.shape[:-1], 1))).abs()


# --------------------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True)
class Noise:
    """The measured noise of one model in one 16-bit dtype (module docstring), and the verdict numbers it gives."""

    model: str
    dtype: str
    scale: float  # QUANTILE of the per-position top-TOP difference errors, over computations
    max_error: float  # the largest of them
    median_error: float
    flips: int  # positions where the most-flipping computation's argmax is not the truth's
    positions: int  # positions per computation
    logit_error: float  # the largest absolute logit error of any computation (any token): score() rows
    per_computation: dict[str, dict[str, float]]  # name -> max, p99, flips, beyond
    kv_dtype: str | None = None  # the noise of a KV cache stored in this dtype (KVComputation), not of the model
    beyond: int = 0  # positions where the noisiest computation's error exceeds the median error (`logit_threshold`)
    #: the largest ratio, at one position, of one family's logit error to the other's (`score_spread`)
    spread: float = NOISE_FACTOR
    attended: int = 0  # the most positions attended in calibration (its longest prompt + steps; 0: not recorded)
    long_scale: float = 0.0  # QUANTILE of the errors at the long prompts' positions alone (`long_prompts`)
    limited: bool = False  # long prompts left out (a smaller --kv-profile): no sequence past `attended` is judged
    #: scale and max_error from the computations routed as the truth routes (a mixture-of-experts model: rounding
    #: alone, `Computations.along(pinned=True)`); the rates from them routing on their own
    routed: bool = False
    seconds: float = 0.0  # the calibration's own wall time where it was measured (truth references it computed too)
    cached: bool = False  # read from the store (the cache dir, or recorded references) instead of measured
    #: the largest ratio of one computation's error on one top-TOP difference to another attention family's spread
    #: (RMS over the differences) at the same position (`reach`): the rule's position term (`LocalNoise.allowed`)
    reach: float = 0.0
    #: the noise of matmuls quantising their inputs so (KVComputation; Declaration.matmul_inputs), with kv_dtype's
    matmul_inputs: str | None = None

    @property
    def lowered(self) -> Lowered | None:
        """What this noise computed below the model's dtype (an engine's declaration), or None: the model's own."""
        return Lowered(self.kv_dtype, self.matmul_inputs) if self.kv_dtype or self.matmul_inputs else None

    @property
    def tolerance(self) -> float:
        """The near-tie tolerance where the local term is not larger: NOISE_FACTOR x scale."""
        return NOISE_FACTOR * self.scale

    @property
    def score_tolerance(self) -> float:
        return NOISE_FACTOR * self.logit_error

    @property
    def score_spread(self) -> float:
        """score()'s local factor: a row may be this many times the computations' largest logit error at its own
        position (`LocalNoise.score_allowed`), never less than NOISE_FACTOR."""
        return max(NOISE_FACTOR, self.spread)

    @property
    def flip_rate(self) -> float:
        return self.flips / self.positions if self.positions else 0.0

    @property
    def flip_rate_bound(self) -> float:
        """Upper 97.5% (Clopper-Pearson) bound of the flip rate: calibration sees few positions."""
        return upper_bound(self.flips, self.positions)

    def max_near_ties(self, steps: int) -> int:
        """Near ties allowed in one sequence of `steps`: more happen with probability < FALSE_ALARM at the bound."""
        return budget(steps, self.flip_rate_bound)

    @property
    def logit_threshold(self) -> float:
        """A score() row farther than this from the truth (on its top-TOP differences) is beyond the median noise."""
        return self.median_error

    @property
    def beyond_rate(self) -> float:
        return self.beyond / self.positions if self.positions else 0.0

    @property
    def beyond_rate_bound(self) -> float:
        """Upper 97.5% (Clopper-Pearson) bound of the beyond rate, as of the flip rate."""
        return upper_bound(self.beyond, self.positions)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(tolerance=self.tolerance, score_tolerance=self.score_tolerance, flip_rate=self.flip_rate,
                   flip_rate_bound=self.flip_rate_bound, factor=NOISE_FACTOR, logit_threshold=self.logit_threshold,
                   beyond_rate=self.beyond_rate, beyond_rate_bound=self.beyond_rate_bound,
                   score_spread=self.score_spread,
                   positions_needed=positions_needed(self))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Noise:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    @property
    def _lengths(self) -> str:
        if self.limited:
            return f" attending up to {self.attended}, as far as the run's checks attend"
        return f" attending up to {self.attended}, p99 {self.long_scale:.3g} on the long ones" if self.attended else ""

    def covers(self, positions: int) -> bool:
        """Whether a sequence attending `positions` may be judged by these numbers: a calibration limited to what a
        smaller --kv-profile's checks attend covers no farther (`limited`)."""
        return not self.limited or positions <= self.attended

    def describe(self) -> str:
        if self.lowered:
            return (f"noise of '{self.model}' with {self.lowered} ({self.dtype} run): scale "
                    f"{self.scale:.3g} (p99 of the error on top-{TOP} logit differences vs the oracle over "
                    f"{self.positions} positions{self._lengths}; max {self.max_error:.3g}), tie tolerance "
                    f"{self.tolerance:.3g} = {NOISE_FACTOR:g} x scale, flip rate {self.flip_rate:.1%}, score tolerance "
                    f"{self.score_tolerance:.3g}")
        oracle = self.per_computation.get(COMPUTATIONS[0], {})
        routed = "; the scale with every token routed as the truth routes (routing near ties: alternatives)" \
            if self.routed else ""
        counted = len(self.per_computation) or len(COMPUTATIONS)
        reach = f", or {self.reach:.3g} x its spread there" if self.reach else ""
        return (f"{self.dtype} noise of '{self.model}': scale {self.scale:.3g} (p99 of the error on top-{TOP} logit "
                f"differences of {counted} equivalent computations vs float64 over {self.positions} positions"
                f"{self._lengths}; max {self.max_error:.3g}), tie tolerance {self.tolerance:.3g} = {NOISE_FACTOR:g} x "
                f"scale (or x the noise at the position{reach}), flip rate {self.flip_rate:.1%}{routed}; "
                f"transformers' own {self.dtype} path flips vs the truth at {int(oracle.get('flips', 0))}/"
                f"{self.positions} positions (verdicts use the truth)")


def calibrate(spec: ModelSpec, truth: Any, computations: Computations | KVComputation | None = None,
              needed: int | None = None) -> Noise:
    """Measure `spec`'s noise (module docstring) over `computations` (default: the equivalent 16-bit ones; a
    `KVComputation`: a KV cache stored lower) on blocks of `calibration_prompts` until MIN_FLIPS (or MAX_BLOCKS).
    `truth`: the oracle judging the run (``reference(prompt, n)``); `needed`: the most positions the run's checks
    attend, where a smaller --kv-profile bounds them (`long_prompts`; None: every length)."""
    started = time.perf_counter()
    lengths, steps, _ = CALIBRATION
    computations = computations or Computations(spec)
    names = computations.names
    top_errors, pair_errors, logit_rows = [], [], []
    flips = torch.zeros(len(names), dtype=torch.long)
    # a mixture-of-experts model: the scale from its computations routed as the truth routes (rounding alone; a
    # near-tied routing decision taken the other way is routing.alternatives' to follow), the rates as they route
    routed = bool(getattr(computations, "routed", False))
    rounding: list[torch.Tensor] = []
    rounding_pairs: list[torch.Tensor] = []  # [K, steps, TOP] routed as the truth routes: `reach` from rounding alone
    prompts = calibration_prompts(spec.vocab_size, MAX_BLOCKS)
    longer = long_prompts(spec.vocab_size, max_positions(spec.config), needed)

    def measure(prompt: list[int]) -> None:
        nonlocal flips
        ref = truth.reference(prompt, steps)
        t = ref.logits.double()
        computed = computations.along(prompt, ref.tokens)  # [K, steps, vocab]
        best, others = t.argmax(-1), t.topk(TOP, dim=-1).indices
        pairs = difference_errors(t, computed, best, others)  # [K, steps, TOP]
        pair_errors.append(pairs)
        top_errors.append(pairs.amax(-1))  # [K, steps]
        if routed:
            pinned = difference_errors(t, computations.along(prompt, ref.tokens, pinned=True), best, others)
            rounding_pairs.append(pinned)
            rounding.append(pinned.amax(-1))
        logit_rows.append((computed - t).abs().amax(-1))  # [K, steps]
        flips += (computed.argmax(-1) != best).sum(-1)

    for i, prompt in enumerate(prompts):
        measure(prompt)
        if (i + 1) % len(lengths) == 0 and int(flips.max()) >= MIN_FLIPS:
            break
    for prompt in longer:
        measure(prompt)
    errors = torch.cat(top_errors, dim=1)  # [K, positions]
    scaled = torch.cat(rounding, dim=1) if routed else errors
    tail = scaled[:, scaled.size(1) - len(longer) * steps:]  # the long prompts' positions
    median = float(errors.flatten().median())
    beyond = (errors > median).sum(-1)
    per = {name: {"max": float(errors[i].max()), "p99": float(errors[i].quantile(QUANTILE)), "flips": int(flips[i]),
                  "beyond": int(beyond[i])} for i, name in enumerate(names)}
    logits = torch.cat(logit_rows, dim=1)  # [K, positions]
    return Noise(spec.name, dtype_name(spec.dtype), float(scaled.flatten().quantile(QUANTILE)), float(scaled.max()),
                 median, int(flips.max()), errors.size(1), float(logits.max()), per,
                 getattr(computations, "kv_dtype", None), int(beyond.max()), family_spread(logits, names),
                 max(len(p) for p in prompts[:i + 1] + longer) + steps,
                 float(tail.flatten().quantile(QUANTILE)) if longer else 0.0, limited_to(spec, needed) is not None,
                 routed, round(time.perf_counter() - started, 2),
                 reach=reach(torch.cat(rounding_pairs if routed else pair_errors, dim=1), names),
                 matmul_inputs=getattr(computations, "matmul_inputs", None))


def spreads(pairs: torch.Tensor) -> torch.Tensor:
    """RMS over the top-TOP differences (the best's own, always 0, left out) of errors [..., TOP]: [...]."""
    return pairs[..., 1:].pow(2).mean(-1).sqrt()


def reach(pairs: torch.Tensor, names: Sequence[str]) -> float:
    """How far one correct computation's error on one difference reaches beyond another's spread at the same
    position (`pairs`: [computations, positions, TOP] errors): the largest of each computation's pair errors over the
    largest spread (`spreads`) of the computations of the other attention families there (of the others, one family
    alone: GPT-OSS's eager), floored at the median position's spread (a position where every computation is a few
    ulps off is no amplification to scale by). One computation alone (a KV cache stored lower): 0, no such term."""
    if pairs.size(0) < 2 or not pairs.numel():
        return 0.0
    families = [name.split(",")[0] for name in names]
    spread = spreads(pairs)  # [K, positions]
    floor = spread.amax(0).median().clamp(min=1e-12)
    worst = 0.0
    for k, family in enumerate(families):
        others = [j for j, f in enumerate(families) if f != family] or [j for j in range(len(families)) if j != k]
        scale = torch.maximum(spread[others].amax(0), floor)  # [positions]
        worst = max(worst, float((pairs[k] / scale[:, None]).max()))
    return worst


def family_spread(logits: torch.Tensor, names: Sequence[str]) -> float:
    """The largest ratio, at one position, of one family's largest logit error to the other family's (`logits`:
    [computations, positions]; a family: the computations sharing an attention kernel, the first word of their
    name): how far one correct computation's error can be from another's at the same position, where rounding is
    amplified alike for all (`Noise.score_spread`). One family alone: NOISE_FACTOR."""
    families = sorted({name.split(",")[0] for name in names})
    if len(families) < 2:
        return NOISE_FACTOR
    worst = torch.stack([logits[[i for i, n in enumerate(names) if n.split(",")[0] == f]].amax(0) for f in families])
    floor = worst.max(0).values.median()  # positions where every family is far below the typical error: ratios of
    ratio = worst.amax(0) / worst.amin(0).clamp(min=float(floor) * 1e-3)  # rounding ulps, not of amplification
    return float(ratio[worst.amax(0) > floor].max()) if bool((worst.amax(0) > floor).any()) else NOISE_FACTOR


def logit_errors(truth: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Per step, the largest error of `scored` rows on the `truth` rows' top-TOP differences to their best (the
    calibration's statistic; ids at -inf in `truth` are out of its choice): [steps]."""
    if not len(truth):
        return torch.zeros(0, dtype=torch.float64)
    truth = truth.double()
    best, others = truth.argmax(-1), truth.topk(min(TOP, truth.size(-1)), dim=-1).indices
    return difference_errors(truth, scored.double()[None], best, others).amax(-1)[0]


class LocalNoise:
    """The rule's local terms along an engine's tokens: `allowed(step, best, token, truth_row)` = NOISE_FACTOR x the
    largest error of the computations on t[best] - t[token] at that step, or `reach` (Noise.reach; 0: none) x their
    `spread` there, whichever is larger. `rounding` (a mixture-of-experts model): the same computations routed as the
    truth routes (Computations.along pinned), read lazily: the spread comes from them, as `reach` was measured, so a
    computation routing a near tie the other way (routing.alternatives' to follow) does not widen it."""

    def __init__(self, computed: torch.Tensor, reach: float = 0.0,
                 rounding: Callable[[], torch.Tensor] | None = None):
        self.computed = computed  # [K, steps, vocab] along the engine's tokens
        self.reach = reach
        self._rounding = rounding

    def errors(self, step: int, best: int, token: int, truth_row: torch.Tensor) -> torch.Tensor:
        """Each computation's error on t[best] - t[token] at `step`: [K]."""
        row = self.computed[:, step].double()
        truth_row = truth_row.double()
        return ((row[:, best] - row[:, token]) - (truth_row[best] - truth_row[token])).abs()

    def error(self, step: int, best: int, token: int, truth_row: torch.Tensor) -> float:
        return float(self.errors(step, best, token, truth_row).max())

    def spread(self, step: int, truth_row: torch.Tensor) -> float:
        """The largest of the computations' RMS errors over the truth row's top-TOP differences at `step`."""
        truth_row = truth_row.double()
        best, others = truth_row.argmax()[None], truth_row.topk(min(TOP, truth_row.numel())).indices[None]
        computed = self._rounding() if self._rounding is not None else self.computed
        pairs = difference_errors(truth_row[None], computed[:, step:step + 1].double(), best, others)
        return float(spreads(pairs).max())

    def allowed(self, step: int, best: int, token: int, truth_row: torch.Tensor) -> float:
        pair = NOISE_FACTOR * self.error(step, best, token, truth_row)
        return max(pair, self.reach * self.spread(step, truth_row)) if self.reach else pair

    def score_allowed(self, step: int, truth_row: torch.Tensor, excluded: Sequence[int] = (),
                      spread: float = NOISE_FACTOR) -> float:
        """score()'s local term: `spread` (`Noise.score_spread`) x the computations' largest absolute logit error at
        this step (ids in `excluded` left out): a position the network amplifies rounding at is far off for every
        computation, by as much as one family of them is from another there."""
        error = (self.computed[:, step].double() - truth_row.double()).abs()
        if excluded:
            error[:, list(excluded)] = 0
        return spread * float(error.max())


@dataclasses.dataclass(frozen=True)
class Rules:
    """The verdict numbers on one model: tie tolerance, near-tie budget per sequence (None: none), score()
    tolerance, and the noise the 16-bit ones were measured from (None: the options' values, or float32's constants).
    The run's near-tie rate is a reports rule (verdicts/run_rules.py: run_problems, from each row's noise)."""

    tie_tolerance: float
    max_near_ties: int | None
    score_tolerance: float
    noise: Noise | None = None

    @classmethod
    def of(cls, settings: Any, noise: Noise | None) -> Rules:
        """From the run's settings (None = measured: needs `noise`). Without noise in 16-bit (a model transformers
        cannot run, with the numbers given explicitly) the given tie tolerance also bounds score() rows."""
        from pytest_kvcompile.config.tolerances import DEFAULT_SCORE_TOLERANCE

        if noise is None:
            return cls(settings.tie_tolerance, settings.max_near_ties,
                       DEFAULT_SCORE_TOLERANCE.get(settings.dtype, settings.tie_tolerance))
        return cls(noise.tolerance if settings.tie_tolerance is None else settings.tie_tolerance,
                   noise.max_near_ties(settings.max_new_tokens) if settings.max_near_ties is None
                   else settings.max_near_ties, noise.score_tolerance, noise)


    def with_kv(self, kv: Noise, steps: int) -> Rules:
        """An engine computing lower as it declares (its KV cache stored lower, its matmul inputs quantised:
        Declaration.lowered): the larger of these numbers and those of that computation's measured noise `kv` (module
        docstring); `kv` is the noise its reports show."""
        ties = None if self.max_near_ties is None else max(self.max_near_ties, kv.max_near_ties(steps))
        if self.noise is not None and self.noise.flip_rate_bound > kv.flip_rate_bound:  # the run's rates: never below
            kv = dataclasses.replace(kv, flips=self.noise.flips, positions=self.noise.positions,  # the model's own
                                     beyond=self.noise.beyond, median_error=self.noise.median_error)
        if self.noise is not None:
            kv = dataclasses.replace(kv, spread=max(kv.spread, self.noise.spread))
        return Rules(max(self.tie_tolerance, kv.tolerance), ties, max(self.score_tolerance, kv.score_tolerance), kv)


# --------------------------------------------------------------------------- budgets


def upper_bound(successes: int, trials: int, confidence: float = 0.975) -> float:
    """Clopper-Pearson upper bound of a rate seen `successes` times in `trials` (bisection on the binomial)."""
    if trials == 0:
        return 1.0
    lo, hi = successes / trials, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1 - binomial_tail(trials, mid, successes + 1) < 1 - confidence:  # P(X <= successes) at mid
            hi = mid
        else:
            lo = mid
    return hi


def budget(steps: int, rate: float) -> int:
    """The smallest k such that a sequence of `steps` at flip `rate` has more than k near ties with probability
    below FALSE_ALARM."""
    return next(k for k in range(steps + 1) if binomial_tail(steps, rate, k + 1) < FALSE_ALARM)


def positions_needed(noise: Noise) -> int:
    """Verified positions (whole calibration prompts of CALIBRATION's steps) at which an engine flipping at
    POWER_MULTIPLE x the measured flip rate fails the run-level near-tie rule (binomial at the rate's bound,
    FALSE_ALARM) with probability >= POWER; the calibration's MAX_BLOCKS blocks where none reach it (a rate too low
    to measure: its bound is above POWER_MULTIPLE x itself)."""
    lengths, steps, _ = CALIBRATION
    lo, hi = 1, MAX_BLOCKS * len(lengths)  # prompts; power grows with them (bisection: up to a prompt or two more)
    rate, bound = POWER_MULTIPLE * noise.flip_rate, noise.flip_rate_bound
    if power(hi * steps, bound, rate) < POWER:
        return hi * steps
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power(mid * steps, bound, rate) >= POWER else (mid + 1, hi)
    return lo * steps
