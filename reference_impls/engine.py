"""The greedy loop of the reference engines: `generate` and `score` over an engine's `_prefill` and `_decode`.

One path for both: `score` is `generate`'s loop fed the given tokens (teacher forcing), so a scored row is
exactly what generation computes at that step. (static_cache.py keeps its own loop: it pads batches to a
fixed row count.)
"""

from __future__ import annotations

import torch

from pytest_kvcompile.contract.engine import ModelSpec


class Engine:
    """Greedy generation over `_prefill(prompts) -> (last logits [b, vocab], state)` and
    `_decode(tokens [b], state) -> (logits, state)`, then `_finish(state)`; `state.cache` is the per-layer K/V tensors
    (the last generate's stay in `self.cache`, for `kv_cache_bytes`)."""

    spec: ModelSpec
    cache: list

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens <= 0 or not prompts:
            self.cache = []
            return [[] for _ in prompts]
        logits, state = self._prefill(prompts)
        out = [logits.argmax(-1)]
        for _ in range(max_new_tokens - 1):
            logits, state = self._decode(out[-1], state)
            out.append(logits.argmax(-1))
        self.cache = state.cache
        self._finish(state)
        return torch.stack(out, dim=1).tolist()

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(continuation), vocab]: the generate path, fed `continuation`."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size, dtype=self.spec.dtype, device=self.spec.device)
        logits, state = self._prefill([prompt])
        rows = [logits[0]]
        for token in continuation[:-1]:
            logits, state = self._decode(torch.tensor([token], device=self.spec.device), state)
            rows.append(logits[0])
        self._finish(state)
        return torch.stack(rows)

    def _finish(self, state) -> None:
        """A call's last step is done (generate or score): an engine keeping state across calls settles it here."""

    def kv_cache_bytes(self) -> int:
        """Bytes of the K/V tensors the last generate left."""
        return sum(x.numel() * x.element_size() for kv in self.cache for x in kv)
