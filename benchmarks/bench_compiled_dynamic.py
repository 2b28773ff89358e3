"""Decode speed of the reference compiled dynamic-cache engine vs eager transformers `generate()`.

Both run side by side in one process on the same checkpoint (default: the zoo's tiny Llama),
same prompts, greedy, exactly --new-tokens tokens. Reports the median wall time of a whole
`generate` call, the decode time per token ((T(new) - T(1)) / (new - 1): prefill cancels out)
and the ratios. Not a test: timings depend on the machine.

    python benchmarks/bench_compiled_dynamic.py                      # inductor, 32 new tokens, 1 thread
    python benchmarks/bench_compiled_dynamic.py --backend aot_eager --batch 4 --prompt-len 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from pytest_kvcompile.contract.engine import ModelSpec  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.recompiles.recorder import CompileRecorder  # noqa: E402
from reference_impls.compiled_dynamic import CompiledDynamicCache  # noqa: E402


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median wall time of each fn; one call of each per round, so machine load hits all alike."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="HF checkpoint dir (default: zoo 'llama')")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch.set_num_threads; 0 keeps torch's default. A tiny model gains nothing from more threads, "
        "and on a shared machine their barriers only add noise",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert args.new_tokens >= 2, "--new-tokens must be >= 2 to time decode steps"

    cache_root = Path(os.environ.get("KVCOMPILE_CACHE_DIR") or Path(tempfile.gettempdir()) / "kvcompile-zoo")
    path = args.checkpoint or zoo.checkpoint("llama", cache_root)
    spec = ModelSpec("bench", path, AutoConfig.from_pretrained(path))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, spec.vocab_size, (args.batch, args.prompt_len), generator=gen)
    n = args.new_tokens

    hf = AutoModelForCausalLM.from_pretrained(path).eval()

    def run_hf(steps: int) -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(
                prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=steps, min_new_tokens=steps,
                do_sample=False, pad_token_id=0,
            )
        return out[:, args.prompt_len :].tolist()

    def run_engine(steps: int) -> list[list[int]]:
        return engine.generate(prompts.tolist(), steps)

    with CompileRecorder() as rec:
        start = time.perf_counter()
        engine = CompiledDynamicCache(spec, compile_backend=args.backend)
        run_engine(2)  # warmup: compiles prefill and decode
        warmup_s = time.perf_counter() - start
        rec.mark_warmup_done()
        same = run_hf(n) == run_engine(n)
        t = interleaved_medians(
            {"hf": lambda: run_hf(n), "hf1": lambda: run_hf(1), "eng": lambda: run_engine(n),
             "eng1": lambda: run_engine(1)},
            args.repeats,
        )
    hf_step, eng_step = (t["hf"] - t["hf1"]) / (n - 1), (t["eng"] - t["eng1"]) / (n - 1)

    print(f"checkpoint {path}")
    print(
        f"batch {args.batch}, prompt {args.prompt_len}, new tokens {n}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, transformers attn_implementation {hf.config._attn_implementation}"
    )
    print(
        f"engine ({args.backend}): warmup {warmup_s:.1f} s, {len(rec.warmup_events)} compiles; "
        f"{len(rec.post_warmup_events)} compiles after warmup; tokens identical to transformers: {same}"
    )
    print(f"{'':22}{'generate (ms)':>14}{'decode/token (ms)':>19}{'decode tok/s':>14}")
    rows = (("transformers eager", t["hf"], hf_step), (f"compiled ({args.backend})", t["eng"], eng_step))
    for name, total, step in rows:
        print(f"{name:22}{total * 1e3:14.2f}{step * 1e3:19.3f}{args.batch / step:14.0f}")
    print(f"speedup vs eager generate(): whole call {t['hf'] / t['eng']:.2f}x, decode {hf_step / eng_step:.2f}x")

if __name__ == "__main__":
    main()
