"""Numeric tolerances of float32 verdicts, with where each number comes from, and the binomial rules of 16-bit
verdicts (near-tie budgets, the run-level rates and their power). No torch and no other pytest_kvcompile import:
options, verdicts, oracles and the plugin read them.

bfloat16 and float16 have no constants: their verdict numbers are measured per model from the noise of equivalent
computations against a float64 truth (oracles/precision.py, docs/precision.md). A dtype missing here is measured.
"""

import math

#: Dtypes whose verdict numbers are measured per model (oracles/precision.py), not constants.
MEASURED_DTYPES = ("bfloat16", "float16")
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
#: The run-level rates' power: an engine POWER_MULTIPLE x as noisy as the dtype's computations fails with probability
#: >= POWER over the positions the suites verify for them (oracles/precision.py: positions_needed).
POWER, POWER_MULTIPLE = 0.9, 5


def binomial_tail(n: int, p: float, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, p) (terms summed in log space: n may be thousands)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
        total += term
        if i > n * p and term <= total * 1e-17:  # past the mode the terms only fall: the rest is below rounding
            break
    return min(1.0, total)


def run_rate_exceeded(ties: int, verified: int, rate: float) -> bool:
    """Whether `ties` near ties in `verified` tokens are implausible (< FALSE_ALARM) for a correct engine at `rate`."""
    return verified > 0 and binomial_tail(verified, rate, ties) < FALSE_ALARM


def critical(n: int, p: float) -> int:
    """The fewest events in `n` trials that a rate `p` reaches with probability < FALSE_ALARM (n + 1: none)."""
    lo, hi = 0, n + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if binomial_tail(n, p, mid) < FALSE_ALARM else (mid + 1, hi)
    return lo


def power(n: int, null: float, rate: float) -> float:
    """The chance that `n` trials at `rate` show more events than a rate `null` explains (the binomial test at
    FALSE_ALARM): how likely a rule comparing with `null` fails an engine at `rate`."""
    return binomial_tail(n, rate, critical(n, null))
