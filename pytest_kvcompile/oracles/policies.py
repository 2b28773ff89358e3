"""The eviction policies' exact rules (oracles/eviction.py's module docstring says what each keeps): `order`, the
one ranking rule, and the `Policy` classes that score candidates, shared by the masking oracle and the reference
eviction engines (reference_impls/eviction_engine.py): one rule, written once, on the checker's side."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pytest_kvcompile.contract.engine import Strategy

EMPTY = -1  # position of an empty cache slot


def order(pos: torch.Tensor, score: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """Candidate indices [..., n], best first: protected entries (by position), then the others by
    higher score, then lower position; empty slots (pos < 0) last. Deterministic: stable sorts, no reliance on
    topk's tie order."""
    key = torch.where(protected, torch.inf, score.to(torch.promote_types(score.dtype, torch.float32)))
    key = key.masked_fill(pos < 0, -torch.inf)
    by_pos = pos.argsort(dim=-1, stable=True)
    ranked = key.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True)
    return by_pos.gather(-1, ranked)


@dataclass(frozen=True)
class Policy:
    """One eviction rule. Tensors: `pos` [b, kv_heads, n] (-1 = empty), `newest` [b, 1, 1] the
    step's newest position, `weights` [b, kv_heads, group, queries, n] this step's softmax weights
    (zero on masked keys and padding queries), `prev` [b, kv_heads, n] the carried scores (0 for new),
    `keys` [b, kv_heads, n, head_dim] the candidates' keys (after RoPE; given by the oracle only)."""

    kind: ClassVar[str]
    budget: ClassVar[int]  # a field (last_recent, tova) or a property (streaming_llm, h2o); none for *_prefill
    prefill_only: ClassVar[bool] = False  # True: evict once, after prefill, to n_kept(prompt length)
    per_head: ClassVar[bool] = False  # False: every KV head of a layer keeps the same set (one choice per layer)
    scored: ClassVar[bool] = False  # True: scores come from attention or keys (near ties apply); False: positions

    @property
    def strategy(self) -> Strategy:
        """The strategy naming this policy; parameters at their default are left out."""
        return Strategy.of(self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                         if getattr(self, f.name) != f.default})

    def protected(self, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(pos, dtype=torch.bool)

    def score(self, prev: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, keys=None) -> torch.Tensor:
        return pos.float()  # recency

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if name == "positions":
                if value not in ("original", "shifted"):
                    raise ValueError(f"{self.kind}: positions={value!r} must be 'original' or 'shifted'")
                continue
            if name == "compression_ratio":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                    raise ValueError(f"{self.kind}: compression_ratio={value!r} must be a number in [0, 1)")
                continue
            least = 0 if name in ("sinks", "n_sink") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{self.kind}: {name}={value!r} must be an int >= {least}")


@dataclass(frozen=True)
class LastRecent(Policy):
    kind: ClassVar[str] = "last_recent"
    budget: int


@dataclass(frozen=True)
class StreamingLLM(Policy):
    kind: ClassVar[str] = "streaming_llm"
    sinks: int
    recent: int
    positions: str = "original"  # or "shifted": the paper's pos-shift (module docstring)

    @property
    def budget(self) -> int:
        return self.sinks + self.recent

    def protected(self, pos, newest):
        return (pos >= 0) & (pos < self.sinks)


@dataclass(frozen=True)
class H2O(Policy):
    kind: ClassVar[str] = "h2o"
    per_head: ClassVar[bool] = True
    scored: ClassVar[bool] = True
    heavy: int
    recent: int

    @property
    def budget(self) -> int:
        return self.heavy + self.recent

    def protected(self, pos, newest):
        return pos > newest - self.recent

    def score(self, prev, weights, pos, keys=None):
        return prev + weights.sum(dim=(2, 3))


@dataclass(frozen=True)
class TOVA(Policy):
    kind: ClassVar[str] = "tova"
    scored: ClassVar[bool] = True
    budget: int

    def score(self, prev, weights, pos, keys=None):
        return weights[:, :, :, -1].mean(dim=(1, 2))[:, None].expand_as(prev)


@dataclass(frozen=True)
class PrefillPolicy(Policy):
    """Evicts once, after prefill, to `n_kept(n)` entries of an n-token prompt; keeps every generated one."""

    prefill_only: ClassVar[bool] = True
    compression_ratio: float

    def n_kept(self, n: int) -> int:
        """kvpress's ``compute_n_kept``: max(1, int(n * (1 - compression_ratio))), Python floats."""
        return max(1, int(n * (1 - self.compression_ratio)))


@dataclass(frozen=True)
class StreamingLLMPrefill(PrefillPolicy):
    kind: ClassVar[str] = "streaming_llm_prefill"
    n_sink: int
    positions: str = "original"  # or "shifted": kvpress KeyRerotationPress (module docstring)

    def protected(self, pos, newest):
        return (pos >= 0) & (pos < self.n_sink)


@dataclass(frozen=True)
class SnapKVPrefill(PrefillPolicy):
    kind: ClassVar[str] = "snapkv_prefill"
    per_head: ClassVar[bool] = True
    scored: ClassVar[bool] = True
    window_size: int
    kernel_size: int

    def __post_init__(self):
        super().__post_init__()
        if self.kernel_size % 2 == 0:
            raise ValueError(f"{self.kind}: kernel_size={self.kernel_size} must be odd (kvpress pools to n + 1 scores)")

    def protected(self, pos, newest):
        return pos > newest - self.window_size

    def score(self, prev, weights, pos, keys=None):
        """weights: the prefill's [b, kv_heads, group, n, n]; the window's entries score 0 (protected)."""
        b, kv_heads, group, _, n = weights.shape
        scored = max(n - self.window_size, 0)
        if scored == 0:
            return weights.new_zeros(b, kv_heads, n)
        seen = weights[..., -self.window_size:, :scored].mean(dim=3)  # [b, kv_heads, group, scored]
        pooled = F.avg_pool1d(seen.reshape(-1, 1, scored), self.kernel_size, stride=1, padding=self.kernel_size // 2)
        return F.pad(pooled.view(b, kv_heads, group, scored).mean(dim=2), (0, n - scored))


@dataclass(frozen=True)
class TOVAPrefill(PrefillPolicy):
    kind: ClassVar[str] = "tova_prefill"
    scored: ClassVar[bool] = True

    def protected(self, pos, newest):
        return pos == newest

    def score(self, prev, weights, pos, keys=None):
        return TOVA.score(self, prev, weights, pos)


@dataclass(frozen=True)
class KNormPrefill(PrefillPolicy):
    kind: ClassVar[str] = "knorm_prefill"
    per_head: ClassVar[bool] = True
    scored: ClassVar[bool] = True

    def score(self, prev, weights, pos, keys=None):
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))


