"""pytest-kvcompile: check that a KV-cache + compile engine is right and stays fast.

Public API: the engine contract (`ModelSpec`, `Engine`, `Declaration`, `Strategy`) and
the token oracle's assertion (`assert_tokens_match`). Heavy modules load lazily.
"""

from .engine import (
    BATCHING, EXACT, KV_CACHE_BYTES, SCORING, Declaration, Engine, EngineFactory, KVBytesEngine,
    ModelNotSupported, ModelSpec, ScoringEngine, Strategy,
)
from .memory import KVLayout
from .oracle import HFEagerOracle, Reference
from .token_match import DEFAULT_TIE_TOLERANCE, TokenMismatch, Verdict, assert_tokens_match

__version__ = "0.1.0"

__all__ = [
    "BATCHING", "EXACT", "KV_CACHE_BYTES", "SCORING", "Declaration", "Engine", "EngineFactory", "KVBytesEngine",
    "ModelNotSupported", "ModelSpec", "ScoringEngine", "Strategy", "HFEagerOracle", "KVLayout", "Reference", "DEFAULT_TIE_TOLERANCE",
    "TokenMismatch", "Verdict", "assert_tokens_match",
]
