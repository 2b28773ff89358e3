"""A model transformers does not have: plain torch, its own checkpoint format (config.json with its own keys +
weights.pt), a static KV cache and a torch.compile'd decode step. Checked against its own eager mode
(``--kv-oracle=eager``: the same class with torch.compile off), since no transformers oracle can load it.

    python -m mykv.own ckpt/          # writes a tiny random checkpoint (fixed seed)
    pytest --pyargs pytest_kvcompile.suites --kv-engine=mykv-own --kv-zoo=none --kv-model=ckpt/
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from pytest_kvcompile import Declaration, ModelSpec
from torch import nn

CONFIG = {"format": "mykv-own", "vocab_size": 64, "dim": 32, "heads": 2, "layers": 2, "max_position_embeddings": 320}


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm, self.qkv, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("k", torch.zeros(1, heads, max_len, self.head_dim), persistent=False)
        self.register_buffer("v", torch.zeros(1, heads, max_len, self.head_dim), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.k.index_copy_(2, pos, k)  # the cache, written by position
        self.v.index_copy_(2, pos, v)
        mask = torch.arange(self.k.size(2), device=x.device)[None] <= pos[:, None]
        scores = (q @ self.k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        x = x + self.out(
            (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ self.v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.tok, self.pos = (nn.Embedding(c["vocab_size"], c["dim"]),
                              nn.Embedding(c["max_position_embeddings"], c["dim"]))
        self.layers = nn.ModuleList(
            Layer(c["dim"], c["heads"], c["max_position_embeddings"]) for _ in range(c["layers"]))
        self.head = nn.Sequential(nn.LayerNorm(c["dim"]), nn.Linear(c["dim"], c["vocab_size"], bias=False))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(pos)[None]
        for layer in self.layers:
            x = layer(x, pos)
        return self.head(x)[0, -1]


class OwnDecode:
    """Greedy decoding: eager prefill, compiled decode step over the static cache (one prompt per call)."""

    kv_declaration = Declaration(compiled=True, scoring=True, dtypes=("float32", "bfloat16", "float16", "float64"),
                                 description="mykv-own: a plain-torch model in its own format, compiled decode step")

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor"):
        self.spec = spec
        self.model = Model(json.loads((Path(spec.path) / "config.json").read_text()))
        self.model.load_state_dict(torch.load(Path(spec.path) / "weights.pt", weights_only=True))
        self.model = self.model.to(device=spec.device, dtype=spec.dtype).eval()
        self.decode = torch.compile(self.model, backend=compile_backend, fullgraph=True)

    @torch.inference_mode()
    def _run(self, prompt: list[int], steps: int, forced: list[int] | None = None):
        for layer in self.model.layers:  # a fresh cache per call
            layer.k.zero_()
            layer.v.zero_()
        device = self.spec.device
        logits = self.model(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device))
        tokens, rows = [], []
        for i in range(steps):
            rows.append(logits.float().cpu())
            tokens.append(int(logits.argmax()) if forced is None else forced[i])
            if i + 1 < steps:
                pos = torch.tensor([len(prompt) + i], device=device)
                logits = self.decode(torch.tensor([[tokens[-1]]], device=device), pos)
        return tokens, rows

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [self._run(p, max_new_tokens)[0] for p in prompts]

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        rows = self._run(prompt, len(continuation), continuation)[1]
        return torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)


def write(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(seed)
    model = Model(CONFIG)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.3)
    torch.save(model.state_dict(), path / "weights.pt")
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "ckpt")))
