"""A model transformers does not have, written here in plain torch (issue 25): its own checkpoint format (config.json
with its own keys + weights.pt), an engine with an eager and a compiled mode, checked with ``--kv-oracle=eager``.

- `TinyGPT`: gpt-fast style: learned positions, a static KV cache object with ``update()``, prefill eager, the decode
  step under ``torch.compile`` (one graph: input_pos is a tensor). Correct: passes against its own eager mode.
- `TinyGPTWrongCompiled`: only the compiled graph is wrong (its decode mask hides the newest key, an off-by-one that
  ``torch.compiler.is_compiling()`` confines to the graph): must FAIL against its eager mode, which is right.
- `TinyGPTNoScore`: TinyGPT without score(): the eager oracle has no logits, tokens must be equal (a named
  limitation); `TinyGPTNoScoreWrongCompiled` must still fail.
- `TinyGPTLimited`: refuses prompts over 100 tokens: as an oracle, those prompts are not judged, the rest are.
- `TinyGPTWithLayout`: declares a KVLayout: its footprint check skips by name (no transformers config to compute it).
- `TinyGPTEager`: the same without torch.compile, `TinyGPTCounterpart`'s declared eager counterpart.
- `TinyGPTNotEager`: turns compilation back on inside generate(): as an eager oracle it ran compiled code, a failure.

``python tests/kv_own_model.py DIR`` writes the checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

from pytest_kvcompile import Declaration, KVLayout, ModelNotSupported, ModelSpec, Strategy

FORMAT = "kvtest-tinygpt"
CONFIG = {"format": FORMAT, "vocab_size": 96, "dim": 32, "heads": 2, "layers": 2, "max_position_embeddings": 320}


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """The model's own format: config.json (its keys, not transformers') and weights.pt, fixed seed."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(seed)
    model = TinyGPTModel(CONFIG)
    for p in model.parameters():
        if p.dim() > 1:  # matrices; norms and biases keep torch's defaults
            nn.init.normal_(p, std=0.3)
    torch.save(model.state_dict(), path / "weights.pt")
    return path


