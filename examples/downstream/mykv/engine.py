"""One static KV cache per engine, an eager prefill and a compiled decode step (the gpt-fast recipe on a
transformers model). One prompt per call: it declares no batching, so the suites send prompts one at a time."""

from __future__ import annotations

import torch
from pytest_kvcompile import Declaration, KVLayout, ModelSpec, cache_tensors, held_bytes, with_cache
from transformers import AutoModelForCausalLM, StaticCache

MAX_CACHE_LEN = 512


class StaticDecode:
    kv_declaration = Declaration(
        compiled=True, kv_cache_bytes=True, kv_layout=KVLayout("static", max_cache_len=MAX_CACHE_LEN),
        description="mykv: StaticCache(512) reused across calls, eager prefill, torch.compile'd decode step")

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor"):
        self.model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=spec.dtype).to(spec.device).eval()
        self.device = spec.device
        self.cache = StaticCache(config=self.model.config, max_cache_len=MAX_CACHE_LEN)
        self.decode_step = torch.compile(self._step, backend=compile_backend, dynamic=False)

    def _step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # with_cache: `cache=` on transformers >= 5.24, `past_key_values=` before (the installed release's spelling)
        out = self.model(input_ids=token, **with_cache(self.cache), cache_position=position, use_cache=True)
        return out.logits[:, -1]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [self._one(prompt, max_new_tokens) for prompt in prompts]

    def _one(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        if len(prompt) + max_new_tokens > MAX_CACHE_LEN:
            raise ValueError(f"prompt + new tokens = {len(prompt) + max_new_tokens} > max_cache_len {MAX_CACHE_LEN}")
        self.cache.reset()  # the same cache serves every call: stale keys would leak into the next prompt
        ids = torch.tensor([prompt], device=self.device)
        logits = self._step(ids, torch.arange(len(prompt), device=self.device))  # prefill, eager
        tokens = [int(logits.argmax(-1))]
        for i in range(max_new_tokens - 1):
            token = torch.tensor([[tokens[-1]]], device=self.device)
            position = torch.tensor([len(prompt) + i], device=self.device)
            tokens.append(int(self.decode_step(token, position).argmax(-1)))
        return tokens

    def kv_cache_bytes(self) -> int:
        return held_bytes(cache_tensors(self.cache))
