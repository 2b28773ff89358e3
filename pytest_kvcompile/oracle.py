"""The token oracle: what an engine's greedy output must equal.

For the ``exact`` strategy the reference is transformers eager greedy decoding with a
full ``DynamicCache`` on the same checkpoint, device and dtype: one forward over the
prompt, then one forward per new token, each token the argmax of the raw logits (no
logits processors: a checkpoint's ``generation_config``, e.g. a repetition penalty,
does not apply; no stop tokens). The per-step logits are kept so a divergence can be
classified as a near tie or a mismatch (see ``token_match``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from .engine import ModelSpec, Strategy


@dataclass(frozen=True)
class Reference:
    """The oracle's continuation of one prompt, with its logits per step ([steps, vocab], fp32, CPU)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logits: torch.Tensor
    source: str

    def __repr__(self) -> str:
        return f"Reference(prompt of length {len(self.prompt)}, tokens={list(self.tokens)})"

    def gap(self, step: int, token: int) -> float:
        """How far `token` is behind the oracle's own choice at `step`, in logits (>= 0)."""
        row = self.logits[step]
        return float(row[self.tokens[step]] - row[token])

    def top(self, step: int, k: int = 3) -> list[tuple[int, float]]:
        values, ids = self.logits[step].topk(k)
        return [(int(i), float(v)) for i, v in zip(ids, values)]


class HFEagerOracle:
    """transformers eager greedy generation with a full DynamicCache (strategy ``exact``)."""

    source = "transformers eager greedy, full DynamicCache"

    def __init__(self, spec: ModelSpec, strategy: Strategy = Strategy()):
        from transformers import AutoModelForCausalLM

        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=spec.dtype).to(spec.device).eval()
        self._memo: dict[tuple[tuple[int, ...], int], Reference] = {}

    def __repr__(self) -> str:
        return f"<oracle: {self.source}, model '{self.spec.name}'>"

    @torch.inference_mode()
    def reference(self, prompt: list[int] | tuple[int, ...], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            self._memo[key] = self._greedy(*key)
        return self._memo[key]

    def _greedy(self, prompt: tuple[int, ...], steps: int) -> Reference:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        inputs = torch.tensor([prompt], device=self.spec.device)
        tokens, rows = [], []
        for _ in range(steps):
            logits = self.model(input_ids=inputs, past_key_values=cache, use_cache=True).logits[0, -1]
            rows.append(logits.float().cpu())
            tokens.append(int(logits.argmax()))
            inputs = torch.tensor([[tokens[-1]]], device=self.spec.device)
        return Reference(prompt, tuple(tokens), torch.stack(rows), self.source)


class NoOracle(LookupError):
    """No oracle exists for the strategy an engine declares."""


#: Strategy kind -> oracle factory ``module:attr``, called as ``factory(spec, strategy)``; the
#: result has ``reference(prompt, max_new_tokens) -> Reference`` and ``source``. Imported lazily.
ORACLES: dict[str, str] = {
    "exact": "pytest_kvcompile.oracle:HFEagerOracle",
    "last_recent": "reference_impls.eviction:EvictionOracle",
    "streaming_llm": "reference_impls.eviction:EvictionOracle",
    "h2o": "reference_impls.eviction:EvictionOracle",
    "tova": "reference_impls.eviction:EvictionOracle",
    "streaming_llm_prefill": "reference_impls.eviction:EvictionOracle",
    "snapkv_prefill": "reference_impls.eviction:EvictionOracle",
    "tova_prefill": "reference_impls.eviction:EvictionOracle",
    "knorm_prefill": "reference_impls.eviction:EvictionOracle",
}


def oracle_for(strategy: Strategy, spec: ModelSpec):
    """The oracle that decides whether an engine with `strategy` is right on `spec`."""
    if strategy.kind not in ORACLES:
        raise NoOracle(f"no oracle for strategy '{strategy}' (known: {', '.join(sorted(ORACLES))})")
    module, _, attr = ORACLES[strategy.kind].partition(":")
    return getattr(importlib.import_module(module), attr)(spec, strategy)
