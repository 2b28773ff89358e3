"""The 16-bit noise of a scoring eviction policy's cuts (`calibrate_scores`): how far the policy's scores computed in
the run's dtype are from the float64 truth's where the truth cuts, giving the eviction near-tie tolerance
(`ScoreNoise.tolerance`) that the truth's forks and its 16-bit guide (eviction.py, `EvictionOracle.teacher_forced_run`)
allow."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pytest_kvcompile.contract.engine import ModelSpec, Strategy
from pytest_kvcompile.oracles.eviction import EMPTY, EVICTION_TIE_TOLERANCE, EvictionOracle, policy_for
from pytest_kvcompile.oracles.precision import NOISE_FACTOR

CUT_BAND = 8  # kept and evicted candidates nearest a cut whose score differences are measured


@dataclass(frozen=True)
class ScoreNoise:
    """The measured 16-bit noise of a scoring policy's cuts on one model (`calibrate_scores`) and the eviction tie
    tolerance it gives: NOISE_FACTOR x `scale`."""

    policy: str
    scale: float  # QUANTILE over cuts of the largest relative error on a score difference near the cut
    max_error: float
    cuts: int  # cuts measured
    flips: int  # cuts where the 16-bit computation kept another set than the truth

    @property
    def tolerance(self) -> float:
        """NOISE_FACTOR x scale, never below float32's constant."""
        return max(NOISE_FACTOR * self.scale, EVICTION_TIE_TOLERANCE["float32"])

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tolerance": self.tolerance, "factor": NOISE_FACTOR}

    @classmethod
    def from_dict(cls, data: dict) -> ScoreNoise:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def _cut_errors(truth: torch.Tensor, low: torch.Tensor, alive: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
    """Per KV head [kv_heads]: the largest |(l_a - l_b) - (t_a - t_b)| / max(|t_a|, |t_b|) over the CUT_BAND lowest
    kept a and highest evicted b (truth's scores); -1 where a head has no cut."""
    out = torch.full((truth.size(0),), -1.0, dtype=torch.float64)
    for head in range(truth.size(0)):
        kept = (alive[head] & usable[head]).nonzero()[:, 0]
        gone = (~alive[head] & usable[head]).nonzero()[:, 0]
        if not len(kept) or not len(gone):
            continue
        a = kept[truth[head, kept].argsort()[:CUT_BAND]]
        b = gone[truth[head, gone].argsort(descending=True)[:CUT_BAND]]
        t_a, t_b, l_a, l_b = truth[head, a][:, None], truth[head, b][None], low[head, a][:, None], low[head, b][None]
        error = ((l_a - l_b) - (t_a - t_b)).abs() / torch.maximum(t_a.abs(), t_b.abs()).clamp(min=1e-300)
        out[head] = error.max()
    return out


@torch.inference_mode()
def calibrate_scores(spec: ModelSpec, strategy: Strategy, truth: EvictionOracle | None = None,
                     low: EvictionOracle | None = None) -> ScoreNoise | None:
    """Measure how far a 16-bit computation of `strategy`'s scores is from the truth at the cuts (None: the policy
    ranks by position, nothing to measure). The 16-bit oracle (`spec`) and the float64 truth of its weights run in
    lockstep on `precision.CALIBRATION` prompts along the truth's greedy tokens; after each step the 16-bit one is
    given the truth's kept sets (its own scores, H2O's sums included, go on), so every cut is measured where the truth
    makes it. Per cut (per KV head, or per layer for a per-layer policy): the largest error on a score difference
    between the CUT_BAND lowest kept and highest evicted candidates, relative to the larger truth score."""
    from pytest_kvcompile.oracles.precision import CALIBRATION, QUANTILE, high_precision

    policy = policy_for(strategy)
    if not policy.scored:
        return None
    truth = truth or EvictionOracle(high_precision(spec), strategy)
    low = low or EvictionOracle(spec, strategy)  # the 16-bit computation (a truth's guide, where it has one)
    lengths, steps, seed = CALIBRATION
    generator = torch.Generator().manual_seed(seed)
    errors, flips = [], 0
    for length in lengths:
        prompt = torch.randint(0, spec.vocab_size, (length,), generator=generator).tolist()
        tokens = truth.reference(prompt, steps).tokens
        t, l_ = truth._start(), low._start()
        for i in range(steps):
            inputs = tokens[i - 1:i] if i else prompt
            before = set(t.masks.alive)
            truth._step(t, inputs)
            low._step(l_, inputs)
            for layer, alive in t.masks.alive.items():
                if policy.prefill_only and layer in before:  # compressed once, then keeps everything
                    continue
                seen = t.masks.seen[layer][0]
                n = seen.size(-1)
                pos = torch.where(seen, torch.arange(n, device=seen.device), EMPTY)
                usable = seen & ~policy.protected(pos, torch.tensor(n - 1, device=seen.device))
                if int((alive[0] != seen).sum()) == 0:  # nothing evicted at this step
                    continue
                found = _cut_errors(t.masks.scores[layer][0].double().cpu(), l_.masks.scores[layer][0].double().cpu(),
                                    alive[0].cpu(), usable.cpu())
                found = found if policy.per_head else found[:1]
                errors += [float(e) for e in found if e >= 0]
                flips += int(not torch.equal(l_.masks.alive[layer], alive))
                l_.masks.alive[layer] = alive.clone()
    if not errors:
        return ScoreNoise(str(policy.strategy), 0.0, 0.0, 0, 0)
    found = torch.tensor(errors, dtype=torch.float64)
    return ScoreNoise(str(policy.strategy), float(found.quantile(QUANTILE)), float(found.max()), len(errors), flips)
