"""Command-line options and ini keys: one ``kvcompile`` group, ``--kv-`` prefix.

Each option has an ini equivalent (``[tool.pytest.ini_options]``); the command line wins.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_kvcompile.run.fuzz import FuzzSettings

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
FUZZ = "--kv-fuzz"
FUZZ_PROFILE = "--kv-fuzz-profile"
FUZZ_BUDGET = "--kv-fuzz-budget"
FUZZ_SEED = "--kv-fuzz-seed"

NO_ENGINE = (f"no engine selected: pass {ENGINE}=NAME (or the ini key kv_engines); "
             f"pytest {LIST_ENGINES} lists the engines")
DTYPES = ("float32", "bfloat16", "float16")
CACHE_DIR_ENV = "KVCOMPILE_CACHE_DIR"

# (flag, ini key, ini type, default, help)
_OPTIONS = [
    (ENGINE, "kv_engines", "linelist", [],
     "engine to check (repeatable): a built-in name, an entry point of the group 'pytest_kvcompile.engines', "
     "or an import path 'package.module:attr'. Every engine-dependent test runs once per engine."),
    (MODEL, "kv_models", "linelist", [],
     "local Hugging Face checkpoint directory to add to the model zoo (repeatable)"),
    (ZOO, "kv_zoo", "string", "all",
     "comma-separated built-in tiny models to use ('all', 'none', or names such as 'llama,mistral-sw')"),
    (ZOO_HEAD_DIM, "kv_zoo_head_dim", "string", "16",
     "head_dim of every zoo model (default: 16; an even number >= 2). Engines whose kernels need larger heads "
     "(vLLM's CPU attention: 32 and up) run the same zoo with e.g. 32"),
    (DEVICE, "kv_device", "string", "cpu", "device for engines and oracle (default: cpu)"),
    (DTYPE, "kv_dtype", "string", "float32", f"dtype for engines and oracle, one of {', '.join(DTYPES)} (default: float32)"),
    (MAX_NEW_TOKENS, "kv_max_new_tokens", "string", "16", "new tokens generated per prompt (default: 16)"),
    (TIE_TOLERANCE, "kv_tie_tolerance", "string", "auto",
     "max oracle logit gap between the oracle's token and the engine's token that counts as a near tie "
     "(numerics, not a bug); 'auto' = 1e-3 for float32, 3e-2 for float16, 0.75 for bfloat16 (measured: docs/gpu-results.md)"),
    (COMPILE_BACKEND, "kv_compile_backend", "string", "inductor",
     "torch.compile backend for the built-in compiled engines (inductor, aot_eager, eager); "
     "recompile checks are decided by dynamo and hold for any backend"),
    (KNOWN_FINDING, "kv_known_findings", "linelist", [],
     "a known finding on an engine, 'ENGINE | TEST-GLOB | REASON | EXPECTED' (repeatable): matching tests of that "
     "engine become strict xfails that expect a failure whose '<exception type>: <message>' matches the regex "
     "EXPECTED (any other failure still fails; a fixed engine shows up as XPASS(strict))"),
    (CACHE_DIR, "kv_cache_dir", "string", "",
     f"where built tiny-model checkpoints and the oracle's references are cached "
     f"(default: ${CACHE_DIR_ENV} or ~/.cache/pytest-kvcompile)"),
    (MAX_NEAR_TIES, "kv_max_near_ties", "string", "auto",
     "near ties allowed in one sequence; more is numerics drift, a failure ('auto' = 2 for float32, 3 for "
     "float16 and bfloat16)"),
    (MAX_NEAR_TIE_RATE, "kv_max_near_tie_rate", "string", "auto",
     "near ties allowed per verified token over each engine's whole run; more fails the run ('auto' = 0.01 for "
     "float32, 0.05 for float16 and bfloat16)"),
    (FRESH_ENGINE, "kv_fresh_engine", "bool", False,
     "build a fresh engine for every test instead of one per engine and model per process (isolates tests from "
     "state an engine keeps across calls; slow for compiled engines)"),
    (ALLOW_GRAPH_BREAKS, "kv_allow_graph_breaks", "bool", False,
     "do not fail the recompile check on graph breaks in an engine's compiled code (they are still reported)"),
    (ORACLE_CHECK, "kv_oracle_check", "string", "on",
     "'on' (default): replay each oracle reference through an independent path (float64) before judging an "
     "engine with it; 'off' skips that check"),
    (FUZZ, "kv_fuzz", "string", "0",
     "fuzz each engine x model with N hypothesis examples of drawn call sequences (suites/test_fuzz.py); "
     "0 (default): off"),
    (FUZZ_PROFILE, "kv_fuzz_profile", "string", "ci",
     "'ci' (default): derandomized, the same examples every run, 8 steps each; 'dev': new examples each run, "
     "24 steps, failures kept in hypothesis' database under the cache dir and replayed first"),
    (FUZZ_BUDGET, "kv_fuzz_budget", "string", "120",
     "seconds per engine x model after which fuzzing draws no new examples (default: 120)"),
    (FUZZ_SEED, "kv_fuzz_seed", "string", "",
     "a seed for the fuzzer (random examples, reproducible): measures time-to-find over seeds"),
]


_METAVARS = {ENGINE: "NAME", MODEL: "PATH", ZOO: "NAMES", ZOO_HEAD_DIM: "N", DEVICE: "DEVICE", DTYPE: "DTYPE", MAX_NEW_TOKENS: "N",
             TIE_TOLERANCE: "GAP", COMPILE_BACKEND: "BACKEND", CACHE_DIR: "DIR", KNOWN_FINDING: "LINE",
             MAX_NEAR_TIES: "N", MAX_NEAR_TIE_RATE: "RATE", ORACLE_CHECK: "on|off", FUZZ: "N",
             FUZZ_PROFILE: "ci|dev", FUZZ_BUDGET: "SECONDS", FUZZ_SEED: "N"}


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcompile", "KV-cache + compile engine conformance (pytest-kvcompile)")
    for flag, ini, kind, default, help_text in _OPTIONS:
        if kind == "linelist":
            group.addoption(flag, action="append", default=None, metavar=_METAVARS[flag], help=help_text)
        elif kind == "bool":
            group.addoption(flag, action="store_true", default=None, help=help_text)
        else:
            group.addoption(flag, action="store", default=None, metavar=_METAVARS[flag], help=help_text)
        parser.addini(ini, help=help_text, type=kind, default=default)
    group.addoption(LIST_ENGINES, action="store_true", default=False,
                    help="list every resolvable engine with its strategy and capabilities, then exit")


def _value(config: pytest.Config, flag: str):
    ini = next(o[1] for o in _OPTIONS if o[0] == flag)
    cli = config.getoption(flag)
    return cli if cli is not None else config.getini(ini)


def known_findings(config: pytest.Config) -> list[tuple[str, str, str, str]]:
    """(engine, test glob, reason, expected failure regex) per known finding; a malformed line is a usage error."""
    found = []
    for line in _value(config, KNOWN_FINDING):
        parts = [p.strip() for p in line.split("|", 3)]
        problem = None if len(parts) == 4 and all(parts) else "must be 'ENGINE | TEST-GLOB | REASON | EXPECTED'"
        if problem is None:
            try:
                re.compile(parts[3])
            except re.error as exc:
                problem = f"EXPECTED {parts[3]!r} is not a regular expression ({exc})"
        if problem:
            raise pytest.UsageError(
                f"{KNOWN_FINDING} / kv_known_findings: {line!r} {problem}; e.g. 'hf-dynamic-compile | "
                "test_no_recompiles_after_warmup* | recompiles on every new length | recompiled after warmup'. "
                "EXPECTED is a regex searched in '<exception type>: <message>' of the failure"
            )
        found.append(tuple(parts))
    return found


@dataclass(frozen=True)
class Settings:
    engines: tuple[str, ...]
    models: tuple[Path, ...]
    zoo: tuple[str, ...] | None  # None: all
    zoo_head_dim: int
    device: str
    dtype: str
    max_new_tokens: int
    tie_tolerance: float
    compile_backend: str
    cache_dir: Path
    max_near_ties: int = 2
    max_near_tie_rate: float = 0.01
    fresh_engine: bool = False
    allow_graph_breaks: bool = False
    oracle_check: bool = True
    fuzz: FuzzSettings | None = None


def read_settings(config: pytest.Config) -> Settings:
    """Validated settings; a bad value is a usage error naming the fix."""
    from pytest_kvcompile.oracles.token_match import DEFAULT_TIE_TOLERANCE

    dtype = _value(config, DTYPE)
    if dtype not in DTYPES:
        raise pytest.UsageError(f"{DTYPE}={dtype!r}: choose one of {', '.join(DTYPES)}")
    raw_n = _value(config, MAX_NEW_TOKENS)
    if not str(raw_n).isdigit() or int(raw_n) < 1:
        raise pytest.UsageError(f"{MAX_NEW_TOKENS}={raw_n!r}: give a whole number >= 1")
    raw_tol = str(_value(config, TIE_TOLERANCE))
    try:
        tol = DEFAULT_TIE_TOLERANCE[dtype] if raw_tol == "auto" else float(raw_tol)
    except ValueError:
        tol = -1.0
    if not tol >= 0:
        raise pytest.UsageError(f"{TIE_TOLERANCE}={raw_tol!r}: give 'auto' or a logit gap >= 0, e.g. 1e-3")
    device = _value(config, DEVICE)
    _check_device(device)
    zoo = str(_value(config, ZOO)).strip()
    raw_hd = str(_value(config, ZOO_HEAD_DIM))
    if not raw_hd.isdigit() or int(raw_hd) < 2 or int(raw_hd) % 2:
        raise pytest.UsageError(f"{ZOO_HEAD_DIM}={raw_hd!r}: give an even whole number >= 2 (RoPE rotates pairs), e.g. 32")
    cache_dir = _value(config, CACHE_DIR) or os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pytest-kvcompile"
    given = _value(config, ENGINE)
    engines = tuple(dict.fromkeys(n.strip() for n in given if n.strip()))
    if given and not engines:
        raise pytest.UsageError(f"{ENGINE}= is empty: name an engine, e.g. {ENGINE}=hf-eager "
                                f"(pytest {LIST_ENGINES} lists them)")
    from pytest_kvcompile.oracles.token_match import DEFAULT_MAX_NEAR_TIE_RATE, DEFAULT_MAX_NEAR_TIES

    raw_ties = str(_value(config, MAX_NEAR_TIES))
    if raw_ties != "auto" and not raw_ties.isdigit():
        raise pytest.UsageError(f"{MAX_NEAR_TIES}={raw_ties!r}: give 'auto' or a whole number >= 0, e.g. 2")
    raw_rate = str(_value(config, MAX_NEAR_TIE_RATE))
    try:
        rate = DEFAULT_MAX_NEAR_TIE_RATE[dtype] if raw_rate == "auto" else float(raw_rate)
    except ValueError:
        rate = -1.0
    if not 0 <= rate <= 1:
        raise pytest.UsageError(f"{MAX_NEAR_TIE_RATE}={raw_rate!r}: give 'auto' or a fraction of verified tokens in "
                                "[0, 1], e.g. 0.02")
    check = str(_value(config, ORACLE_CHECK)).strip().lower()
    if check not in ("on", "off"):
        raise pytest.UsageError(f"{ORACLE_CHECK}={check!r}: give 'on' or 'off'")
    fuzz = _fuzz_settings(config)
    return Settings(
        engines=engines,
        models=tuple(Path(p).expanduser() for p in _value(config, MODEL)),
        zoo=None if zoo == "all" else tuple(n.strip() for n in zoo.split(",") if n.strip() and n.strip() != "none"),
        zoo_head_dim=int(raw_hd),
        device=device,
        dtype=dtype,
        max_new_tokens=int(raw_n),
        tie_tolerance=tol,
        compile_backend=_value(config, COMPILE_BACKEND),
        cache_dir=Path(cache_dir),
        max_near_ties=DEFAULT_MAX_NEAR_TIES[dtype] if raw_ties == "auto" else int(raw_ties),
        max_near_tie_rate=rate,
        fresh_engine=bool(_value(config, FRESH_ENGINE)),
        allow_graph_breaks=bool(_value(config, ALLOW_GRAPH_BREAKS)),
        oracle_check=check == "on",
        fuzz=fuzz,
    )


def _fuzz_settings(config: pytest.Config):
    """The --kv-fuzz* options (None: fuzzing off); a bad value is a usage error."""
    from pytest_kvcompile.run.fuzz import PROFILES, FuzzSettings

    raw = str(_value(config, FUZZ)).strip()
    if not raw.isdigit():
        raise pytest.UsageError(f"{FUZZ}={raw!r}: give a number of examples >= 0 (0: off), e.g. {FUZZ}=20")
    profile = str(_value(config, FUZZ_PROFILE)).strip()
    if profile not in PROFILES:
        raise pytest.UsageError(f"{FUZZ_PROFILE}={profile!r}: choose one of {', '.join(PROFILES)}")
    budget = str(_value(config, FUZZ_BUDGET)).strip()
    try:
        seconds = float(budget)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise pytest.UsageError(f"{FUZZ_BUDGET}={budget!r}: give seconds > 0, e.g. 120")
    seed = str(_value(config, FUZZ_SEED)).strip()
    if seed and not seed.isdigit():
        raise pytest.UsageError(f"{FUZZ_SEED}={seed!r}: give a whole number")
    if int(raw) == 0:
        return None
    return FuzzSettings(int(raw), profile, seconds, int(seed) if seed else None)


def _check_device(device: str) -> None:
    """A usage error at start-up for a device string torch rejects, or a CUDA device this torch cannot use."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise pytest.UsageError(f"{DEVICE}={device!r} is not a torch device; e.g. cpu, cuda, cuda:1") from None
    if parsed.type == "cuda":
        if torch.version.cuda is None:
            raise pytest.UsageError(f"{DEVICE}={device}: this torch ({torch.__version__}) is a build without CUDA; "
                                    "install a CUDA build of torch (https://pytorch.org/get-started/locally/) or run "
                                    f"on {DEVICE}=cpu")
        if not torch.cuda.is_available() or (parsed.index or 0) >= torch.cuda.device_count():
            raise pytest.UsageError(f"{DEVICE}={device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                                    f"{torch.cuda.device_count()} GPU(s); check the driver and CUDA_VISIBLE_DEVICES, "
                                    f"or run on {DEVICE}=cpu")
