"""An engine under test: the resolved engine built for one model, and the checks' entry points."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from . import engine_io
from .engine import ModelSpec
from .oracle import Reference
from .prompts import Prompt
from .registry import EngineRef
from .token_match import TokenMismatch, Verdict, assert_tokens_match

if TYPE_CHECKING:
    from .results import Recorder


NEAR_TIES = "near ties accepted as numerics"


@dataclass
class EngineUnderTest:
    ref: EngineRef
    spec: ModelSpec
    engine: Any
    max_new_tokens: int
    tie_tolerance: float
    window: int | None
    build_compiles: int = 0  # dynamo compiles while the factory ran (compiled engines only)

    def __repr__(self) -> str:
        return f"<engine '{self.name}' on model '{self.spec.name}'>"

    @property
    def name(self) -> str:
        return self.ref.name

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int | None = None) -> list[list[int]]:
        """engine.generate over these prompts (one call), validated."""
        n = max_new_tokens or self.max_new_tokens
        return engine_io.generate(self.ref, self.engine, [p.ids for p in prompts], n, self.spec.vocab_size)

    def check(self, reference: Reference, got: Sequence[int], prompt: Prompt, where: str = "alone",
              record: Recorder | None = None) -> Verdict:
        """assert_tokens_match with this run's tolerance, the engine's scorer and the model's window."""
        __tracebackhide__ = True
        scorer = engine_io.score(self.ref, self.engine, self.spec.vocab_size) if self.ref.declaration.scoring else None
        try:
            verdict = assert_tokens_match(
                reference, got, tie_tolerance=self.tie_tolerance, score=scorer, engine=self.name,
                model=self.spec.name, prompt=f"prompt '{prompt.name}'", where=where, window=self.window,
            )
        except TokenMismatch:
            if record:
                record.metric(tokens={"mismatch": 1})
            raise
        if record:
            at = f"{self.name} / {self.spec.name} / {prompt.name} ({where})"
            lines = [f"{at}: near tie at step {tie.step}, {tie.expected} vs {tie.got}, gap {tie.gap:.3g}"
                     for tie in verdict.near_ties]
            if verdict.unverified_from is not None:
                lines.append(f"{at}: steps {verdict.unverified_from}.. unverified after a near tie "
                             "(engine does not declare scoring)")
            for line in lines:
                record(NEAR_TIES, line, near_ties=[line])
            kind = "unverified" if verdict.unverified_from is not None else "near_tie" if verdict.near_ties else "identical"
            record.metric(tokens={kind: 1})
        return verdict
