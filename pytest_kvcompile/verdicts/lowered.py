"""What an engine declares it computes below the run's dtype, in words and as a store key (`Lowered`): typed data the
contract builds (contract/engine.py: `Declaration.lowered`) and the verdicts print, so it sits below both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lowered:
    """What an engine declares it computes below the run's dtype (`Declaration.lowered`): its KV cache's format
    (`kv_cache_dtype`) and its matmuls' input format (`matmul_inputs`); its noise is measured computing exactly that
    (oracles/computations.py: `KVComputation`)."""

    kv: str | None = None
    matmul_inputs: str | None = None

    def __str__(self) -> str:
        """In words: ``K and V stored as float16, matmul inputs as int8``."""
        parts = [f"K and V stored as {self.kv}"] if self.kv else []
        return ", ".join(parts + ([f"matmul inputs as {self.matmul_inputs}"] if self.matmul_inputs else []))

    @property
    def fields(self) -> str:
        """The Declaration fields it comes from: ``Declaration.kv_cache_dtype``, ``Declaration.matmul_inputs``."""
        return "Declaration." + ", ".join(name for name, value in (("kv_cache_dtype", self.kv),
                                                                    ("matmul_inputs", self.matmul_inputs)) if value)

    @property
    def key(self) -> str:
        """Its name in stored calibrations and reports: the KV format alone (``float16``), else with
        ``+matmul-FORMAT``."""
        return (self.kv or "") + (f"+matmul-{self.matmul_inputs}" if self.matmul_inputs else "")