POLICIES: dict[str, type[Policy]] = {p.kind: p for p in (
    LastRecent, StreamingLLM, H2O, TOVA, StreamingLLMPrefill, SnapKVPrefill, TOVAPrefill, KNormPrefill)}


def policy_for(strategy: Strategy) -> Policy:
    """The policy a strategy declares, e.g. ``Strategy.of("h2o", heavy=8, recent=8)``."""
    if strategy.kind not in POLICIES:
        raise ValueError(f"unknown eviction strategy '{strategy.kind}'; known: {', '.join(POLICIES)}")
    cls, params = POLICIES[strategy.kind], dict(strategy.params)
    names = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    optional = [f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING]
    if not set(names) <= set(params) <= set(names + optional):
        extra = f" (optional: {', '.join(optional)})" if optional else ""
        raise ValueError(f"strategy '{strategy}' needs exactly the parameters {', '.join(names)}{extra}: write "
                         f"Strategy.of('{strategy.kind}', {', '.join(f'{n}=...' for n in names)})")
    return cls(**params)


def keep(policy: Policy, pos, score, newest, budget: int | None = None) -> torch.Tensor:
    """Indices of the candidates that stay: the first `budget` (default: the policy's) in `order`
    (all of them if fewer)."""
    return order(pos, score, policy.protected(pos, newest))[..., : policy.budget if budget is None else budget]
