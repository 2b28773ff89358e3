"""Calibrate the `auto` tie tolerances: the oracle's logit gaps where CORRECT engines diverge, per dtype.

float32's numbers are constants (config/tolerances.py) this script checks; bfloat16's and float16's are measured per
model at run time (oracles/precision.py), and here they are what the gaps are compared with ("current").

The plugin judges an engine's greedy token at each step by the oracle's logits given the engine's own prefix
(pytest_kvcompile/oracles/token_match.py): the oracle's best there, a near tie when the best beats it by at most the
tie tolerance (`DEFAULT_TIE_TOLERANCE` per dtype, `--kv-tie-tolerance auto`), else a mismatch. This script
measures those gaps on engines that are right, so `auto` can be set from data:

For each dtype (--dtypes), zoo model (--models; pytest_kvcompile/models/zoo.py) and engine (--engines; every engine
held to the exact strategy), N prompts (--prompts; random ids, lengths cycling through `LENGTHS`, one built
engine serves them all, one prompt per generate call): engine.generate([prompt], K) (--new-tokens), then the
oracle (`HFEagerOracle`, same device and dtype) teacher-forced on prompt + the engine's tokens
(`Reference.given`: its greedy logits where the engine followed it). Per step:

    gap = max oracle logit - oracle logit of the engine's token        (0 where the engine took the argmax)

Per dtype, model and engine: steps, divergences (gap > 0), sequences with one, the most in one sequence (the
near-tie budget `DEFAULT_MAX_NEAR_TIES`), the rate per step (`DEFAULT_MAX_NEAR_TIE_RATE`), max gap and
p50/p99/p99.9 of the nonzero gaps, how many would be mismatches at today's tolerance, and the same gaps under
the float64 independent path (oracles/store.py `independent`: how far the engine is from the model's exact
math). The oracle itself: its greedy tokens under that float64 path (the oracles/store.py self-check, whose
allowance is `ORACLE_CHECK_TOLERANCE`), and its own top-2 margins (how often a step is that close at all).

Suggested tie tolerance per dtype: the largest gap of any engine x 1.5, rounded up to 1, 1.5, 2, 3, 5 or 7.5
x 10^k. An engine with a gap over --suspect-gap (1 logit) is listed as a suspect and left out: that is a
real mismatch (a bug, or a reference engine behind the installed transformers), not rounding.
Engines that cannot be built (model or device not supported, not registered) are listed as skipped.

    python benchmarks/calibrate_ties.py --json ties.json --md ties.md                      # CPU, all dtypes
    python benchmarks/calibrate_ties.py --dtypes float32 --models llama --prompts 2 --backend eager

One GPU run, about 3 minutes on an H100 with the defaults (bfloat16, float16, float32 in that order x llama,
gemma4-kvshared; 32 prompts x 32 new tokens; inductor, whose compiles take most of it). Groups and engines
not started within --time-budget are skipped and listed (float32 goes first), and the JSON and Markdown are
rewritten after every group, so a run cut short keeps what it measured:

    python benchmarks/calibrate_ties.py --device cuda --time-budget 140 --json ties-gpu.json --md ties-gpu.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch
import transformers

from bench_strategies import DTYPES, device_problem, machine, release, synchronize, write_outputs
from pytest_kvcompile.config.tolerances import (
    DEFAULT_MAX_NEAR_TIE_RATE,
    DEFAULT_MAX_NEAR_TIES,
    DEFAULT_TIE_TOLERANCE,
)
from pytest_kvcompile.contract import registry
from pytest_kvcompile.contract.engine import (
    ModelNotSupported,
    ModelSpec,
    Strategy,
    missing_capability,
)
from pytest_kvcompile.errors import EngineResolutionError
from pytest_kvcompile.models import zoo
from pytest_kvcompile.oracles import precision
from pytest_kvcompile.oracles.hf import HFEagerOracle
from pytest_kvcompile.oracles.store import ORACLE_CHECK_TOLERANCE, independent
from pytest_kvcompile.recompiles import recorder as recompiles

#: Correct engines measured by default, when registered ("hf-sdpa" is not a built-in today; the CUDA-only one is
#: listed as skipped elsewhere).
DEFAULT_ENGINES = ("hf-eager", "hf-sdpa", "ref-compiled-dynamic", "ref-static", "ref-static-cudagraph",
                   "hf-static-compile")
DEFAULT_MODELS = ("llama", "gemma4-kvshared")  # full attention; sliding + KV sharing (the oracle's largest error)
DEFAULT_DTYPES = ("bfloat16", "float16", "float32")  # the noisy ones first: a budget cut drops float32 last
#: Prompt lengths, cycled: 1, around the zoo's window (8), past 64/128/256 (RoPE tables, static caches).
LENGTHS = (1, 7, 8, 9, 19, 48, 3, 100, 130, 250, 16, 33, 64, 200, 300, 5)
SEED = 4321
QUANTILES = {"p50": 0.50, "p99": 0.99, "p99.9": 0.999}
CLEAN = (1, 1.5, 2, 3, 5, 7.5)
SUSPECT_GAP = 1.0  # a gap above this many logits is a bug, not rounding (oracles/store.py: bugs move whole units)


# --------------------------------------------------------------------------- the numbers


def step_gaps(logits: torch.Tensor, tokens) -> list[float]:
    """Per step: max logit - logit of the chosen token (0 where it is the argmax); logits [steps, vocab]."""
    rows = logits.float()
    if rows.numel() == 0:
        return []
    chosen = rows.gather(1, torch.as_tensor(list(tokens), dtype=torch.long, device=rows.device)[:, None])[:, 0]
    return (rows.amax(-1) - chosen).clamp(min=0).tolist()


def top2_margins(logits: torch.Tensor) -> list[float]:
    """Per step: best - second best logit (how close the step is to a tie at all)."""
    if logits.numel() == 0 or logits.size(-1) < 2:
        return []
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of a sorted list (the largest value for q close to 1 on few samples)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def gap_stats(per_sequence: list[list[float]], tolerance: float | None = None) -> dict:
    """Steps, divergences (gap > 0) and the distribution of the nonzero gaps, over sequences of per-step gaps."""
    nonzero = sorted(g for seq in per_sequence for g in seq if g > 0)
    counts = [sum(g > 0 for g in seq) for seq in per_sequence]
    steps = sum(map(len, per_sequence))
    out = {"sequences": len(per_sequence), "steps": steps, "divergences": len(nonzero),
           "sequences_diverged": sum(c > 0 for c in counts), "max_per_sequence": max(counts, default=0),
           "rate": len(nonzero) / steps if steps else 0.0, "max_gap": nonzero[-1] if nonzero else 0.0}
    out.update({name: quantile(nonzero, q) if nonzero else None for name, q in QUANTILES.items()})
    if tolerance is not None:
        out["over_tolerance"] = sum(g > tolerance for g in nonzero)
    out["gaps"] = [float(f"{g:.4g}") for g in nonzero]
    return out


def clean_ceiling(x: float) -> float:
    """The smallest of 1, 1.5, 2, 3, 5, 7.5 x 10^k that is >= x (0 for x <= 0)."""
    if x <= 0:
        return 0.0
    exp = math.floor(math.log10(x))
    for e in (exp - 1, exp, exp + 1):
        for m in CLEAN:
            value = float(f"{m * 10.0 ** e:.3g}")
            if value >= x:
                return value
    return float(f"{10.0 ** (exp + 1):.3g}")


def prompt_set(n: int, vocab: int, limit: int) -> list[list[int]]:
    """n prompts of random ids, lengths cycling through LENGTHS (capped at limit), reproducible."""
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, vocab, (min(LENGTHS[i % len(LENGTHS)], limit),), generator=gen).tolist()
            for i in range(n)]


# --------------------------------------------------------------------------- one dtype x model


def measure(model_name: str, dtype: str, engines: list[str], args, cache_root: Path) -> dict:
    """Every engine on one zoo model in one dtype: gaps against the oracle and the float64 path."""
    config = zoo.ZOO[model_name].build_config()
    path = zoo.checkpoint(model_name, cache_root)
    spec = ModelSpec(model_name, path, config, args.device, getattr(torch, dtype))
    noise = None if dtype in DEFAULT_TIE_TOLERANCE else precision.calibrate(  # 16-bit: measured, not a constant
        spec, HFEagerOracle(precision.high_precision(spec)))
    tol = DEFAULT_TIE_TOLERANCE[dtype] if noise is None else noise.tolerance
    k = args.new_tokens
    limit = min(getattr(config, "max_position_embeddings", 512), 512) - k - 1  # static caches hold 512 positions
    prompts = prompt_set(args.prompts, spec.vocab_size, limit)
    recompiles.reset_dynamo()  # fresh dynamo per group: transformers' shared forward wrapper starts at 0 compiles
    group = {"dtype": dtype, "model": model_name, "rows": [], "skipped": [], "seconds": {}, "tie_tolerance": tol,
             "max_near_ties": DEFAULT_MAX_NEAR_TIES[dtype] if noise is None else noise.max_near_ties(k),
             "max_near_tie_rate": DEFAULT_MAX_NEAR_TIE_RATE[dtype] if noise is None else noise.flip_rate_bound}

    start = time.perf_counter()
    oracle = HFEagerOracle(spec)
    refs = [oracle.reference(p, k) for p in prompts]
    wide, wide_name = independent(Strategy(), spec)
    forced: dict[tuple, torch.Tensor] = {}  # (prompt, tokens) -> the oracle's logits along them
    exact64: dict[tuple, torch.Tensor] = {}  # (prompt, tokens) -> the float64 path's logits along them

    def float64_rows(prompt, tokens) -> torch.Tensor:
        key = (tuple(prompt), tuple(tokens))
        if key not in exact64:
            exact64[key] = wide.teacher_forced(list(prompt), list(tokens), 0.0).float().cpu()
        return exact64[key]

    own = [step_gaps(float64_rows(r.prompt, r.tokens), r.tokens) for r in refs]
    margins = sorted(m for r in refs for m in top2_margins(r.logits))
    group["oracle"] = {
        "path": wide_name, **gap_stats(own, ORACLE_CHECK_TOLERANCE[dtype]),
        "margin": {"p1": quantile(margins, 0.01), "p5": quantile(margins, 0.05), "p50": quantile(margins, 0.5),
                   "at_or_below_tolerance": sum(m <= tol for m in margins), "steps": len(margins)} if margins else {},
    }
    group["seconds"]["oracle"] = time.perf_counter() - start

    for name in engines:
        start = time.perf_counter()
        if getattr(args, "deadline", None) is not None and start > args.deadline:  # compiles would start past it
            group["skipped"].append({"engine": name, "reason": "--time-budget spent"})
            continue
        try:
            ref = registry.resolve(name)
        except EngineResolutionError as exc:
            group["skipped"].append({"engine": name, "reason": f"not resolvable: {str(exc).split('. ')[0]}"})
            continue
        why = missing_capability(ref.declaration, spec)
        if why is None and ref.declaration.strategy.kind != "exact":
            why = f"strategy '{ref.declaration.strategy}' is judged by its own oracle, not calibrated here"
        if why:
            group["skipped"].append({"engine": name, "reason": why})
            continue
        try:
            engine = ref.build(spec, args.backend)
        except ModelNotSupported as exc:
            group["skipped"].append({"engine": name, "reason": f"not supported: {exc}"})
            continue
        except Exception as exc:  # noqa: BLE001 - an engine that cannot be built here is listed, not a crash
            group["skipped"].append({"engine": name, "reason": f"build failed: {type(exc).__name__}: {exc}"})
            continue
        gaps, wide_gaps, error = [], [], None
        for prompt, reference in zip(prompts, refs):
            try:
                got = [int(t) for t in engine.generate([prompt], k)[0]]
            except Exception as exc:  # noqa: BLE001 - recorded with the engine's row
                error = f"generate failed on a prompt of length {len(prompt)}: {type(exc).__name__}: {exc}"
                break
            if len(got) != k:
                error = f"returned {len(got)} tokens for max_new_tokens={k}"
                break
            key = (tuple(prompt), tuple(got))
            if key not in forced:
                forced[key] = reference.given(got, tol).float().cpu()
            gaps.append(step_gaps(forced[key], got))
            wide_gaps.append(step_gaps(float64_rows(prompt, got), got))
        synchronize()
        row = {"engine": name, "dtype": dtype, "model": model_name, "prompts": len(gaps),
               **gap_stats(gaps, tol), "float64": gap_stats(wide_gaps), "seconds": time.perf_counter() - start}
        if error:
            row["error"] = error
        group["rows"].append(row)
        print(f"  {dtype} {model_name} {name}: {row['divergences']} divergences in {row['steps']} steps, max gap "
              f"{row['max_gap']:.4g} (vs float64 {row['float64']['max_gap']:.4g}), {row['seconds']:.1f} s"
              + (f" [{error}]" if error else ""), flush=True)
        del engine
        release(args.device)
    return group


# --------------------------------------------------------------------------- report


def summarize(groups: list[dict], suspect_gap: float = SUSPECT_GAP) -> dict:
    """Per dtype: what the engines and the oracle showed, today's auto values and the suggested tie tolerance.

    An engine whose largest gap exceeds `suspect_gap` is a suspect (a real mismatch, e.g. a reference engine
    behind the installed transformers, not numerics): listed, counted, but left out of the suggestion and of
    the near-tie counts."""
    out = {}
    for dtype in dict.fromkeys(g["dtype"] for g in groups):
        everything = [r for g in groups if g["dtype"] == dtype for r in g["rows"]]
        rows = [r for r in everything if r["max_gap"] <= suspect_gap]
        oracles = [g["oracle"] for g in groups if g["dtype"] == dtype]
        worst = max((r["max_gap"] for r in rows), default=0.0)
        margins = [o["margin"] for o in oracles if o.get("margin")]
        out[dtype] = {
            "engines": len({r["engine"] for r in rows}), "steps": sum(r["steps"] for r in rows),
            "divergences": sum(r["divergences"] for r in rows), "max_gap": worst,
            "worst": max(rows, key=lambda r: r["max_gap"])["engine"] if worst > 0 else None,
            "suggested_tie_tolerance": clean_ceiling(1.5 * worst) if worst > 0 else None,
            "current_tie_tolerance": max(g["tie_tolerance"] for g in groups if g["dtype"] == dtype),
            "over_current": sum(r.get("over_tolerance", 0) for r in rows),
            "max_per_sequence": max((r["max_per_sequence"] for r in rows), default=0),
            "current_max_near_ties": max(g["max_near_ties"] for g in groups if g["dtype"] == dtype),
            "max_rate": max((r["rate"] for r in rows), default=0.0),
            "current_max_near_tie_rate": max(g["max_near_tie_rate"] for g in groups if g["dtype"] == dtype),
            "oracle_max_gap_float64": max((o["max_gap"] for o in oracles), default=0.0),
            "oracle_check_tolerance": ORACLE_CHECK_TOLERANCE[dtype],
            "oracle_margin_p1": min((m["p1"] for m in margins), default=None),
            "suspects": [f"{r['engine']} on {r['model']} (max gap {r['max_gap']:.3g}, {r['over_tolerance']} over "
                         f"the current tolerance)" for r in everything if r["max_gap"] > suspect_gap],
        }
    return out


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def markdown(result: dict) -> str:
    where = result["machine"].get("gpu", result["machine"].get("cpu", ""))
    about = (f"{result['date']}, device {result['settings']['device']} ({where}), torch {result['machine']['torch']}, "
             f"transformers {result['machine']['transformers']}, backend {result['settings']['backend']}, "
             f"{result['settings']['prompts']} prompts x {result['settings']['new_tokens']} new tokens, "
             f"{result.get('wall_s', 0):.0f} s")
    lines = ["## Tie calibration: oracle logit gaps where correct engines diverge", "", f"{result['command']}  ", about,
             ""]
    lines += [("| dtype | engines | steps | divergences | max gap (engine) | suggested tie tolerance | current | "
               "gaps > current | most in one sequence (current budget) | max rate (current) | oracle vs float64 max "
               "(check tolerance) | oracle top-2 margin p1 |"),
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype, s in result["summary"].items():
        suggested = fmt(s["suggested_tie_tolerance"]) if s["suggested_tie_tolerance"] is not None else "no divergence"
        cells = [dtype, s["engines"], s["steps"], s["divergences"], f"{fmt(s['max_gap'])} ({s['worst'] or '-'})",
                 suggested, fmt(s["current_tie_tolerance"]), s["over_current"],
                 f"{s['max_per_sequence']} ({s['current_max_near_ties']})",
                 f"{s['max_rate']:.2%} ({s['current_max_near_tie_rate']:.0%})",
                 f"{fmt(s['oracle_max_gap_float64'])} ({fmt(s['oracle_check_tolerance'])})",
                 fmt(s["oracle_margin_p1"])]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", ("| dtype | model | engine | steps | divergences | sequences | most in one | max gap | p50 | p99 | "
                   "p99.9 | > current tol | max gap vs float64 | s |"),
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in result["groups"]:
        for r in g["rows"]:
            engine = r["engine"] + (f" ({r['error']})" if "error" in r else "")
            cells = [r["dtype"], r["model"], engine, r["steps"], r["divergences"], r["sequences_diverged"],
                     r["max_per_sequence"], fmt(r["max_gap"]), fmt(r["p50"]), fmt(r["p99"]), fmt(r["p99.9"]),
                     r["over_tolerance"], fmt(r["float64"]["max_gap"]), f"{r['seconds']:.1f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "Oracle (transformers eager, cached) vs its float64 independent path, and its own top-2 margins:",
              "", ("| dtype | model | float64 path | steps | divergences | max gap | p50 | p99 | > check tolerance | "
                   "margin p1 | p5 | p50 | margins <= tie tolerance |"),
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in result["groups"]:
        o, m = g["oracle"], g["oracle"].get("margin", {})
        lines.append(f"| {g['dtype']} | {g['model']} | {o['path']} | {o['steps']} | {o['divergences']} | "
                     f"{fmt(o['max_gap'])} | {fmt(o['p50'])} | {fmt(o['p99'])} | {o['over_tolerance']} | "
                     f"{fmt(m.get('p1'))} | {fmt(m.get('p5'))} | {fmt(m.get('p50'))} | "
                     f"{m.get('at_or_below_tolerance', '-')} of {m.get('steps', '-')} |")
    suspects = [(dtype, x) for dtype, s in result["summary"].items() for x in s["suspects"]]
    if suspects:
        head = (f"Suspects (a gap over {result['settings']['suspect_gap']} logits: a real mismatch, not rounding; "
                "left out of the suggestion and the counts above; check them with the suites):")
        lines += ["", head, ""]
        lines += [f"- {dtype}: {x}" for dtype, x in suspects]
    skipped = [(g["dtype"], g["model"], s["engine"], s["reason"]) for g in result["groups"] for s in g["skipped"]]
    skipped += [(s["dtype"], s["model"], "all", s["reason"]) for s in result["skipped"]]
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {d} {m} {e}: {why}" for d, m, e, why in skipped]
    return "\n".join(lines) + "\n"


def write(result: dict, args, t0: float) -> str:
    result["summary"] = summarize(result["groups"], args.suspect_gap)
    result["wall_s"] = time.perf_counter() - t0
    text = markdown(result)
    write_outputs(result, text, args.json, args.md)
    return text


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--engines", default=None, help="engine NAMEs (built-in, entry point or module:attr), "
                        f"comma-separated (default: the registered ones of {', '.join(DEFAULT_ENGINES)})")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"zoo models, comma-separated, or 'all' (known: {', '.join(zoo.ZOO)})")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per model (default 32)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled engines")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--time-budget", type=float, default=0, help="seconds: dtype x model groups and engines not "
                        "started by then are skipped and listed (0: none)")
    parser.add_argument("--suspect-gap", type=float, default=SUSPECT_GAP, help="an engine with a larger gap is a "
                        f"suspect (a real mismatch), left out of the suggestion (default {SUSPECT_GAP:g} logits)")
    parser.add_argument("--json", type=Path, help="write every number here (nonzero gaps included)")
    parser.add_argument("--md", type=Path, help="write the Markdown tables here")
    args = parser.parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        parser.error(problem)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        parser.error(f"--dtypes: unknown {bad}; choose from {', '.join(DTYPES)}")
    args.models = zoo.RANDOM if args.models == "all" else [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in zoo.ZOO]
    if bad or not args.models:
        parser.error(f"--models: unknown {bad}; choose from {', '.join(zoo.ZOO)} or 'all'")
    if args.engines is None:
        known = registry.available()
        args.engines = [e for e in DEFAULT_ENGINES if e in known]
    else:
        args.engines = [e for e in args.engines.split(",") if e]
    if args.prompts < 1 or args.new_tokens < 1:
        parser.error("--prompts and --new-tokens must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    cache_root = Path(os.environ.get("KVCOMPILE_CACHE_DIR") or Path(tempfile.gettempdir()) / "kvcompile-zoo")
    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    args.deadline = t0 + args.time_budget if args.time_budget else None
    result = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/calibrate_ties.py",
                                                           *(sys.argv[1:] if argv is None else argv)]),
              "date": started.isoformat(timespec="seconds"), "machine": machine(),
              "settings": {k: v if isinstance(v, (int, float, list)) else str(v) for k, v in vars(args).items()},
              "current": {"tie_tolerance": DEFAULT_TIE_TOLERANCE, "max_near_ties": DEFAULT_MAX_NEAR_TIES,
                          "max_near_tie_rate": DEFAULT_MAX_NEAR_TIE_RATE,
                          "oracle_check_tolerance": ORACLE_CHECK_TOLERANCE},
              "groups": [], "skipped": []}
    print(f"{result['date']}: torch {torch.__version__}, transformers {transformers.__version__}, device "
          f"{args.device}, backend {args.backend}, engines {', '.join(args.engines)}", flush=True)
    for dtype in args.dtypes:
        for model in args.models:
            if args.deadline is not None and time.perf_counter() > args.deadline:
                result["skipped"].append({"dtype": dtype, "model": model, "reason": "--time-budget spent"})
                print(f"{dtype} {model}: skipped, --time-budget spent", flush=True)
                continue
            print(f"{dtype} {model} ({time.perf_counter() - t0:.0f} s in)", flush=True)
            try:
                result["groups"].append(measure(model, dtype, args.engines, args, cache_root))
            except zoo.ModelUnavailable as exc:
                result["skipped"].append({"dtype": dtype, "model": model, "reason": str(exc)})
            release(args.device)  # the group's oracle, float64 path and engines
            write(result, args, t0)
    text = write(result, args, t0)
    print(text)
    for dtype, s in result["summary"].items():
        suggested = s["suggested_tie_tolerance"]
        print(f"{dtype}: max gap {s['max_gap']:.4g} over {s['divergences']} divergences in {s['steps']} steps -> "
              f"suggested auto tie tolerance {suggested if suggested is not None else '(no divergence seen: keep)'}"
              f" (current {s['current_tie_tolerance']:g}); most near ties in one sequence {s['max_per_sequence']} "
              f"(current {s['current_max_near_ties']}), max rate {s['max_rate']:.2%} "
              f"(current {s['current_max_near_tie_rate']:.0%}); oracle vs float64 max {s['oracle_max_gap_float64']:.4g}"
              f" (check tolerance {s['oracle_check_tolerance']:g})")
        for x in s["suspects"]:
            print(f"{dtype}: SUSPECT, left out of the suggestion: {x}")
    return result


if __name__ == "__main__":
    main()
