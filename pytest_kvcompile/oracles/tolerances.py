"""Numeric tolerances of the verdicts, per dtype, with where each number comes from. No torch: options read them."""

#: Default tie tolerance (max logit gap that counts as a near tie) per dtype. bfloat16 from data (docs/gpu-results.md,
#: benchmarks/calibrate_ties.py): correct engines diverged from the oracle at gaps up to 0.5 (hf-static-compile, H100)
#: and 0.25 (eviction engines, CPU inductor); 1.5 x the largest. float32 and float16: no divergence seen on the H100.
DEFAULT_TIE_TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 0.75}
#: Default near-tie budget per sequence (``--kv-max-near-ties auto``), per dtype.
DEFAULT_MAX_NEAR_TIES = {"float32": 2, "float16": 3, "bfloat16": 3}
#: Default near ties per verified token over an engine's run (``--kv-max-near-tie-rate auto``), per dtype. Measured
#: on correct engines (full recompute vs the cached oracle, tiny zoo): bfloat16 up to 3.4% on one model, 1.5% overall.
DEFAULT_MAX_NEAR_TIE_RATE = {"float32": 0.01, "float16": 0.05, "bfloat16": 0.05}
#: How far a declared ``score()`` row may be from the oracle's logits (max abs difference), per dtype.
DEFAULT_SCORE_TOLERANCE = {"float32": 1e-2, "float16": 0.25, "bfloat16": 1.0}
