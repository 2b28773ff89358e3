"""Command-line options and ini keys: one ``kvcompile`` group, ``--kv-`` prefix.

Each option has an ini equivalent (``[tool.pytest.ini_options]``); the command line wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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
     "(numerics, not a bug); 'auto' = 1e-3 for float32, 3e-2 for float16, 0.15 for bfloat16"),
    (COMPILE_BACKEND, "kv_compile_backend", "string", "inductor",
     "torch.compile backend for the built-in compiled engines (inductor, aot_eager, eager); "
     "recompile checks are decided by dynamo and hold for any backend"),
    (KNOWN_FINDING, "kv_known_findings", "linelist", [],
     "a known finding on an engine, 'ENGINE | TEST-GLOB | REASON' (repeatable): matching tests of that "
     "engine become strict xfails, so a fixed engine shows up as XPASS(strict)"),
    (CACHE_DIR, "kv_cache_dir", "string", "",
     f"where built tiny-model checkpoints are cached (default: ${CACHE_DIR_ENV} or ~/.cache/pytest-kvcompile)"),
]


_METAVARS = {ENGINE: "NAME", MODEL: "PATH", ZOO: "NAMES", ZOO_HEAD_DIM: "N", DEVICE: "DEVICE", DTYPE: "DTYPE", MAX_NEW_TOKENS: "N",
             TIE_TOLERANCE: "GAP", COMPILE_BACKEND: "BACKEND", CACHE_DIR: "DIR", KNOWN_FINDING: "LINE"}


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcompile", "KV-cache + compile engine conformance (pytest-kvcompile)")
    for flag, ini, kind, default, help_text in _OPTIONS:
        if kind == "linelist":
            group.addoption(flag, action="append", default=None, metavar=_METAVARS[flag], help=help_text)
        else:
            group.addoption(flag, action="store", default=None, metavar=_METAVARS[flag], help=help_text)
        parser.addini(ini, help=help_text, type=kind, default=default)
    group.addoption(LIST_ENGINES, action="store_true", default=False,
                    help="list every resolvable engine with its strategy and capabilities, then exit")


def _value(config: pytest.Config, flag: str):
    ini = next(o[1] for o in _OPTIONS if o[0] == flag)
    cli = config.getoption(flag)
    return cli if cli is not None else config.getini(ini)


def known_findings(config: pytest.Config) -> list[tuple[str, str, str]]:
    """(engine, test glob, reason) per known finding; a malformed line is a usage error."""
    found = []
    for line in _value(config, KNOWN_FINDING):
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3 or not all(parts):
            raise pytest.UsageError(
                f"{KNOWN_FINDING} / kv_known_findings: {line!r} must be 'ENGINE | TEST-GLOB | REASON', "
                "e.g. 'hf-dynamic-compile | test_no_recompiles_after_warmup* | recompiles on every new length'"
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


def read_settings(config: pytest.Config) -> Settings:
    """Validated settings; a bad value is a usage error naming the fix."""
    from .token_match import DEFAULT_TIE_TOLERANCE

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
    try:
        import torch

        torch.device(device)
    except RuntimeError:
        raise pytest.UsageError(f"{DEVICE}={device!r} is not a torch device; e.g. cpu, cuda, cuda:1") from None
    zoo = str(_value(config, ZOO)).strip()
    raw_hd = str(_value(config, ZOO_HEAD_DIM))
    if not raw_hd.isdigit() or int(raw_hd) < 2 or int(raw_hd) % 2:
        raise pytest.UsageError(f"{ZOO_HEAD_DIM}={raw_hd!r}: give an even whole number >= 2 (RoPE rotates pairs), e.g. 32")
    cache_dir = _value(config, CACHE_DIR) or os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pytest-kvcompile"
    engines = tuple(dict.fromkeys(n.strip() for n in _value(config, ENGINE) if n.strip()))
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
    )
