"""Speed of every reference engine vs hf-eager and hf-static-compile, side by side, one run (issue 11).

For each model family an engine supports (Llama: ref-compiled-dynamic, ref-static and the four
eviction engines; Mistral, every layer sliding: ref-sliding-window; Gemma4 text with KV-shared
layers: ref-kv-shared; ref-compiled-dynamic also runs on the last two, as the same model without
the strategy), the family's engines plus hf-eager and hf-static-compile are built on the SAME
checkpoint and timed interleaved, call by call, so machine load hits all alike (the engine order
rotates every repeat). Two sizes per family: the tiny zoo model (`pytest_kvcompile/models/zoo.py`, Python
overhead dominates) and a larger random model built here from a config (`--hidden`, `--layers`,
`--vocab`, `--window`; zoo weights rule, saved with save_pretrained to a temporary dir).

Per engine, model, batch and prompt length (the prompts: random ids, all of the same length):

- prefill ms    = median of time(generate(n=1))
- decode tok/s  = batch x K / median of (time(generate(n=1+K)) - time(generate(n=1))), both calls
                  in the same repeat (pytest_kvcompile/latency/marker.py's rule), K = --new-tokens
- compile s     = time of the first generate() (batch 1, prompt 64, 8 new tokens) minus a steady
                  one, in a fresh process with TORCHINDUCTOR_CACHE_DIR an empty temporary dir (cold),
                  then again with the same dir (warm), large models only (`--compile-sizes`); weights
                  loading is reported apart (build s). That dir is then copied into this process's
                  inductor cache, so the speed run's own compiles of the same graphs are warm
- a "floor: weight matmuls only" row (`WeightFloor`, not an engine): per token, one matmul by every
                  weight except the embeddings; its decode tok/s is what a step bound by reading
                  the weights could reach here (`--no-floor` leaves it out)

and the issue's targets: every compiled reference engine >= 2x hf-eager decode; the sliding-window
ring buffer's KV bytes flat past the window W (kv_cache_bytes() and the bytes the engine object
holds besides its weights, prompts below and well above W); the shared-KV prefill skip within 10%
of its theoretical saving (benchmarks/bench_kv_shared_prefill.py, eager and compiled).

Engines with a static cache (ref-static, hf-static-compile) get max_cache_len = longest prompt +
1 + K when their default is shorter. Exact-attention engines' greedy tokens are compared with
hf-eager's (a row note when they differ). Not a test: timings depend on the machine; compare ratios.

    python benchmarks/bench_strategies.py --json perf.json --md perf.md   # full run (~25 min, 2 CPUs)
    python benchmarks/bench_strategies.py --quick --backend aot_eager --engines ref-sliding-window
    python benchmarks/bench_strategies.py --from-json perf.json           # the tables again, no measuring

Devices and dtypes: `--device cuda` / `--dtype bfloat16` build every model and engine there (ModelSpec.device
and .dtype); an engine whose declaration excludes the device or dtype (`Declaration.devices`, `.dtypes`) is
skipped with the reason. On CUDA, ref-static-cudagraph (the static cache with its decode step replayed from
one CUDA graph, seed 001) runs wherever ref-static runs, and every timed call is bracketed by
torch.cuda.synchronize(). The cold/warm compile section (one subprocess per engine) is off by default there.

`--preset tinyllama` / `--preset qwen3-0.6b` give the large models realistic shapes (random weights, built
here on the device, nothing downloaded): TinyLlama-1.1B (hidden 2048, 22 layers, 32/4 heads x 64, MLP 5632,
vocab 32000) or Qwen3-0.6B's sizes as a Llama (hidden 1024, 28 layers, 16/8 heads x 128, MLP 3072, vocab
151936: the reference engines implement llama, mistral, gemma3_text, gemma4_text and gpt2, not qwen3, whose
q/k norms are left out). Mistral takes the same sizes with window 512; Gemma4 takes the widths with 12
layers, the last 4 KV-shared, window 512 (fewer layers to keep its compiles inside a GPU time budget).

Seed anchors (`## Seed anchors` in the Markdown, `anchors` in the JSON), from the speed table of one run:
(a) ref-compiled-dynamic vs hf-eager, decode tokens/s and end-to-end time of generate(n=1+K) (seed 000:
2.4x on Qwen3); (b) the shared-KV prefill skip, ref-kv-shared vs ref-compiled-dynamic generate(n=1) on the
same Gemma4, measured saving vs S/L x (N-1)/N, plus bench_kv_shared_prefill.py (seed 004: 16.6 -> 9.7 ms,
the shared layer group); (c) ref-static-cudagraph vs ref-static vs hf-eager, decode and end-to-end
(seed 001: the CUDA graph cuts end-to-end latency 34% on TinyLlama, float16, 100 new tokens).

One GPU run, all three anchors, about 5 minutes on an H100 (inductor compiles of the 22-layer model take most
of it). Engines, shapes, model groups and sections not started within `--time-budget` seconds are skipped
and listed (so it overruns by at most one compile and the timing of what was warmed up), and the
JSON/Markdown are rewritten after every group, so a run cut short keeps what it measured:

    python benchmarks/bench_strategies.py --device cuda --dtype bfloat16 --preset tinyllama --sizes large \\
        --families llama,gemma4 --engines ref-compiled-dynamic,ref-static,ref-kv-shared --baselines hf-eager \\
        --batches 1 --prompt-lens 128,1024 --new-tokens 64 --repeats 3 --sections speed,kvshared \\
        --time-budget 230 --json bench-gpu.json --md bench-gpu.md

bench_kv_shared_prefill.py (in `kvshared`) has no device option: it runs on the CPU, eager only on a CUDA run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch
import transformers
from transformers import AutoConfig

from pytest_kvcompile.contract import registry
from pytest_kvcompile.contract.engine import (
    ModelNotSupported,
    ModelSpec,
    declaration_of,
    missing_capability,
)
from pytest_kvcompile.memory.measure import held_by
from pytest_kvcompile.models import zoo
from pytest_kvcompile.recompiles import recorder as recompiles
from pytest_kvcompile.recompiles.recorder import CompileRecorder

BASELINES = ("hf-eager", "hf-static-compile")
EAGER = "hf-eager"
#: reference engine -> the model families it is measured on (the first is its own; the others compare)
REFERENCE = {
    "ref-compiled-dynamic": ("llama", "mistral", "gemma4"),
    "ref-static": ("llama",),
    "ref-static-cudagraph": ("llama",),  # CUDA only: added on --device cuda wherever ref-static runs
    "ref-sliding-window": ("mistral",),
    "ref-kv-shared": ("gemma4",),
    "ref-last-recent": ("llama",),
    "ref-streaming-llm": ("llama",),
    "ref-h2o": ("llama",),
    "ref-tova": ("llama",),
}
CUDA_GRAPH = {"ref-static": "ref-static-cudagraph"}  # engine -> its CUDA-graph twin, run beside it on CUDA
DEFAULT_ENGINES = [e for e in REFERENCE if e not in CUDA_GRAPH.values()]
FAMILIES = {  # family -> (tiny zoo model, what it is)
    "llama": ("llama", "Llama, full attention"),
    "mistral": ("mistral-sw", "Mistral, every layer sliding"),
    "gemma4": ("gemma4-kvshared", "Gemma4 text, sliding/full layers, last layers reuse earlier KV"),
}
DECODE_TARGET = 2.0  # x hf-eager decode tokens/s, every compiled reference engine
SHARED_TOLERANCE = 0.10  # |measured - theoretical| / theoretical prefill saving
DTYPES = ("float32", "bfloat16", "float16")

#: --preset NAME -> large-model sizes (flags of the same names), with per-family overrides under the family's key.
PRESETS = {
    "tinyllama": {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "head_dim": 64, "intermediate": 5632,
                  "vocab": 32000, "window": 512, "about": "TinyLlama-1.1B shape",
                  "gemma4": {"layers": 12, "shared": 4}},
    "qwen3-0.6b": {"hidden": 1024, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 3072,
                   "vocab": 151936, "window": 512, "about": "Qwen3-0.6B sizes as a Llama (no q/k norms)",
                   "gemma4": {"layers": 12, "shared": 4}},
}
SIZE_FLAGS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "window", "shared")


# --------------------------------------------------------------------------- models


@dataclass
class Model:
    key: str  # "llama-tiny", "mistral-large", ...
    family: str
    size: str  # "tiny" | "large"
    spec: ModelSpec
    about: str = ""

    @property
    def window(self) -> int | None:
        return zoo.attention_window(self.spec.config)


def sizes_for(family: str, args) -> argparse.Namespace:
    """The large model's sizes for `family`: the flags, with --preset's values (and its per-family overrides)."""
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    values = {k: getattr(args, k, None) for k in SIZE_FLAGS}
    values.update({k: v for k, v in preset.items() if k in SIZE_FLAGS})
    values.update(preset.get(family, {}))
    return argparse.Namespace(**values)


def large_config(family: str, args) -> transformers.PretrainedConfig:
    """A random model big enough that the layers, not Python, take most of a step (sizes from the flags or the
    preset; heads default to hidden / head dim, KV heads to half of them, the MLP to 3 x hidden)."""
    z = sizes_for(family, args)
    heads = z.heads or z.hidden // z.head_dim
    common = {"vocab_size": z.vocab, "hidden_size": z.hidden, "intermediate_size": z.intermediate or 3 * z.hidden,
              "num_hidden_layers": z.layers, "num_attention_heads": heads,
              "num_key_value_heads": z.kv_heads or heads // 2, "head_dim": z.head_dim, "max_position_embeddings": 4096,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=z.window)
    if family == "gemma4":
        if getattr(transformers, "Gemma4TextConfig", None) is None:
            raise zoo.ModelUnavailable(f"transformers {transformers.__version__} has no Gemma4")
        layers = z.layers - z.layers % 2
        return transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": layers}, global_head_dim=z.head_dim,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2), sliding_window=z.window,
            num_kv_shared_layers=z.shared, hidden_size_per_layer_input=16, vocab_size_per_layer_input=z.vocab)
    raise KeyError(family)


def build_random(config, path: Path, device: str, dtype: torch.dtype) -> None:
    """`zoo._build_model`'s weights (same draws, same order, same gains), drawn on `device` by a generator there
    (on CPU: the very same numbers; a 1B model takes seconds on a GPU, not a minute on one CPU thread), saved
    in `dtype` to `path`."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(device)  # in case from_config ignored the default device
    modules = dict(model.named_modules())
    gen = torch.Generator(device).manual_seed(zoo.SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            module = modules[name.rpartition(".")[0]]
            if "norm" not in name and not isinstance(module, torch.nn.LayerNorm):
                gain = zoo.HEAD_GAIN if name.startswith("lm_head.") else zoo.WEIGHT_GAIN
                scale = gain / zoo._fan_in(module, param) ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen, device=param.device) * scale)
    model.eval().to(dtype).save_pretrained(path)
    del model
    release(device)


