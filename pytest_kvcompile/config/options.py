"""Command-line options and ini keys, the pytest-benchmark way: one `Option` type, one ``kvcompile`` group,
``--kv-`` prefix. Each feature module exports its list (this module: the core options; `run.fuzz`,
`latency.marker` and `reports` theirs); the plugin adds them all. Every option has an ini equivalent
(``[tool.pytest.ini_options]``); the command line wins. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_kvcompile.config import profiles
from pytest_kvcompile.config.tolerances import (
    DEFAULT_MAX_NEAR_TIE_RATE,
    DEFAULT_MAX_NEAR_TIES,
    DEFAULT_TIE_TOLERANCE,
)
from pytest_kvcompile.errors import UsageError

if TYPE_CHECKING:
    import pytest

ENGINE = "--kv-engine"
LIST_ENGINES = "--kv-list-engines"
MODEL = "--kv-model"
ZOO = "--kv-zoo"
ZOO_HEAD_DIM = "--kv-zoo-head-dim"
DEVICE = "--kv-device"
DTYPE = "--kv-dtype"
MAX_NEW_TOKENS = "--kv-max-new-tokens"
TIE_TOLERANCE = "--kv-tie-tolerance"
COMPILE_BACKEND = "--kv-compile-backend"
CACHE_DIR = "--kv-cache-dir"
KNOWN_FINDING = "--kv-known-finding"
MAX_NEAR_TIES = "--kv-max-near-ties"
MAX_NEAR_TIE_RATE = "--kv-max-near-tie-rate"
FRESH_ENGINE = "--kv-fresh-engine"
ALLOW_GRAPH_BREAKS = "--kv-allow-graph-breaks"
ORACLE_CHECK = "--kv-oracle-check"
CALL_TIMEOUT = "--kv-call-timeout"
ISOLATE = "--kv-isolate"
ORACLE = "--kv-oracle"
PROFILE = "--kv-profile"
ORACLE_DEVICE = "--kv-oracle-device"
REFERENCES = "--kv-references"
RECORD_REFERENCES = "--kv-record-references"

NO_ENGINE = (f"no engine selected: pass {ENGINE}=NAME (or the ini key kv_engines); "
             f"pytest {LIST_ENGINES} lists the engines")
DTYPES = ("float32", "bfloat16", "float16")
CACHE_DIR_ENV = "KVCOMPILE_CACHE_DIR"


@dataclass(frozen=True)
class Option:
    """One option: its command-line flag and its ini key (the command line wins), parsed by `parse` from text.

    `parse` raises ValueError naming the fix; a bad value is a usage error at parse time for the command line
    (argparse) and when the run starts for the ini key. `ini_type`: pytest's ini type, "string", "linelist"
    (repeatable flag, one ini line each; `parse` gets each item) or "bool" (a store_true flag)."""

    flag: str
    ini: str
    default: Any
    help: str
    metavar: str | None = None
    parse: Callable[[str], Any] = str
    ini_type: str = "string"


def add(parser: pytest.Parser, options: list[Option]) -> None:
    """Declare `options` in the ``kvcompile`` group and as ini keys."""
    group = parser.getgroup("kvcompile", "KV-cache + compile engine conformance (pytest-kvcompile)")
    for option in options:
        cli_help = option.help.replace("%", "%%")  # argparse formats help with %
        if option.ini_type == "bool":
            group.addoption(option.flag, action="store_true", default=None, help=cli_help)
        else:
            group.addoption(option.flag, action="append" if option.ini_type == "linelist" else "store", default=None,
                            metavar=option.metavar, type=_argtype(option), help=cli_help)
        parser.addini(option.ini, help=option.help, type=option.ini_type, default=option.default)


def _argtype(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{option.flag}={text!r}: {exc}") from None

    parse.__name__ = option.flag  # argparse names a failed type by it
    return parse


def value(config: pytest.Config, option: Option) -> Any:
    """The parsed value: the command line's, else the ini key's (parsed now; a bad one is a usage error)."""
    cli = config.getoption(option.flag)
    if cli is not None:
        return cli
    raw = config.getini(option.ini)
    if option.ini_type == "bool" or raw == "":  # a flag, or a string option left unset
        return raw
    try:
        return [option.parse(line) for line in raw] if option.ini_type == "linelist" else option.parse(raw)
    except ValueError as exc:
        raise UsageError(f"ini {option.ini} / {option.flag}={raw!r}: {exc}") from None


# --- parsers: text -> value, ValueError naming the fix ----------------------------------------------------------------
def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip() not in allowed:
            raise ValueError(f"choose one of {', '.join(allowed)}")
        return text.strip()

    return parse


def whole(minimum: int = 0, what: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        text = str(text).strip()
        if not text.isdigit() or int(text) < minimum:
            raise ValueError(what or f"give a whole number >= {minimum}")
        return int(text)

    return parse


def auto_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """'auto' (resolved per dtype by read_settings) or `parse`'s value."""
    return lambda text: "auto" if str(text).strip() == "auto" else parse(text)


