"""pytest-kvcompile: check that a KV-cache + compile engine is right and stays fast.

Public API: the engine contract (`ModelSpec`, `Engine`, `Declaration`, `Strategy`, `KVLayout`, `Bounds`,
`PrefixCache`, `KnownFinding`; speculative decoders: `Speculative`, `Drafter`), the token
oracle's assertion (`check_tokens`; `assert_tokens_match` is its deprecated spelling), typed verdicts (`Where`,
`Failure`, `Kind`), the compile recorder (`CompileRecorder`, `expect_no_recompiles`), and for adapters that call a
transformers model, its cache keyword in the installed release (`with_cache`, `returned_cache`). Each name loads
its module on first use (PEP 562): importing the package, as pytest does through the entry point, imports neither
torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {  # name -> module that defines it
    **dict.fromkeys(["BATCHING", "EXACT", "KV_CACHE_BYTES", "SCORING", "Bounds", "Declaration", "Engine",
                     "EngineFactory", "KVBytesEngine", "KVLayout", "ModelNotSupported", "ModelSpec", "PrefixCache",
                     "ScoringEngine", "Strategy"],
                    "pytest_kvcompile.contract.engine"),
    **dict.fromkeys(["DRAFTER", "DRAFT_MODEL", "Drafter", "Speculative"], "pytest_kvcompile.contract.speculative"),
    "KnownFinding": "pytest_kvcompile.contract.findings",
    **dict.fromkeys(["cache_tensors", "held_bytes"], "pytest_kvcompile.memory.measure"),
    **dict.fromkeys(["returned_cache", "with_cache"], "pytest_kvcompile.models.checkpoints"),
    "HFEagerOracle": "pytest_kvcompile.oracles.hf",
    "Reference": "pytest_kvcompile.oracles.reference",
    "DEFAULT_TIE_TOLERANCE": "pytest_kvcompile.config.tolerances",
    **dict.fromkeys(["TokenMismatch", "Verdict", "assert_tokens_match", "check_tokens"],
                    "pytest_kvcompile.oracles.token_match"),
    **dict.fromkeys(["Where", "Failure", "Kind"], "pytest_kvcompile.verdicts.failures"),
    **dict.fromkeys(["CompileRecorder", "RecompileError", "expect_no_recompiles"],
                    "pytest_kvcompile.recompiles.recorder"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pytest_kvcompile' has no attribute {name!r}")
    found = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = found
    return found


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