def release(device: str) -> None:
    """Free what the last group held (engines, compiled graphs' buffers) before the next one."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def describe(config) -> str:
    parts = [f"{config.num_hidden_layers} layers", f"hidden {config.hidden_size}",
             f"{config.num_attention_heads}/{config.num_key_value_heads} heads x {config.head_dim}",
             f"vocab {config.vocab_size}"]
    if zoo.attention_window(config):
        parts.append(f"window {config.sliding_window} ({len(zoo.sliding_layers(config))} sliding layers)")
    if zoo.shared_kv_layers(config):
        parts.append(f"{len(zoo.shared_kv_layers(config))} KV-shared layers")
    return ", ".join(parts)


def build_models(families: list[str], sizes: list[str], args, workdir: Path) -> list[Model]:
    cache_root = Path(os.environ.get("KVCOMPILE_CACHE_DIR") or Path(tempfile.gettempdir()) / "kvcompile-zoo")
    models = []
    for size in sizes:
        for family in families:
            key = f"{family}-{size}"
            try:
                if size == "tiny":
                    path = zoo.checkpoint(FAMILIES[family][0], cache_root)
                else:
                    path = workdir / key
                    start = time.perf_counter()
                    build_random(large_config(family, args), path, args.device, getattr(torch, args.dtype))
                    print(f"built {key} in {time.perf_counter() - start:.1f} s", flush=True)
            except zoo.ModelUnavailable as exc:
                print(f"skip {key}: {exc}", flush=True)
                continue
            config = AutoConfig.from_pretrained(path)
            params = _safetensors_params(path)
            preset = PRESETS[args.preset]["about"] + ", " if size == "large" and args.preset else ""
            about = f"{FAMILIES[family][1]}: {preset}{describe(config)}, {params / 1e6:.1f} M parameters"
            spec = ModelSpec(key, path, config, args.device, getattr(torch, args.dtype))
            models.append(Model(key, family, size, spec, about))
    return models


def _safetensors_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names = f.keys()  # safe_open has no __iter__
            total += sum(torch.Size(f.get_slice(name).get_shape()).numel() for name in names)
    return total


# --------------------------------------------------------------------------- engines


def unsupported(name: str, device: str, dtype: str) -> str | None:
    """Why engine NAME's declaration rules out this device or dtype (`Declaration.devices`, `.dtypes`), or None."""
    probe = ModelSpec("probe", Path("."), None, device, getattr(torch, dtype))
    return missing_capability(registry.resolve(name).declaration, probe)


