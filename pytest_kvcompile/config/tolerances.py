"""Numeric tolerances of float32 verdicts, with where each number comes from, and the binomial rule of 16-bit
near-tie budgets. No torch and no other pytest_kvcompile import: options, verdicts and oracles read them.

bfloat16 and float16 have no constants: their verdict numbers are measured per model from the noise of equivalent
computations against a float64 truth (oracles/precision.py, docs/precision.md). A dtype missing here is measured.
"""

import math

#: Tie tolerance (max logit gap that counts as a near tie). float32: correct engines (inductor on CPU and H100,
#: transformers' eager and SDPA paths) differ from the float64 truth by ~1e-5 (docs/precision.md); 1e-3 leaves room
#: for other kernels and stays far below any cache or position bug (whole logits).
DEFAULT_TIE_TOLERANCE = {"float32": 1e-3}
#: Near-tie budget per sequence (``--kv-max-near-ties auto``).
DEFAULT_MAX_NEAR_TIES = {"float32": 2}
#: Near ties per verified token over an engine's run (``--kv-max-near-tie-rate auto``).
DEFAULT_MAX_NEAR_TIE_RATE = {"float32": 0.01}
#: How far a declared ``score()`` row may be from the oracle's logits (max abs difference).
DEFAULT_SCORE_TOLERANCE = {"float32": 1e-2}

#: Chance that a correct engine exceeds a measured near-tie budget (16-bit, oracles/precision.py).
FALSE_ALARM = 1e-4


def binomial_tail(n: int, p: float, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, p) (terms summed in log space: n may be thousands)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
                for i in range(k, n + 1))
    return min(1.0, total)


def run_rate_exceeded(ties: int, verified: int, rate: float) -> bool:
    """Whether `ties` near ties in `verified` tokens are implausible (< FALSE_ALARM) for a correct engine at `rate`."""
    return verified > 0 and binomial_tail(verified, rate, ties) < FALSE_ALARM
