"""pytest-kvcompile: check that a KV-cache + compile engine is right and stays fast.

Public API: the engine contract (`ModelSpec`, `Engine`, `Declaration`, `Strategy`) and
the token oracle's assertion (`assert_tokens_match`). Heavy modules load lazily.
"""

from pytest_kvcompile.contract.engine import (
    BATCHING, EXACT, KV_CACHE_BYTES, SCORING, Declaration, Engine, EngineFactory, KVBytesEngine,
    ModelNotSupported, ModelSpec, ScoringEngine, Strategy,
)
from pytest_kvcompile.memory.measure import KVLayout
from pytest_kvcompile.oracles.hf import HFEagerOracle, Reference
from pytest_kvcompile.oracles.token_match import DEFAULT_TIE_TOLERANCE, TokenMismatch, Verdict, assert_tokens_match

__version__ = "0.1.0"

__all__ = [
    "BATCHING", "EXACT", "KV_CACHE_BYTES", "SCORING", "Declaration", "Engine", "EngineFactory", "KVBytesEngine",
    "ModelNotSupported", "ModelSpec", "ScoringEngine", "Strategy", "HFEagerOracle", "KVLayout", "Reference", "DEFAULT_TIE_TOLERANCE",
    "TokenMismatch", "Verdict", "assert_tokens_match",
]