def build_engine(name: str, spec: ModelSpec, backend: str, max_len: int, max_batch: int | None = None):
    """The registry's factory for NAME on spec; a static cache shorter than max_len is built max_len long, and one
    padded to more rows than the largest batch timed (max_batch) is built max_batch rows."""
    factory = registry.resolve(name).factory
    params = inspect.signature(factory).parameters
    kwargs, notes = {}, []
    if "compile_backend" in params:
        kwargs["compile_backend"] = backend
    cache_len = params.get("max_cache_len")
    if cache_len is not None and isinstance(cache_len.default, int) and cache_len.default < max_len:
        kwargs["max_cache_len"] = max_len
        notes.append(f"max_cache_len={max_len} (default {cache_len.default})")
    rows = params.get("max_batch_size")
    if max_batch and rows is not None and isinstance(rows.default, int) and rows.default > max_batch:
        kwargs["max_batch_size"] = max_batch
        notes.append(f"max_batch_size={max_batch} (default {rows.default})")
    return factory(spec, **kwargs), notes


FLOOR = "floor: weight matmuls only"


class WeightFloor:
    """Not an engine: per generated token, one F.linear of a [batch, in] input by every 2-D weight of the checkpoint
    except the embedding tables (what any decoder must read per step), nothing else. Its decode tokens/s bounds what
    a decode step can reach on this machine and thread count when the step is bound by reading the weights."""

    def __init__(self, spec: ModelSpec):
        from safetensors.torch import load_file

        state = {}
        for file in sorted(Path(spec.path).glob("*.safetensors")):
            state.update(load_file(file, device=str(spec.device)))
        self.weights = [w.to(spec.dtype) for name, w in sorted(state.items()) if w.dim() == 2 and "embed" not in name]
        self.dtype, self.device, self.inputs = spec.dtype, spec.device, {}

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        b = len(prompts)
        for _ in range(max_new_tokens):
            for w in self.weights:
                x = self.inputs.get((b, w.size(1)))
                if x is None:
                    x = self.inputs[(b, w.size(1))] = torch.randn(b, w.size(1), dtype=self.dtype, device=self.device)
                torch.nn.functional.linear(x, w)
        return [[0] * max_new_tokens for _ in prompts]


def exact(name: str) -> bool:
    """Is `name` an engine held to the model's exact attention (its greedy tokens must equal hf-eager's)?"""
    return name != FLOOR and declaration_of(registry.resolve(name).factory).strategy.kind == "exact"