def number(low: float, high: float = math.inf, what: str = "", low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            found = float(text)
        except ValueError:
            found = math.nan
        if not (low < found if low_open else low <= found) or not found <= high:
            raise ValueError(what)
        return found

    return parse


def _head_dim(text: str) -> int:
    text = str(text).strip()
    if not text.isdigit() or int(text) < 2 or int(text) % 2:
        raise ValueError("give an even whole number >= 2 (RoPE rotates pairs), e.g. 32")
    return int(text)


def _engine(text: str) -> str:
    if not text.strip():
        raise ValueError(f"name an engine, e.g. {ENGINE}=hf-eager (pytest {LIST_ENGINES} lists them)")
    return text.strip()


def _isolate(text: str) -> str | tuple[str, ...]:
    text = str(text).strip()
    if text in ("auto", "declared", "all", "none"):
        return text
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError("give 'auto', 'declared', 'all', 'none' or comma-separated engine names, e.g. "
                         "llama-cpp,onnxruntime")
    return names


def _oracle(text: str) -> tuple[str, str]:
    """'ORACLE' (every engine) or 'ENGINE=ORACLE' (one engine) -> (engine or '', oracle)."""
    engine, _, oracle = str(text).strip().rpartition("=")
    if not oracle.strip() or (_ and not engine.strip()):
        raise ValueError("give 'hf', 'eager', an engine NAME, or 'ENGINE=ORACLE' for one engine, e.g. "
                         "vllm-compile=vllm")
    return engine.strip(), oracle.strip()


@dataclass(frozen=True)
class FindingLine:
    """One ``--kv-known-finding`` line as plain parts (the typed `KnownFinding` is built from them above this layer,
    plugin.py). `kind` empty: the deprecated form, whose `check` is a test-id glob and `expected` a message regex."""

    engine: str
    check: str  # CHECK[MODELS/PROMPTS]; the deprecated form: a test-id glob
    kind: str  # KIND[(NARROWING)]; "" in the deprecated form
    reason: str
    expected: str = ""  # the deprecated form's regex

    @property
    def deprecated(self) -> bool:
        return not self.kind


KNOWN_FINDING_FORM = "ENGINE | CHECK[MODELS/PROMPTS] | KIND[(NARROWING)] | REASON"
_KIND_PART = re.compile(r"[a-z_]+\s*(\(.*\))?", re.S)  # a typed line's third part; the deprecated one's is a reason


def _known_finding(line: str) -> FindingLine:
    """'ENGINE | CHECK[MODELS/PROMPTS] | KIND[(NARROWING)] | REASON'; the deprecated 'ENGINE | TEST-GLOB | REASON |
    EXPECTED' is told apart by its third part, a reason (words), where the typed form has a kind."""
    parts = tuple(p.strip() for p in line.split("|", 3))
    if len(parts) != 4 or not all(parts):
        raise ValueError(f"must be '{KNOWN_FINDING_FORM}'; e.g. 'hf-dynamic-compile | "
                         "test_no_recompiles_after_warmup[llama] | recompile | recompiles on every new length' or "
                         "'hf-prompt-lookup | test_long_generation[gpt2-abspos] | other(raised=IndexError) | drafts "
                         "past max_length'. KIND is a failure kind (mismatch, drift, length, score, inconsistent, "
                         "recompile, memory, latency, crash, speculation, other), narrowed by raised=TYPE, "
                         "max_gap=GAP, prompt_length=N, batched=true|false")
    engine, check, kind, reason = parts
    if _KIND_PART.fullmatch(kind):
        return FindingLine(engine, check, kind, reason)
    try:
        re.compile(reason)
    except re.error as exc:
        raise ValueError(f"'{kind}' is not a KIND, and as the deprecated 'ENGINE | TEST-GLOB | REASON | EXPECTED' "
                         f"EXPECTED {reason!r} is not a regular expression ({exc}); write '{KNOWN_FINDING_FORM}'"
                         ) from None
    return FindingLine(engine, check, "", kind, reason)


OPTIONS = [
    Option(ENGINE, "kv_engines", [],
           "engine to check (repeatable): a built-in name, an entry point of the group 'pytest_kvcompile.engines', "
           "or an import path 'package.module:attr'. Every engine-dependent test runs once per engine.",
           "NAME", _engine, "linelist"),
    Option(MODEL, "kv_models", [], "local Hugging Face checkpoint directory to add to the model zoo (repeatable)",
           "PATH", str, "linelist"),
    Option(ZOO, "kv_zoo", "all",
           "comma-separated built-in tiny models or groups to use ('all': the classic group, dense models of 2023; "
           "'served': the architectures served in 2026, MoE, latent attention, sinks, qk-norm, partial RoPE; "
           "'recurrent': hybrid models whose recurrent layers cache a state per sequence (Gated DeltaNet, Mamba2); "
           "'released': the released-bug rows' models; 'none'; or names such as 'llama,deepseek-v3')", "NAMES"),
    Option(ZOO_HEAD_DIM, "kv_zoo_head_dim", "16",
           "head_dim of every zoo model (default: 16; an even number >= 2). Engines whose kernels need larger heads "
           "(vLLM's CPU attention: 32 and up) run the same zoo with e.g. 32", "N", _head_dim),
    Option(DEVICE, "kv_device", "cpu", "device for engines and oracle (default: cpu)", "DEVICE"),
    Option(ORACLE_DEVICE, "kv_oracle_device", "",
           "device for the oracle and the harness's reference computations when they should not share the engine's "
           "(default: the engine's, --kv-device): e.g. cpu beside an 8B engine filling its GPU, or cuda:1",
           "DEVICE"),
    Option(DTYPE, "kv_dtype", "float32", f"dtype for engines and oracle, one of {', '.join(DTYPES)} (default: float32)",
           "DTYPE", choice(*DTYPES)),
    Option(MAX_NEW_TOKENS, "kv_max_new_tokens", "16", "new tokens generated per prompt (default: 16)", "N", whole(1)),
    Option(TIE_TOLERANCE, "kv_tie_tolerance", "auto",
           "max oracle logit gap between the oracle's token and the engine's token that counts as a near tie "
           "(numerics, not a bug); 'auto' = 1e-3 for float32; in bfloat16 and float16 measured per model from the "
           "noise of equivalent computations (docs/precision.md)", "GAP",
           auto_or(number(0, what="give 'auto' or a logit gap >= 0, e.g. 1e-3"))),
    Option(COMPILE_BACKEND, "kv_compile_backend", "inductor",
           "torch.compile backend for the built-in compiled engines (inductor, aot_eager, eager); recompile checks "
           "are decided by dynamo and hold for any backend", "BACKEND"),
    Option(KNOWN_FINDING, "kv_known_findings", [],
           f"a known finding on an engine, '{KNOWN_FINDING_FORM}' (repeatable), e.g. 'mistralrs | "
           "test_token_identity[mistral-sw/2W+3=19] | mismatch(max_gap=0.01) | close calls flip': the tests of CHECK "
           "(a test function's name, exactly) on that engine, on MODELS and PROMPTS (comma-separated; none or '*': "
           "all), become strict xfails that absorb only a failure of that KIND (mismatch, drift, length, score, "
           "inconsistent, recompile, memory, latency, crash, speculation, other), narrowed by raised=TYPE (an engine "
           "error's exception type), max_gap=GAP (a mismatch's logit gap), prompt_length=N, batched=true|false; any "
           "other failure still fails, a fixed engine shows up as XPASS(strict), and a finding matching no test or "
           "no failure is listed as stale. The deprecated 'ENGINE | TEST-GLOB | REASON | EXPECTED' (a regex over "
           "the message) still works, with a deprecation warning",
           "LINE", _known_finding, "linelist"),
    Option(CACHE_DIR, "kv_cache_dir", "",
           f"where built tiny-model checkpoints and the oracle's references are cached (default: ${CACHE_DIR_ENV} or "
           "~/.cache/pytest-kvcompile)", "DIR"),
    Option(MAX_NEAR_TIES, "kv_max_near_ties", "auto",
           "near ties allowed in one sequence; more is numerics drift, a failure ('auto' = 2 for float32; in "
           "bfloat16 and float16 what a correct engine exceeds with probability < 1e-4 at the model's measured flip "
           "rate)", "N", auto_or(whole(0, "give 'auto' or a whole number >= 0, e.g. 2"))),
    Option(MAX_NEAR_TIE_RATE, "kv_max_near_tie_rate", "auto",
           "near ties allowed per verified token over each engine's whole run; more fails the run ('auto' = 0.01 for "
           "float32; in bfloat16 and float16 a count a correct engine reaches with probability < 1e-4 at each "
           "model's measured flip rate)", "RATE",
           auto_or(number(0, 1, "give 'auto' or a fraction of verified tokens in [0, 1], e.g. 0.02"))),
    Option(FRESH_ENGINE, "kv_fresh_engine", False,
           "build a fresh engine for every test instead of one per engine and model per process (isolates tests "
           "from state an engine keeps across calls; slow for compiled engines)", ini_type="bool"),
    Option(ALLOW_GRAPH_BREAKS, "kv_allow_graph_breaks", False,
           "do not fail the recompile check on graph breaks in an engine's compiled code (they are still reported)",
           ini_type="bool"),
    Option(CALL_TIMEOUT, "kv_call_timeout", "0",
           "seconds one generate() or score() call may take; a call that outlives it fails its test naming the call, "
           "and the engine is built anew for the next test (isolated engines: their process is killed, and building "
           "one may take 10 x this; in-process engines: the call is interrupted by SIGALRM, which cannot stop a hang "
           "inside C code: isolate those). 0 (default): no limit", "SECONDS",
           number(0, what="give a number of seconds >= 0, e.g. 120 (0: no limit)")),
    Option(ISOLATE, "kv_isolate", "auto",
           "which engines run in a process of their own, so that a crash or a hang fails one test and the run goes "
           "on: 'auto' (default: every engine that is not built-in, and built-in ones declaring isolated=True such as "
           "native runtimes; an engine declaring isolated=False runs in process), 'declared' (only those declaring "
           "isolated=True), 'all', 'none', or comma-separated engine names", "WHICH", _isolate),
    Option(ORACLE, "kv_oracle", [],
           "what an engine's tokens are checked against (repeatable): 'hf' (default: transformers eager, the "
           "built-in oracle of the engine's strategy), 'eager' (the engine itself with torch.compile off, or its "
           "declared eager counterpart), an engine NAME, or 'ENGINE=ORACLE' for one engine (e.g. "
           "litgpt-compile=litgpt); a per-engine entry wins over a run-wide one", "ORACLE", _oracle, "linelist"),
    Option(PROFILE, "kv_profile", profiles.DEFAULT,
           "how much of the suites the run spends: " + "; ".join(f"'{p.name}': {p.description}"
                                                                 for p in profiles.PROFILES.values())
           + " (the summary names what a smaller profile left out)", "|".join(profiles.PROFILES),
           choice(*profiles.PROFILES)),
    Option(RECORD_REFERENCES, "kv_record_references", "",
           "record the oracle's references (its tokens, the truth along the engines' tokens, the 16-bit calibration) "
           f"in DIR, with what they were recorded for, for later runs' {REFERENCES}=DIR (a nightly job, a bigger "
           "machine)", "DIR"),
    Option(REFERENCES, "kv_references", "",
           f"judge from the references a run with {RECORD_REFERENCES}=DIR recorded: the oracle runs only where an "
           "engine's tokens leave the recorded ones; a folder recorded for another checkpoint, dtype, device or "
           "version is a usage error naming what differs", "DIR"),
    Option(ORACLE_CHECK, "kv_oracle_check", "on",
           "'on' (default): replay each oracle reference through an independent path (float64) before judging an "
           "engine with it; 'off' skips that check", "on|off", choice("on", "off")),
]
BY_FLAG = {o.flag: o for o in OPTIONS}


def known_findings(config: pytest.Config) -> list[FindingLine]:
    """The run's ``--kv-known-finding`` lines (ini ``kv_known_findings``), as plain parts."""
    return list(value(config, BY_FLAG[KNOWN_FINDING]))


@dataclass(frozen=True)
class FuzzSettings:
    """``--kv-fuzz*`` (their options and the fuzzer: run/fuzz.py)."""

    examples: int
    profile: str = "ci"
    budget_s: float = 240.0
    seed: int | None = None


@dataclass(frozen=True)
class Settings:
    engines: tuple[str, ...]
    models: tuple[Path, ...]
    zoo: tuple[str, ...] | None  # None: all
    zoo_head_dim: int
    device: str
    dtype: str
    max_new_tokens: int
    tie_tolerance: float | None  # None: measured per model (16-bit 'auto', oracles/precision.py)
    compile_backend: str
    cache_dir: Path
    max_near_ties: int | None = 2  # None: measured per model
    max_near_tie_rate: float | None = 0.01  # None: measured per model
    fresh_engine: bool = False
    allow_graph_breaks: bool = False
    oracle_check: bool = True
    fuzz: FuzzSettings | None = None
    call_timeout: float = 0.0  # seconds; 0: no limit
    isolate: str | tuple[str, ...] = "auto"  # 'auto', 'declared', 'all', 'none' or engine names
    oracles: tuple[tuple[str, str], ...] = ()  # (engine or '' for every engine, 'hf' | 'eager' | NAME)
    profile: str = profiles.DEFAULT  # --kv-profile (config/profiles.py)
    oracle_device: str = ""  # --kv-oracle-device; "": the engines' device
    references: Path | None = None  # --kv-references or --kv-record-references: a folder of recorded references
    record_references: bool = False  # True: this run records into `references` (--kv-record-references)

    @property
    def harness_device(self) -> str:
        """Where the oracle and the equivalent computations run: --kv-oracle-device, else the engines' device."""
        return self.oracle_device or self.device

    def oracle(self, engine: str) -> str:
        """The oracle of `engine`: its own --kv-oracle=ENGINE=ORACLE entry, else the run-wide one, else 'hf'
        (the last entry of each kind wins)."""
        found = dict(self.oracles)
        return found.get(engine) or found.get("") or "hf"

    def isolated(self, name: str, declared: bool | None, builtin: bool) -> bool:
        """Whether engine `name` runs in a process of its own (run/isolation.py): `declared` is its
        Declaration.isolated (None: undeclared), `builtin` whether it is a built-in engine."""
        if isinstance(self.isolate, tuple):
            return name in self.isolate
        if self.isolate in ("all", "none"):
            return self.isolate == "all"
        if declared is not None:
            return declared
        return self.isolate == "auto" and not builtin


def read_settings(config: pytest.Config, fuzz: FuzzSettings | None = None) -> Settings:
    """The run's settings: each option parsed (options.value), 'auto' resolved for the dtype. No torch here:
    the device is checked by `check_device` when an engine runs."""
    def get(flag: str) -> Any:
        return value(config, BY_FLAG[flag])

    dtype, tol, ties, rate = get(DTYPE), get(TIE_TOLERANCE), get(MAX_NEAR_TIES), get(MAX_NEAR_TIE_RATE)
    zoo = str(get(ZOO)).strip()
    cache_dir = get(CACHE_DIR) or os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pytest-kvcompile"
    use, record = str(get(REFERENCES) or "").strip(), str(get(RECORD_REFERENCES) or "").strip()
    if use and record:
        raise UsageError(f"{REFERENCES}={use} and {RECORD_REFERENCES}={record}: a run either records references or "
                         "judges from recorded ones; give one of them")
    if use and not Path(use).expanduser().is_dir():
        raise UsageError(f"{REFERENCES}={use}: no such folder; record references into it first with "
                         f"{RECORD_REFERENCES}={use}")
    return Settings(
        engines=tuple(dict.fromkeys(get(ENGINE))),
        models=tuple(Path(p).expanduser() for p in get(MODEL)),
        zoo=None if zoo == "all" else tuple(n.strip() for n in zoo.split(",") if n.strip() and n.strip() != "none"),
        zoo_head_dim=get(ZOO_HEAD_DIM),
        device=get(DEVICE),
        dtype=dtype,
        max_new_tokens=get(MAX_NEW_TOKENS),
        tie_tolerance=DEFAULT_TIE_TOLERANCE.get(dtype) if tol == "auto" else tol,
        compile_backend=get(COMPILE_BACKEND),
        cache_dir=Path(cache_dir),
        max_near_ties=DEFAULT_MAX_NEAR_TIES.get(dtype) if ties == "auto" else ties,
        max_near_tie_rate=DEFAULT_MAX_NEAR_TIE_RATE.get(dtype) if rate == "auto" else rate,
        fresh_engine=bool(get(FRESH_ENGINE)),
        allow_graph_breaks=bool(get(ALLOW_GRAPH_BREAKS)),
        oracle_check=get(ORACLE_CHECK) == "on",
        fuzz=fuzz,
        call_timeout=float(get(CALL_TIMEOUT)),
        isolate=get(ISOLATE),
        oracles=tuple(get(ORACLE)),
        profile=get(PROFILE),
        oracle_device=str(get(ORACLE_DEVICE) or "").strip(),
        references=Path(use or record).expanduser() if use or record else None,
        record_references=bool(record),
    )


def worker_device(device: str, worker: str | None, gpus: int) -> str:
    """The device of this process: under pytest-xdist with ``--kv-device=cuda`` (no index) on a machine with several
    GPUs, worker gwK gets cuda:(K mod GPUs), its engines and its oracle with it, instead of every worker on cuda:0;
    anything else as given (an explicit index is the user's choice)."""
    if device != "cuda" or gpus < 2 or not worker or not worker.startswith("gw") or not worker[2:].isdigit():
        return device
    return f"cuda:{int(worker[2:]) % gpus}"


def check_device(device: str, flag: str = DEVICE) -> None:
    """A usage error at start-up for a device string torch rejects, or a CUDA device this torch cannot use (named by
    the option that gave it, `flag`)."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"{flag}={device!r} is not a torch device; e.g. cpu, cuda, cuda:1") from None
    if parsed.type == "cuda":
        if torch.version.cuda is None:
            raise UsageError(f"{flag}={device}: this torch ({torch.__version__}) is a build without CUDA; "
                             "install a CUDA build of torch (https://pytorch.org/get-started/locally/) or run "
                             f"on {flag}=cpu")
        if not torch.cuda.is_available() or (parsed.index or 0) >= torch.cuda.device_count():
            raise UsageError(f"{flag}={device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                             f"{torch.cuda.device_count()} GPU(s); check the driver and CUDA_VISIBLE_DEVICES, "
                             f"or run on {flag}=cpu")