class KVCache(nn.Module):
    """Static K/V of one layer ([1, heads, max_len, head_dim]); ``update(input_pos, k, v)`` writes and returns all."""

    def __init__(self, heads: int, max_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, heads, max_len, head_dim, dtype=dtype))
        self.register_buffer("v", torch.zeros(1, heads, max_len, head_dim, dtype=dtype))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = 1 / math.sqrt(self.head_dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, wrong_when_compiled: bool) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        keys, values = self.cache.update(input_pos, k, v)
        key_pos = torch.arange(keys.size(2), device=x.device)
        mask = key_pos[None, :] <= input_pos[:, None]  # [t, max_len]: causal over what is cached
        if wrong_when_compiled and torch.compiler.is_compiling():
            mask = key_pos[None, :] < input_pos[:, None]  # the bug: the compiled graph hides the newest key
        scores = (q @ keys.transpose(-1, -2)) * self.scale
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.out((attn @ values).transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyGPTModel(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        dim = config["dim"]
        self.tok = nn.Embedding(config["vocab_size"], dim)
        self.pos = nn.Embedding(config["max_position_embeddings"], dim)
        self.blocks = nn.ModuleList(Block(dim, config["heads"]) for _ in range(config["layers"]))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, config["vocab_size"], bias=False)
        self.wrong_when_compiled = False

    def forward(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(input_pos)[None]
        for block in self.blocks:
            x = block(x, input_pos, self.wrong_when_compiled)
        return self.head(self.norm(x))


class TinyGPT:
    """Greedy decoding of the checkpoint: eager prefill, then ``torch.compile``'d decode steps over a static cache."""

    kv_declaration = Declaration(scoring=True, compiled=True, dtypes=("float32", "bfloat16", "float16", "float64"),
                                 description="a plain-torch model in its own checkpoint format (tests/kv_own_model.py)")
    wrong_when_compiled = False

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor"):
        config = json.loads((Path(spec.path) / "config.json").read_text())
        if config.get("format") != FORMAT:
            raise ModelNotSupported(f"not a {FORMAT} checkpoint (config.json format={config.get('format')!r})")
        self.spec, self.max_len = spec, config["max_position_embeddings"]
        self.model = TinyGPTModel(config)
        self.model.load_state_dict(torch.load(Path(spec.path) / "weights.pt", weights_only=True))
        self.model.wrong_when_compiled = self.wrong_when_compiled
        self.model = self.model.to(device=spec.device, dtype=spec.dtype).eval()
        head_dim = config["dim"] // config["heads"]
        for block in self.model.blocks:
            block.cache = KVCache(config["heads"], self.max_len, head_dim, spec.dtype).to(spec.device)
        self.decode = torch.compile(self.model, backend=compile_backend, fullgraph=True)

    def _reset(self) -> None:
        for block in self.model.blocks:
            block.cache.k.zero_()
            block.cache.v.zero_()

    @torch.inference_mode()
    def _rows(self, prompt: list[int], forced: list[int] | None, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """Prefill `prompt`, then `steps` decode steps: greedy (forced None) or fed `forced`; the logits per step."""
        self._reset()
        device = self.spec.device
        logits = self.model(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device))[0, -1]
        tokens, rows = [], []
        for step in range(steps):
            rows.append(logits.float().cpu())
            tokens.append(int(logits.argmax()) if forced is None else forced[step])
            if step + 1 < steps:
                pos = torch.tensor([len(prompt) + step], device=device)
                logits = self.decode(torch.tensor([[tokens[-1]]], device=device), pos)[0, -1]
        return tokens, rows

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [self._rows(list(p), None, max_new_tokens)[0] for p in prompts]

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        rows = self._rows(list(prompt), list(continuation), len(continuation))[1]
        return torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)


class TinyGPTWrongCompiled(TinyGPT):
    wrong_when_compiled = True


class TinyGPTNoScore(TinyGPT):
    kv_declaration = Declaration(compiled=True, description="TinyGPT without score()")


class TinyGPTNoScoreWrongCompiled(TinyGPTNoScore):
    wrong_when_compiled = True


class TinyGPTScoreOffByOne(TinyGPT):
    """score() rows shifted by one step: not what its generate() computes (as an oracle: unreliable, not judged)."""

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        rows = super().score(prompt, continuation)
        return torch.cat([rows[1:], rows[-1:]]) if len(rows) else rows


class TinyGPTEagerScoreOffByOne(TinyGPTScoreOffByOne):
    """Compiled, its score() off by one in every mode: against its own eager mode that is the engine's failure."""


class TinyGPTEvicting(TinyGPT):
    """Declares an eviction strategy: the exact TinyGPT cannot be its oracle."""

    kv_declaration = Declaration(scoring=True, compiled=True, strategy=Strategy.of("last_recent", budget=16))


class TinyGPTOffInFloat64(TinyGPT):
    """Right in every dtype but float64, where its attention forgets the 1/sqrt(d) scale: the float64 self-check's
    twin (as an oracle its float64 path disagrees with it: unreliable, not judged)."""

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor"):
        super().__init__(spec, compile_backend)
        if spec.dtype == torch.float64:
            for block in self.model.blocks:
                block.scale = 1.0


class TinyGPTLimited(TinyGPT):
    """Refuses prompts longer than 100 tokens (as LitGPT refuses prefills past a sliding window)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if any(len(p) > 100 for p in prompts):
            raise ValueError("prompts longer than 100 tokens are not supported")
        return super().generate(prompts, max_new_tokens)


class TinyGPTWithLayout(TinyGPT):
    """Declares its static cache's layout: a footprint the suite cannot compute without a transformers config."""

    kv_declaration = Declaration(scoring=True, compiled=True, kv_cache_bytes=True,
                                 kv_layout=KVLayout("static", max_cache_len=CONFIG["max_position_embeddings"], rows=1))

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.model.blocks for t in (b.cache.k, b.cache.v))


class TinyGPTEager(TinyGPT):
    """The same decoding without torch.compile (an eager counterpart, like vLLM's enforce_eager)."""

    kv_declaration = Declaration(scoring=True, description="TinyGPT, eager")

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.decode = self.model


class TinyGPTCounterpart(TinyGPTWrongCompiled):
    """The wrong compiled engine declaring TinyGPTEager as its eager counterpart."""

    kv_declaration = Declaration(scoring=True, compiled=True, eager="kv_own_model:TinyGPTEager")


class TinyGPTNotEager(TinyGPT):
    """Turns torch.compile back on inside generate() (``set_stance("default")``): not eager under force_eager."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        with torch.compiler.set_stance("default"):
            return super().generate(prompts, max_new_tokens)


if __name__ == "__main__":
    print(write_checkpoint(Path(sys.argv[1])))


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("TinyGPTWrongCompiled", "TinyGPTNoScoreWrongCompiled", "TinyGPTEagerScoreOffByOne",
    "TinyGPTCounterpart", "TinyGPTNotEager")
MUST_PASS = ("TinyGPT", "TinyGPTEager", "TinyGPTNoScore")
MUST_SKIP = ("TinyGPTScoreOffByOne", "TinyGPTOffInFloat64", "TinyGPTEvicting", "TinyGPTLimited", "TinyGPTWithLayout")
HELPERS = ("write_checkpoint", "KVCache", "Block", "TinyGPTModel")