def prompts_for(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 1000 * length + batch)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def synchronize() -> None:
    """Wait for queued CUDA work (no-op without CUDA): a clock started or stopped before it would time launches."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(engine, prompts: list[list[int]], n: int) -> float:
    """Wall seconds of engine.generate(prompts, n), the device synchronized before starting and before stopping
    (engines return Python lists, so their work is done by then; the floor row's is not)."""
    synchronize()
    start = time.perf_counter()
    engine.generate(prompts, n)
    synchronize()
    return time.perf_counter() - start


@dataclass
class SpeedRow:
    model: str
    engine: str
    batch: int
    prompt: int
    new_tokens: int
    prefill_ms: float
    decode_ms: float  # median of T(1+K) - T(1)
    decode_tok_s: float
    repeats: int
    notes: list[str] = field(default_factory=list)
    e2e_ms: float | None = None  # median of T(1+K): the whole generate call (None in JSON from older runs)


def past_deadline(args) -> bool:
    """Has --time-budget run out (work not started by then is skipped, and listed)?"""
    return getattr(args, "deadline", None) is not None and time.perf_counter() > args.deadline


def measure_group(model: Model, engines: list[str], shapes: list[tuple[int, int]], args) -> dict:
    """Build the engines on one model, warm each shape up, then time them interleaved; also the memory probe."""
    spec, k = model.spec, args.new_tokens
    max_len = max((p for _, p in shapes), default=0) + 1 + k  # generate(n=1+K) writes prompt + K positions
    max_batch = max((b for b, _ in shapes), default=None)
    recompiles.reset_dynamo()  # a fresh dynamo: transformers' shared forward wrapper starts at 0 compiles
    built, notes, build_s, failed = {}, {}, {}, {}
    for name in engines:
        if past_deadline(args):
            failed[name] = "not built: --time-budget spent"
            print(f"  {name} on {model.key}: {failed[name]}", flush=True)
            continue
        try:
            start = time.perf_counter()
            built[name], notes[name] = build_engine(name, spec, args.backend, max_len, max_batch)
            build_s[name] = time.perf_counter() - start
            print(f"  built {name} on {model.key} in {build_s[name]:.1f} s", flush=True)
        except ModelNotSupported as exc:
            failed[name] = f"not supported: {exc}"
        except Exception as exc:  # noqa: BLE001 - an engine broken right now is a result, not a crash of the table
            failed[name] = f"{type(exc).__name__}: {exc}"
        if name in failed:
            print(f"  {name} on {model.key}: {failed[name]}", flush=True)
    if args.floor:
        built[FLOOR], notes[FLOOR] = WeightFloor(spec), []
    rows: list[SpeedRow] = []
    recorder = CompileRecorder()
    with recorder:
        warm_s = dict.fromkeys(built, 0.0)  # untimed warmup calls (compiles), per engine
        broken = set()  # (engine, batch, prompt) that raised in warmup: left out of that shape's timing
        tokens = {}  # (engine, batch, prompt) -> the warmup's greedy tokens, compared with hf-eager's
        warmed = []  # shapes warmed up before the time budget ran out
        for batch, length in shapes:
            if past_deadline(args):
                failed[f"batch {batch}, prompt {length}"] = "not measured: --time-budget spent"
                continue
            warmed.append((batch, length))
            prompts = prompts_for(batch, length, spec.vocab_size)
            for name, engine in built.items():
                if past_deadline(args):  # the first warmup compiles: not started once the budget is spent
                    broken.add((name, batch, length))
                    failed[f"{name}, batch {batch}, prompt {length}"] = "not measured: --time-budget spent"
                    continue
                try:
                    start = time.perf_counter()
                    engine.generate(prompts, 1)
                    tokens[(name, batch, length)] = engine.generate(prompts, 1 + k)
                    synchronize()
                    warm_s[name] += time.perf_counter() - start
                except Exception as exc:  # noqa: BLE001 - that shape is left out for that engine, and listed
                    broken.add((name, batch, length))
                    failed[f"{name}, batch {batch}, prompt {length}"] = f"{type(exc).__name__}: {exc}"
                    print(f"  {name} on {model.key}, batch {batch}, prompt {length}: {type(exc).__name__}: {exc}",
                          flush=True)
            print(f"  {model.key} batch {batch} prompt {length}: warmed up (" + ", ".join(
                f"{n} {warm_s[n]:.1f} s" for n in built) + ")", flush=True)
        recorder.mark_warmup_done()
        for batch, length in warmed:
            prompts = prompts_for(batch, length, spec.vocab_size)
            names = [name for name in built if (name, batch, length) not in broken]
            if not names:
                continue
            prefill = {n: [] for n in names}
            decode = {n: [] for n in names}
            whole = {n: [] for n in names}
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:  # rotate: no engine always first
                    one = timed(built[name], prompts, 1)
                    more = timed(built[name], prompts, 1 + k)
                    prefill[name].append(one)
                    decode[name].append(more - one)
                    whole[name].append(more)
            for name in names:
                d = statistics.median(decode[name])
                row_notes = list(notes[name])
                want = tokens.get((EAGER, batch, length))
                if exact(name) and want is not None and tokens[(name, batch, length)] != want:
                    row_notes.append("greedy tokens differ from hf-eager's")
                rows.append(SpeedRow(model.key, name, batch, length, k, statistics.median(prefill[name]) * 1e3,
                                     d * 1e3, batch * k / d if d > 0 else float("nan"), args.repeats, row_notes,
                                     statistics.median(whole[name]) * 1e3))
            print(f"  {model.key} batch {batch} prompt {length}: " + ", ".join(
                f"{r.engine} {r.decode_tok_s:.0f} tok/s {r.prefill_ms:.1f} ms" for r in rows[-len(names):]),
                flush=True)
    after = [e.describe().splitlines()[0] for e in recorder.post_warmup_events]
    memory = measure_memory(model, built, args) if "memory" in args.sections and "ref-sliding-window" in built else []
    return {"rows": rows, "failed": failed, "build_s": build_s, "warmup_s": warm_s, "compiles_after_warmup": after,
            "memory": memory}


def measure_memory(model: Model, built: dict, args) -> list[dict]:
    """KV bytes after generate([prompt], 2) at prompt lengths below and well above the window."""
    w = model.window
    lengths = sorted(n for n in {max(1, w // 2), w, 2 * w, 4 * w, 8 * w, 512} if n <= 1024)
    if args.quick:
        lengths = [max(1, w // 2), w, 4 * w]
    out = []
    for name in ("ref-sliding-window", "ref-compiled-dynamic", EAGER):
        engine = built.get(name)
        if engine is None:
            continue
        for length in lengths:
            engine.generate(prompts_for(1, length, model.spec.vocab_size), 2)
            state = held_by(engine).state if name != EAGER else None  # hf-eager keeps no cache after a call
            out.append({"model": model.key, "engine": name, "window": w, "prompt": length, "positions": length + 1,
                        "kv_cache_bytes": int(engine.kv_cache_bytes()), "held_state_bytes": state})
    return out


# --------------------------------------------------------------------------- compile time (subprocesses)


def compile_child(args) -> None:
    """In a fresh process: build one engine, time its first generate() (compiles) and steady ones; print JSON."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    transformers.logging.set_verbosity_error()
    path = Path(args.child_model)
    spec = ModelSpec(path.name, path, AutoConfig.from_pretrained(path), args.device, getattr(torch, args.dtype))
    prompts = prompts_for(1, args.child_prompt, spec.vocab_size)
    n = args.child_new_tokens
    with CompileRecorder() as recorder:
        start = time.perf_counter()
        engine, _ = build_engine(args.compile_child, spec, args.backend, args.child_prompt + n)
        synchronize()
        build = time.perf_counter() - start
        first = timed(engine, prompts, n)
        steady = statistics.median(timed(engine, prompts, n) for _ in range(3))
    print("RESULT " + json.dumps({"build_s": build, "first_s": first, "steady_s": steady,
                                  "compile_s": first - steady, "frames": len(recorder.events)}))


def measure_compile(engine: str, model: Model, args) -> dict:
    """Cold then warm compile time of `engine` on `model`, each in a fresh process, one inductor cache dir."""
    cache = Path(tempfile.mkdtemp(prefix="bench-inductor-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-child", engine, "--child-model",
           str(model.spec.path), "--backend", args.backend, "--threads", str(args.threads),
           "--device", args.device, "--dtype", args.dtype]
    result = {"engine": engine, "model": model.key}
    try:
        for kind in ("cold", "warm"):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not found:
                result[kind] = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            else:
                result[kind] = json.loads(found[-1][len("RESULT "):])
            print(f"  compile {engine} on {model.key} ({kind}): {result[kind]}", flush=True)
        # Hand the compiled code to this process's own inductor cache: the speed run's compiles of the same
        # graphs are then warm (it times steady-state calls only, so this saves minutes and changes no number).
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        shutil.copytree(cache, cache_dir(), dirs_exist_ok=True, ignore=shutil.ignore_patterns("locks"))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- shared-KV prefill target


def measure_kv_shared(args) -> list[dict]:
    """benchmarks/bench_kv_shared_prefill.py at its defaults, eager and under the chosen backend. That script runs
    on the CPU (it has no device option); with --device cuda only its eager run (the cheap one) is made, and the
    on-device figure is the speed table's ref-kv-shared vs ref-compiled-dynamic prefill (anchor b)."""
    out = []
    modes = (None,) if torch.device(args.device).type == "cuda" else (None, args.backend)
    for compile_backend in modes:
        cmd = [sys.executable, str(HERE / "bench_kv_shared_prefill.py"), "--threads", str(args.threads)]
        if compile_backend:
            cmd += ["--compile", compile_backend]
        if args.quick:
            cmd += ["--prompt-len", "128", "--repeats", "3"]
        row = {"mode": compile_backend or "eager", "command": " ".join(shlex.quote(c) for c in cmd[1:]),
               "device": "cpu"}
        if past_deadline(args):
            row["error"] = "not measured: --time-budget spent"
            out.append(row)
            continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        except subprocess.TimeoutExpired:
            row["error"] = "timed out after 1800 s"
            out.append(row)
            continue
        text = proc.stdout
        m = re.search(r"saving: measured (-?[\d.]+)% \| theoretical .*? = ([\d.]+)% \| layer FLOPs ([\d.]+)%", text)
        times = re.search(r"prefill full ([\d.]+) ms, with skip ([\d.]+) ms", text)
        row["output"] = text.strip()
        if proc.returncode or not m:
            row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        else:
            if times:
                row.update(full_ms=float(times[1]), skip_ms=float(times[2]))
            row.update(measured=float(m[1]) / 100, theoretical=float(m[2]) / 100, flops=float(m[3]) / 100)
        print(f"  kv-shared prefill ({row['mode']}): {row.get('measured', row.get('error'))}", flush=True)
        out.append(row)
    return out


# --------------------------------------------------------------------------- report


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    out = {"nproc": os.cpu_count(), "cpu": cpu, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def verdicts(result: dict) -> list[dict]:
    out = []
    rows = [SpeedRow(**r) if isinstance(r, dict) else r for r in result["speed"]]
    eager = {(r.model, r.batch, r.prompt): r for r in rows if r.engine == EAGER}
    by_engine: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.engine in REFERENCE and (r.model, r.batch, r.prompt) in eager:
            by_engine.setdefault((r.engine, r.model), []).append(r.decode_tok_s / eager[(r.model, r.batch, r.prompt)]
                                                                 .decode_tok_s)
    for (engine, model), ratios in sorted(by_engine.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        worst = min(ratios)
        out.append({"target": f"decode >= {DECODE_TARGET:g}x hf-eager", "engine": engine, "model": model,
                    "met": worst >= DECODE_TARGET,
                    "measured": f"min {worst:.2f}x, max {max(ratios):.2f}x over {len(ratios)} shapes"})
    for model in sorted({m["model"] for m in result["memory"]}):
        ring = [m for m in result["memory"] if m["model"] == model and m["engine"] == "ref-sliding-window"]
        if not ring:
            continue
        w = ring[0]["window"]
        past = [m for m in ring if m["positions"] >= w]
        kv = {m["kv_cache_bytes"] for m in past}
        held = {m["held_state_bytes"] for m in past}
        out.append({"target": "sliding-window KV memory flat past W", "engine": "ref-sliding-window", "model": model,
                    "met": len(kv) == 1 and len(held) == 1,
                    "measured": f"kv_cache_bytes {sorted(kv)}, held {sorted(held)} at prompts "
                                f"{[m['prompt'] for m in past]} (W={w})"})
    for row in result["kv_shared"]:
        if "measured" not in row:
            out.append({"target": "shared-KV prefill saving within 10% of theory", "engine": "ref-kv-shared",
                        "model": f"bench_kv_shared_prefill ({row['mode']})", "met": False,
                        "measured": f"error: {row.get('error')}"})
            continue
        for what, theory in (("S/L x (N-1)/N", row["theoretical"]), ("FLOP-counted", row["flops"])):
            off = abs(row["measured"] - theory) / theory
            out.append({"target": f"shared-KV prefill saving within 10% of theory ({what})", "engine": "ref-kv-shared",
                        "model": f"bench_kv_shared_prefill ({row['mode']})", "met": off <= SHARED_TOLERANCE,
                        "measured": f"saving {row['measured']:.1%} vs {theory:.1%} ({off:.0%} off)"})
    # The same, end to end in the engine: ref-kv-shared vs ref-compiled-dynamic (no skip) prefill, same model.
    by_model = {m["key"]: m for m in result["models"]}
    for r in rows:
        if r.engine != "ref-kv-shared" or r.model not in by_model:
            continue
        base = next((x for x in rows if x.engine == "ref-compiled-dynamic" and (x.model, x.batch, x.prompt)
                     == (r.model, r.batch, r.prompt)), None)
        layers, shared = by_model[r.model]["layers"], by_model[r.model]["shared"]
        if base is None or not shared:
            continue
        saving, theory = 1 - r.prefill_ms / base.prefill_ms, shared / layers * (r.prompt - 1) / r.prompt
        off = abs(saving - theory) / theory
        out.append({"target": "shared-KV prefill saving within 10% of theory (S/L x (N-1)/N)",
                    "engine": "ref-kv-shared", "model": f"{r.model} vs ref-compiled-dynamic, batch {r.batch}, "
                    f"prompt {r.prompt}", "met": off <= SHARED_TOLERANCE,
                    "measured": f"whole generate(n=1): saving {saving:.1%} vs {theory:.1%} ({off:.0%} off)"})
    return out


def anchors(result: dict) -> list[dict]:
    """The seed speed anchors as ratios, from the speed table (and bench_kv_shared_prefill.py): see the docstring."""
    rows = [SpeedRow(**r) if isinstance(r, dict) else r for r in result["speed"]]
    index = {(r.model, r.engine, r.batch, r.prompt): r for r in rows}
    shapes = sorted({(r.model, r.batch, r.prompt) for r in rows})
    out = []

    def e2e(r):
        return r.e2e_ms if r.e2e_ms is not None else r.prefill_ms + r.decode_ms

    for model, b, p in shapes:
        k = next(r.new_tokens for r in rows if (r.model, r.batch, r.prompt) == (model, b, p))
        at = f"batch {b}, prompt {p}, {k} new tokens"
        eager = index.get((model, EAGER, b, p))
        dyn = index.get((model, "ref-compiled-dynamic", b, p))
        if eager and dyn:
            out.append({"anchor": "a", "what": "ref-compiled-dynamic vs hf-eager", "model": model, "shape": at,
                        "decode_x": dyn.decode_tok_s / eager.decode_tok_s, "e2e_x": e2e(eager) / e2e(dyn),
                        "measured": f"decode {ratio(dyn.decode_tok_s, eager.decode_tok_s)}, end-to-end "
                                    f"{ratio(e2e(eager), e2e(dyn))} ({e2e(eager):.1f} -> {e2e(dyn):.1f} ms)",
                        "seed": "000: 2.4x generation latency on Qwen3 (8.88 s -> 3.6 s)"})
        shared = index.get((model, "ref-kv-shared", b, p))
        layers = {m["key"]: (m["layers"], m["shared"]) for m in result["models"]}.get(model, (0, 0))
        if shared and dyn and layers[1]:
            saving, theory = 1 - shared.prefill_ms / dyn.prefill_ms, layers[1] / layers[0] * (p - 1) / p
            out.append({"anchor": "b", "what": "shared-KV prefill skip: ref-kv-shared vs ref-compiled-dynamic, "
                        "generate(n=1)", "model": model, "shape": at, "saving": saving, "theory": theory,
                        "measured": f"{dyn.prefill_ms:.2f} -> {shared.prefill_ms:.2f} ms: saving {saving:.1%} vs "
                                    f"S/L x (N-1)/N = {theory:.1%} ({saving / theory:.0%} of theory)",
                        "seed": "004: shared layer group 16.6 -> 9.7 ms (vLLM, prompt 8192)"})
        static = index.get((model, "ref-static", b, p))
        graph = index.get((model, "ref-static-cudagraph", b, p))
        if graph and (static or eager):
            parts, entry = [], {}
            for base, name in ((static, "ref-static"), (eager, "hf-eager")):
                if base:
                    cut = 1 - e2e(graph) / e2e(base)
                    entry[f"e2e_cut_vs_{name}"] = cut
                    entry[f"decode_x_vs_{name}"] = graph.decode_tok_s / base.decode_tok_s
                    parts.append(f"vs {name}: end-to-end {e2e(base):.1f} -> {e2e(graph):.1f} ms ({cut:.0%} cut), "
                                 f"decode {ratio(graph.decode_tok_s, base.decode_tok_s)}")
            out.append({"anchor": "c", "what": "ref-static-cudagraph (static cache + CUDA graph)", "model": model,
                        "shape": at, **entry, "measured": "; ".join(parts),
                        "seed": "001: 34% end-to-end latency cut on TinyLlama (float16, 100 new tokens)"})
    for row in result.get("kv_shared", []):
        if "measured" in row:
            ms = f"{row['full_ms']:.2f} -> {row['skip_ms']:.2f} ms: " if "full_ms" in row else ""
            what = f"bench_kv_shared_prefill.py ({row['mode']}, {row.get('device', 'cpu')})"
            out.append({"anchor": "b", "what": what,
                        "model": "Gemma4, 8 layers (4 shared), hidden 256", "shape": "batch 1, prompt 1024"
                        if "--prompt-len" not in row["command"] else row["command"],
                        "saving": row["measured"], "theory": row["theoretical"],
                        "measured": f"{ms}saving {row['measured']:.1%} vs S/L x (N-1)/N = {row['theoretical']:.1%} "
                                    f"({row['measured'] / row['theoretical']:.0%} of theory), FLOP-counted "
                                    f"{row['flops']:.1%}",
                        "seed": "004: shared layer group 16.6 -> 9.7 ms (vLLM, prompt 8192)"})
    return out


def markdown(result: dict) -> str:
    rows = [SpeedRow(**r) if isinstance(r, dict) else r for r in result["speed"]]
    lines = []
    found = anchors(result)
    if found:
        lines += ["## Seed anchors", "",
                  ("(a) compiled dynamic cache vs hf-eager, (b) shared-KV prefill skip vs theory, (c) static cache "
                   "+ CUDA graph vs ref-static and hf-eager. End-to-end: median time of generate(n=1+K)."), "",
                  "| anchor | what | model | shape | measured | seed |", "|---|---|---|---|---|---|"]
        order = {m["key"]: i for i, m in enumerate(result["models"])}
        for a in sorted(found, key=lambda a: (a["anchor"], order.get(a["model"], len(order)))):
            lines.append(f"| ({a['anchor']}) | {a['what']} | {a['model']} | {a['shape']} | {a['measured']} | "
                         f"{a['seed']} |")
        lines.append("")
    shapes = sorted({(r.batch, r.prompt) for r in rows})
    index = {(r.model, r.engine, r.batch, r.prompt): r for r in rows}
    for model in result["models"]:
        key = model["key"]
        engines = list(dict.fromkeys(r.engine for r in rows if r.model == key))
        if not engines:
            continue
        lines += [f"#### {key}: {model['about']}", ""]
        for what, unit in (("decode", "tokens/s"), ("prefill", "ms")):
            head = f"| {what} {unit} (x hf-eager, x hf-static-compile) | " + " | ".join(
                f"batch {b}, prompt {p}" for b, p in shapes) + " |"
            lines += [head, "|---|" + "---:|" * len(shapes)]
            for engine in engines:
                if engine == FLOOR and what == "prefill":
                    continue
                cells = []
                for b, p in shapes:
                    r = index.get((key, engine, b, p))
                    if r is None:
                        cells.append("-")
                        continue
                    refs = [index.get((key, base, b, p)) for base in BASELINES]
                    if what == "decode":
                        value = f"{r.decode_tok_s:.0f}"
                        rel = [ratio(r.decode_tok_s, x.decode_tok_s) if x else "n/a" for x in refs]
                    else:
                        value = f"{r.prefill_ms:.1f}"
                        rel = [ratio(x.prefill_ms, r.prefill_ms) if x else "n/a" for x in refs]  # >1: faster
                    cells.append(f"{value} ({', '.join(rel)})" if engine not in BASELINES else value)
                lines.append(f"| {engine} | " + " | ".join(cells) + " |")
            lines.append("")
        group = result["groups"].get(key, {})
        notes = sorted({n for r in rows if r.model == key for n in (f"{r.engine}: {x}" for x in r.notes)})
        for name, why in group.get("failed", {}).items():
            notes.append(f"{name}: {why}")
        if group.get("compiles_after_warmup"):
            notes.append(f"compiles after warmup: {len(group['compiles_after_warmup'])} "
                         f"({'; '.join(group['compiles_after_warmup'][:3])})")
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    if result["compile"]:
        lines += ["| engine | model | build s | cold compile s | warm compile s | frames |",
                  "|---|---|---:|---:|---:|---:|"]
        for c in result["compile"]:
            cold, warm = c.get("cold", {}), c.get("warm", {})

            def cell(x, key):
                return f"{x[key]:.1f}" if key in x else x.get("error", "-")[:60]

            lines.append(f"| {c['engine']} | {c['model']} | {cell(cold, 'build_s')} | {cell(cold, 'compile_s')} | "
                         f"{cell(warm, 'compile_s')} | {cold.get('frames', '-')} |")
        lines.append("")
    if result["memory"]:
        lines += ["| model | engine | prompt | positions | kv_cache_bytes | held besides weights |",
                  "|---|---|---:|---:|---:|---:|"]
        for m in result["memory"]:
            held = "-" if m["held_state_bytes"] is None else f"{m['held_state_bytes']:,}"
            lines.append(f"| {m['model']} (W={m['window']}) | {m['engine']} | {m['prompt']} | {m['positions']} | "
                         f"{m['kv_cache_bytes']:,} | {held} |")
        lines.append("")
    lines += ["| target | engine | model | met | measured |", "|---|---|---|---|---|"]
    for v in result["verdicts"]:
        lines.append(f"| {v['target']} | {v['engine']} | {v['model']} | {'met' if v['met'] else 'NOT met'} | "
                     f"{v['measured']} |")
    if result.get("skipped"):
        lines += ["", "Skipped:", ""] + [f"- {x['what']}: {x['why']}" for x in result["skipped"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                        help=f"reference engines, comma-separated (default: {', '.join(DEFAULT_ENGINES)}; on --device "
                        "cuda ref-static-cudagraph joins ref-static)")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="engines every reference engine is timed "
                        "against on the same model (hf-eager is needed for the ratios)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="model families to run (default: every family of a selected engine)")
    parser.add_argument("--sizes", default="tiny,large", help="tiny (zoo) and/or large (built here)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of every compiled engine")
    parser.add_argument("--device", default="cpu", help="device of every model and engine: cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of every model and engine")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="realistic sizes for the large models (random "
                        "weights, built here): " + "; ".join(f"{k}: {v['about']}" for k, v in PRESETS.items()))
    parser.add_argument("--time-budget", type=float, default=0, help="seconds: model groups, shapes and sections not "
                        "started by then are skipped and listed (0: no budget); results are saved after every group")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt-lens", default="64,512")
    parser.add_argument("--new-tokens", type=int, default=64, help="K: decode time = T(1 + K) - T(1)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats (medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--sections", default=None,
                        help="what to run: speed, compile (cold/warm subprocesses), memory, kvshared (default: all; "
                        "on cuda all but compile)")
    parser.add_argument("--compile-sizes", default="large", help="model sizes whose compile time is measured")
    parser.add_argument("--hidden", type=int, default=512, help="large models: hidden size")
    parser.add_argument("--layers", type=int, default=6, help="large models: layers")
    parser.add_argument("--head-dim", type=int, default=64, help="large models: head dim")
    parser.add_argument("--heads", type=int, default=None, help="large models: query heads (default: hidden / "
                        "head dim)")
    parser.add_argument("--kv-heads", type=int, default=None, help="large models: KV heads (default: heads / 2)")
    parser.add_argument("--intermediate", type=int, default=None, help="large models: MLP size (default: 3 x hidden)")
    parser.add_argument("--vocab", type=int, default=8192, help="large models: vocabulary")
    parser.add_argument("--window", type=int, default=128, help="large Mistral/Gemma4: sliding window")
    parser.add_argument("--shared", type=int, default=2, help="large Gemma4: KV-shared layers")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help=f"leave out the '{FLOOR}' row (decode bound by reading the weights)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny models, batch 1, prompt 16, 4 new tokens, 2 repeats, speed + memory")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--md", type=Path, help="write the Markdown tables here")
    parser.add_argument("--from-json", type=Path, help="measure nothing: print (and --md) the tables of a --json file")
    parser.add_argument("--compile-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-prompt", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--child-new-tokens", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        parser.error(problem)
    cuda = torch.device(args.device).type == "cuda"
    if args.quick:
        args.sizes, args.batches, args.prompt_lens, args.new_tokens, args.repeats = "tiny", "1", "16", 4, 2
        if args.sections is None:
            args.sections = "speed,memory"
    if args.sections is None:
        args.sections = "speed,memory,kvshared" if cuda else "speed,compile,memory,kvshared"
    args.sections = set(filter(None, args.sections.split(",")))
    unknown = args.sections - {"speed", "compile", "memory", "kvshared"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from speed, compile, memory, kvshared")
    return args


def device_problem(device: str) -> str | None:
    """Why this torch cannot run on `device` (a clear message instead of a traceback later), or None."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return f"--device {device!r} is not a torch device; e.g. cpu, cuda, cuda:1"
    if parsed.type == "cuda":
        if torch.version.cuda is None:
            return (f"--device {device}: this torch ({torch.__version__}) is a build without CUDA; install a CUDA "
                    "build of torch or run with --device cpu")
        if not torch.cuda.is_available() or (parsed.index or 0) >= torch.cuda.device_count():
            return (f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                    f"{torch.cuda.device_count()} GPU(s); check the driver and CUDA_VISIBLE_DEVICES")
    elif parsed.type != "cpu":
        return f"--device {device}: only cpu and cuda are supported"
    return None


def select_engines(engines: list[str], baselines: list[str], device: str, dtype: str):
    """(engines, baselines, skipped) for this device and dtype: on CUDA each CUDA-graph twin (`CUDA_GRAPH`) joins
    right after its engine; an engine whose declaration excludes the device or dtype moves to skipped (name ->
    why)."""
    if torch.device(device).type == "cuda":
        engines = list(dict.fromkeys(x for e in engines for x in (e, CUDA_GRAPH.get(e)) if x))
    skipped = {}
    for name in dict.fromkeys(baselines + engines):
        why = unsupported(name, device, dtype)
        if why:
            skipped[name] = f"not declared for {why}"
    return [e for e in engines if e not in skipped], [b for b in baselines if b not in skipped], skipped


def write(result: dict, args, t0: float) -> str:
    """Verdicts, anchors and wall time into `result`; the JSON and Markdown (re)written. Called after every group
    too, so a run cut short (a device time limit) keeps what it measured."""
    result["verdicts"] = verdicts(result)
    result["anchors"] = anchors(result)
    result["wall_s"] = time.perf_counter() - t0
    text = markdown(result)
    write_outputs(result, text, args.json, args.md)
    return text


def write_outputs(result: dict, text: str, json_path: Path | None, md_path: Path | None) -> None:
    """The JSON and Markdown files (those asked for), each replaced atomically: a run killed mid-write keeps the
    previous complete file."""
    for path, content in ((json_path, lambda: json.dumps(result, indent=1, default=str)), (md_path, lambda: text)):
        if path:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(content())
            os.replace(tmp, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile_child:
        return compile_child(args)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        result["verdicts"] = verdicts(result)
        text = markdown(result)
        print(text)
        if args.md:
            args.md.write_text(text)
        return
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in REFERENCE]
    if unknown:
        sys.exit(f"unknown reference engine(s) {unknown}; known: {', '.join(REFERENCE)}")
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if EAGER not in baselines:
        baselines.insert(0, EAGER)
    engines, baselines, skipped = select_engines(engines, baselines, args.device, args.dtype)
    for name, why in skipped.items():
        print(f"skip {name}: {why}", flush=True)
    if EAGER in skipped:
        sys.exit(f"{EAGER} cannot run here ({skipped[EAGER]}): every ratio needs it")
    shapes = [(b, p) for b in map(int, args.batches.split(",")) for p in map(int, args.prompt_lens.split(","))]
    assert args.new_tokens >= 1, "--new-tokens must be >= 1"
    # A family runs when one of its own engines is selected (ref-compiled-dynamic elsewhere only compares).
    families = [f for f in FAMILIES if any(REFERENCE[e][0] == f for e in engines) and f in args.families.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]

    started, t0 = datetime.datetime.now().astimezone(), time.perf_counter()
    args.deadline = t0 + args.time_budget if args.time_budget else None
    result = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_strategies.py",
                                                           *(sys.argv[1:] if argv is None else argv)]),
              "date": started.isoformat(timespec="seconds"), "machine": machine(),
              "load_start": os.getloadavg(), "settings": {k: (sorted(v) if isinstance(v, set) else str(v))
                                                          for k, v in vars(args).items()},
              "models": [], "groups": {}, "speed": [], "compile": [], "memory": [], "kv_shared": [], "loads": [],
              "skipped": [{"what": name, "why": why} for name, why in skipped.items()]}
    print(f"{result['date']}: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} thread(s), backend {args.backend}, device {args.device} "
          f"({result['machine'].get('gpu', result['machine']['cpu'])}), {args.dtype}, load {os.getloadavg()}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        models = build_models(families, sizes, args, Path(tmp))
        result["models"] = [{"key": m.key, "about": m.about, "layers": m.spec.config.num_hidden_layers,
                             "shared": len(zoo.shared_kv_layers(m.spec.config))} for m in models]
        for m in models:
            print(f"model {m.key}: {m.about}", flush=True)
        write(result, args, t0)
        if "compile" in args.sections:
            for m in models:
                if m.size not in args.compile_sizes.split(","):
                    continue
                # hf-static-compile once, on the first family's model
                static = "hf-static-compile" in baselines and not any(
                    c["engine"] == "hf-static-compile" for c in result["compile"])
                for name in [e for e in engines if REFERENCE[e][0] == m.family] + ["hf-static-compile"] * static:
                    if past_deadline(args):
                        result["skipped"].append({"what": f"compile {name} on {m.key}", "why": "--time-budget spent"})
                        continue
                    result["compile"].append(measure_compile(name, m, args))
                    result["loads"].append(os.getloadavg())
            write(result, args, t0)
        if "speed" in args.sections or "memory" in args.sections:
            for m in models:
                group = list(dict.fromkeys(baselines + [e for e in engines if m.family in REFERENCE[e]]))
                if past_deadline(args):
                    result["skipped"].append({"what": f"{m.key}: {', '.join(group)}", "why": "--time-budget spent"})
                    print(f"{m.key}: skipped, --time-budget spent", flush=True)
                    continue
                print(f"{m.key}: {', '.join(group)} (load {os.getloadavg()}, {time.perf_counter() - t0:.0f} s in)",
                      flush=True)
                out = measure_group(m, group, shapes if "speed" in args.sections else [], args)
                release(args.device)
                result["speed"] += [asdict(r) for r in out.pop("rows")]
                result["memory"] += out.pop("memory")
                result["groups"][m.key] = out
                result["loads"].append(os.getloadavg())
                write(result, args, t0)
        if "kvshared" in args.sections and "ref-kv-shared" in engines:
            result["kv_shared"] = measure_kv_shared(args)
            result["loads"].append(os.getloadavg())
    result["load_end"] = os.getloadavg()
    text = write(result, args, t0)
    print(text)
    print(f"wall time {result['wall_s']:.0f} s; load average at start {result['load_start']}, "
          f"end {result['load_end']}, 1-minute during the run {min(load[0] for load in result['loads'] or [(0,)]):.2f}"
          f"-{max(load[0] for load in result['loads'] or [(0,)]):.2f}")


if __name__ == "__main__":
    main()
