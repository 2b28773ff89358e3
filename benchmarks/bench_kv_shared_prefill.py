"""Prefill time with and without the shared-KV prefill skip (reference_impls/kv_shared.py).

Builds a Gemma4 text model with --layers layers, the last --shared reusing earlier KV (random
weights, fixed seed, saved to a temporary dir), and times one prefill of --prompt-len tokens both
ways, interleaved in one process. Reports the measured saving next to the theoretical
S/L x (N-1)/N and the FLOP-counted one ((the shared layers' share of layer FLOPs) x (N-1)/N,
tests/test_reference_kv_shared.py). Not a test: timings depend on the machine.

    python benchmarks/bench_kv_shared_prefill.py                       # eager, 8 layers (4 shared), N=1024
    python benchmarks/bench_kv_shared_prefill.py --prompt-len 256 --compile inductor
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from bench_compiled_dynamic import interleaved_medians  # noqa: E402
from pytest_kvcompile.contract.engine import ModelSpec  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.oracles.eviction import kv_sources  # noqa: E402
from reference_impls.compile import compile_fresh, left_pad, mark_dynamic  # noqa: E402
from reference_impls.compiled_dynamic import prefill  # noqa: E402
from reference_impls.loader import load_model  # noqa: E402


def config(layers: int, shared: int, hidden: int):
    return transformers.Gemma4TextConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=8, num_key_value_heads=4,
        head_dim=hidden // 8, global_head_dim=hidden // 8, num_hidden_layers=layers, num_kv_shared_layers=shared,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), sliding_window=512,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, max_position_embeddings=8192,
        tie_word_embeddings=False)


def layer_flops(model, tokens, valid) -> list[int]:
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(tokens, valid)
    counts = counter.get_flop_counts()
    return [sum(counts[f"Gemma4.model.layers.{i}"].values()) for i in range(len(model.model.layers))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shared", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile", default=None, help="a torch.compile backend (default: eager PyTorch)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = config(args.layers, args.shared, args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        zoo._build_model(cfg).save_pretrained(tmp)
        model = load_model(ModelSpec("bench-gemma4", Path(tmp), cfg))
    tokens, valid = left_pad([torch.randint(0, 256, (args.prompt_len,)).tolist()], "cpu")

    flops = {}
    for skip in (False, True):
        model.skip_shared_prefill = skip
        flops[skip] = layer_flops(model, tokens, valid)
    # One model, one compiled function per setting: the flag is a guard, so each variant compiles once.
    runs = {}
    for skip in (False, True):
        fn = compile_fresh(prefill, args.compile) if args.compile else prefill

        def run(skip=skip, fn=fn):
            model.skip_shared_prefill = skip
            if args.compile:
                mark_dynamic(tokens, valid)
            with torch.inference_mode():
                fn(model, tokens, valid)

        run()  # warm-up (and compile)
        runs["skip" if skip else "full"] = run
    times = interleaved_medians(runs, args.repeats)

    n, shared = args.prompt_len, sorted(kv_sources(cfg))
    share = sum(flops[False][i] for i in shared) / sum(flops[False])
    print(f"Gemma4 text, {args.layers} layers ({len(shared)} shared), hidden {args.hidden}, prompt {n}, "
          f"{args.compile or 'eager'}, {torch.get_num_threads()} thread(s), median of {args.repeats}")
    print(f"prefill full {times['full'] * 1e3:.2f} ms, with skip {times['skip'] * 1e3:.2f} ms")
    print(f"saving: measured {1 - times['skip'] / times['full']:.1%} | theoretical S/L x (N-1)/N = "
          f"{len(shared) / args.layers * (n - 1) / n:.1%} | layer FLOPs {1 - sum(flops[True]) / sum(flops[False]):.1%} "
          f"(shared layers' FLOP share {share:.1%} x (N-1)/N)")


if __name__ == "__main__":
    main()
