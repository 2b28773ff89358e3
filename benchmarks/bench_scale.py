"""The suite's cost at the sizes users run (issue 54): random-weight checkpoints of real shapes (the real vocabularies
of 49k-152k tokens), one pytest run of suites/ each, measured side by side on this machine: wall time, the peak memory
of the run's processes together (sampled from /proc every 0.2 s), and the share of the tests' time spent in the
engine's generate() (the run's "time in the engines vs the harness" summary, from its JSON report).

    python benchmarks/bench_scale.py --shapes smollm-135m --dtypes float32,bfloat16          # every suite
    python benchmarks/bench_scale.py --shapes qwen2.5-1.5b --dtypes bfloat16 \\
        -k "test_token_identity and not batched" --md scale.md
    python benchmarks/bench_scale.py --shapes smollm-135m --dtypes float32 --floor -k test_long_generation

Checkpoints are built once under $KVCOMPILE_CACHE_DIR/scale (bfloat16 safetensors: 3 GiB for 1.5B parameters) with
the zoo's seeded weights (models/zoo.py: the same gains, so greedy decoding is not degenerate). One model at a time,
nothing else running: two torch processes on 2 cores run several times slower. docs/performance.md has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: real shapes: (transformers config class, its fields); random weights, the real vocabularies, tied embeddings unless
#: the checkpoint's are not
SHAPES: dict[str, tuple[str, dict]] = {
    "smollm-135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen2.5-3b": ("Qwen2Config", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)),
    # the GPU session's (issue 58): a 1.1B and an 8B Llama shape (TinyLlama-1.1B's, Llama-3-8B's)
    "tinyllama-1.1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                           num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                           max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                                           tie_word_embeddings=False)),
    "llama-3-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                       tie_word_embeddings=False)),
}


@dataclass
class Measured:
    shape: str
    dtype: str
    parameters: int
    exit: int
    wall_s: float
    peak_gib: float  # the run's processes together
    engine_s: float  # in generate(), every engine of the run
    test_s: float  # the tests' own seconds (setup, call, teardown)
    summary: str  # pytest's last line
    memory: str = ""  # the run's own peak-memory line (host, and each CUDA device's peak allocation)
    floor_ms: float | None = None  # `--floor`: transformers' own generate() alone, ms a new token


#: `--floor`: transformers' greedy generate() alone on the checkpoint, outside the suite (one row, a 7-token prompt,
#: FLOOR_TOKENS new tokens after one warmup call), in a process of its own with torch's default threads
FLOOR_TOKENS = 256
_FLOOR = """
import sys, time, torch
from transformers import AutoModelForCausalLM, GenerationConfig
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2])).eval()
ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
def run(n):
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
run(8)
started = time.perf_counter()
run(int(sys.argv[3]))
print(1000 * (time.perf_counter() - started) / int(sys.argv[3]))
"""


def floor_ms(path: Path, dtype: str) -> float:
    """ms a new token of transformers' own generate() on the checkpoint (`_FLOOR`): what a decode step of the engine
    costs without the suite, so the run's engine seconds / this = the decode steps the checks ask for."""
    out = subprocess.run([sys.executable, "-c", _FLOOR, str(path), dtype, str(FLOOR_TOKENS)], capture_output=True,
                         text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def parameters(config) -> int:
    """Parameters of a decoder of `config` (embedding, attention, MLP, norms, an untied head), without building it."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head = h // config.num_attention_heads
    kv = config.num_key_value_heads * head
    attention = h * h * 2 + h * kv * 2 + (h + 2 * kv if "Qwen2" in type(config).__name__ else 0)  # Qwen2: qkv bias
    head_weights = 0 if getattr(config, "tie_word_embeddings", True) else vocab * h
    return vocab * h + layers * (attention + 3 * h * config.intermediate_size + 2 * h) + h + head_weights


def checkpoint(shape: str, cache: Path) -> Path:
    """The shape's random-weight checkpoint (bfloat16), built once (models/zoo.py: built_once, seeded weights)."""
    import torch
    import transformers

    from pytest_kvcompile.models import zoo

    kind, fields = SHAPES[shape]
    config = getattr(transformers, kind)(**{"tie_word_embeddings": True, **fields}, bos_token_id=None,
                                         eos_token_id=None, pad_token_id=None)

    def build(tmp: Path) -> None:
        torch.set_default_dtype(torch.bfloat16)  # one 16-bit copy in memory while it is built (3B: 6 GiB)
        try:
            zoo._build_model(config).save_pretrained(tmp)
        finally:
            torch.set_default_dtype(torch.float32)

    return zoo.built_once(cache / f"{shape}-seed{zoo.SEED}-tf{transformers.__version__}", build)


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process under it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            total += int((Path(f"/proc/{current}/statm")).read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def run(shape: str, dtype: str, path: Path, engine: str, expression: str | None, extra: list[str],
        log: Path | None = None) -> Measured:
    """One pytest run of suites/ on the checkpoint, its peak memory sampled while it runs; its whole output (and JSON
    report) kept beside `log` when given."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as out:
        report = Path(out) / "report.json"
        cmd = [sys.executable, "-m", "pytest", str(ROOT / "suites"), f"--kv-engine={engine}", f"--kv-model={path}",
               "--kv-zoo=none", f"--kv-dtype={dtype}", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
               f"--kv-report-json={report}", "--rootdir", out, *(["-k", expression] if expression else []), *extra]
        started, peak = time.perf_counter(), [0]
        proc = subprocess.Popen(cmd, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                peak[0] = max(peak[0], _tree_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        output = proc.communicate()[0]
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        rows = json.loads(report.read_text())["rows"] if report.exists() else []
        if log is not None:
            log.write_text(output)
            if report.exists():
                log.with_suffix(".json").write_text(report.read_text())
    lines = output.strip().splitlines() or ["(no output)"]
    test_s = next((float(line.split("of the tests' ")[1].split(" s")[0]) for line in lines
                   if line.startswith("engines ") and "of the tests'" in line), 0.0)
    memory = next((line for line in lines if line.startswith("host: ")), "")
    return Measured(shape, dtype, parameters(AutoConfig.from_pretrained(path)), proc.returncode, round(wall, 1),
                    round(peak[0] / 2**30, 2), round(sum(r.get("generate_s", 0.0) for r in rows), 1), test_s,
                    lines[-1], memory)


def markdown(found: list[Measured]) -> str:
    lines = ["| shape | parameters | dtype | wall | peak memory (all processes) | engine's generate() | harness "
             "| transformers alone (ms a token; the engine's seconds in such steps) | result "
             "| the run's peak memory line |", "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for m in found:
        harness = f"{1 - m.engine_s / m.test_s:.0%}" if m.test_s else "-"
        engine = f"{m.engine_s:.0f} s ({m.engine_s / m.test_s:.0%})" if m.test_s else f"{m.engine_s:.0f} s"
        floor = f"{m.floor_ms:g} ms ({1000 * m.engine_s / m.floor_ms:,.0f} steps)" if m.floor_ms else "-"
        lines.append(f"| {m.shape} | {m.parameters / 1e6:,.0f}M | {m.dtype} | {m.wall_s:,.0f} s | {m.peak_gib:.1f} GiB "
                     f"| {engine} | {harness} | {floor} | {m.summary} | {m.memory or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm-135m", help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--engine", default="hf-eager")
    parser.add_argument("-k", dest="expression", help="pytest -k expression (default: every suite)")
    parser.add_argument("--md", type=Path, help="write the table here too")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="keep each run's pytest output (SHAPE.DTYPE.log) and JSON report "
                                                  "(SHAPE.DTYPE.json) in this folder, e.g. with -- --durations=20")
    parser.add_argument("--floor", action="store_true",
                        help=f"also time transformers' own generate() alone on each checkpoint ({FLOOR_TOKENS} new "
                             "tokens, after the run): the engine's seconds in the run / that = its decode steps")
    parser.add_argument("extra", nargs="*", help="more pytest options, after --")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    sys.path.insert(0, str(ROOT))
    cache = Path(os.environ.get("KVCOMPILE_CACHE_DIR", ROOT / ".kvcompile-cache")) / "scale"
    found = []
    for shape in args.shapes.split(","):
        path = checkpoint(shape, cache)
        for dtype in args.dtypes.split(","):
            log = None
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                log = args.logs / f"{shape}.{dtype}.log"
            found.append(run(shape, dtype, path, args.engine, args.expression, args.extra, log))
            if args.floor:
                found[-1].floor_ms = floor_ms(path, dtype)
            print(markdown(found[-1:]).splitlines()[-1], flush=True)
    table = markdown(found)
    print(table)
    if args.md:
        args.md.write_text(table)
    if args.json:
        args.json.write_text(json.dumps([m.__dict__ for m in found], indent=2))
    return 0 if all(m.exit == 0 for m in found) else 1


if __name__ == "__main__":
    raise SystemExit(main())
