"""Routing near ties (issue 69): a mixture-of-experts router's top-k is a discrete choice on noisy scores, exactly like
an eviction cut. Where the k-th chosen entry's score and the best one left out are nearer than a 16-bit computation's
error on that difference, a correct 16-bit engine may route the token to the other expert (or group), and its logits
then follow that routing, not the truth's.

**The decisions.** Every ``topk`` a mixture-of-experts block computes (a module with an ``experts`` child: the router of
Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3, whatever its scores are: softmax probabilities, raw logits, sigmoid scores
plus a correction bias, group scores) is a decision per token row (`Decision`): the chosen entry with the lowest
score (``kept``), the best entry left out (``dropped``), and their margin. A block's last top-k picks experts, an
earlier one groups (DeepSeek-V3's group-limited routing). Read by intercepting ``torch.topk`` while a block runs
(`Routes`), never by ``model_type``.

**The noise.** `calibrate` runs the float64 truth and the model in the run's 16-bit dtype (one forward each,
transformers' default attention) over the calibration prompts along the truth's own tokens, and measures, per decision
of the truth, the 16-bit computation's error on the margin: |(c[kept] - c[dropped]) - (t[kept] - t[dropped])|. The
tolerance is NOISE_FACTOR x its QUANTILE (oracles/precision.py's factor and quantile): a decision whose margin is
within it is near-tied.

**The alternatives.** Where an engine's token is not a near tie of the truth by the logit rule, the verdict asks for
the truth's alternatives (`alternatives`: the truth over the engine's own prefix with ONE near-tied decision taken the
other way, at most MAX_ALTERNATIVES: the judged position's own decisions, then the others nearest first; then CHAINS:
one of those swaps and a decision at the judged position that is near-tied in the swapped forward, at most
MAX_CHAINS. A group taken the other way puts other experts in the running, and a near tie among them is a second
coin flip a correct engine may lose too: seen under inductor on deepseek-v3 in bfloat16, margins 0.037 then 0.008
within a tolerance of 0.044): if the engine's token is a near tie of one of them (the same rule, its local term
measured against the truth's own row), the divergence is a near tie too, and the message names the swaps (layer,
position, experts). Routing bugs change many decisions by far more than the tolerance (bias ignored, renormalisation
missing, a shared expert dropped) and stay failures; the tests' twins show both sides.

**The 16-bit scale.** A correct 16-bit computation that routes one token the other way is off by whole logits from
then on: left in the noise, those swaps made the tie tolerance of a mixture-of-experts model 10x a dense one's (6-12
logits on the served zoo in bfloat16). So the calibration's scale comes from the equivalent computations routed as the
truth routes (`Pinned`: rounding alone), and routing swaps are the alternatives' to explain, one at a time; the
near-tie rates and the local term keep the computations routing on their own (a correct engine swaps as often).

**A KV cache stored lower.** An engine declaring one (Declaration.kv_cache_dtype, matmul_inputs:
oracles/computations.py, `KVComputation`) tips router near ties as 16-bit rounding does, in a float32 run too
(llama.cpp's float16 cache on qwen3-moe: a cut 3e-6 apart). That computation's router noise is measured the same way
(its forward through a fresh rounded cache), its calibration's scale comes from it pinned, and the engine's references
follow alternatives within the larger of its router tolerance and the run's (oracles/store.py: `LoweredView`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pytest_kvcompile.models.checkpoints import cache_keyword

MAX_ALTERNATIVES = 32  # near-tied decisions one divergence's alternatives take (the nearest first)
MAX_CHAINS = 8  # two-decision alternatives beside them (`alternatives`): the second near-tied once the first is taken
CALIBRATION_PROMPTS = 16  # calibration prompts (precision.CALIBRATION's first block) the router noise is measured on


@dataclasses.dataclass(frozen=True)
class Decision:
    """One top-k choice of one block for one token row: `kept` (the lowest-scored chosen entry) over `dropped` (the
    best one left out) by `margin`; `call`: the block's top-k (its last picks experts, earlier ones groups)."""

    block: str
    call: int
    row: int
    kept: int
    dropped: int
    margin: float
    groups: bool = False

    @property
    def layer(self) -> int | None:
        found = re.search(r"\.(\d+)\.", f".{self.block}.")
        return int(found.group(1)) if found else None

    def describe(self) -> str:
        what = "group" if self.groups else "expert"
        where = f"layer {self.layer}" if self.layer is not None else f"block {self.block}"
        return (f"{where}, position {self.row}: {what} {self.dropped} instead of {what} {self.kept} (router scores "
                f"{self.margin:.3g} apart)")


@dataclasses.dataclass(frozen=True)
class Route:
    """The truth's routing with near-tied decisions taken the other way: one, or a chain of two whose second is
    near-tied only once the first is taken (`alternatives`)."""

    swaps: tuple[Decision, ...]

    def describe(self) -> str:
        first, *then = self.swaps
        return first.describe() + "".join(f", then {d.describe()} once that is taken" for d in then)

    def to_list(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(d) for d in self.swaps]

    @classmethod
    def from_list(cls, data: Sequence[dict[str, Any]]) -> Route:
        return cls(tuple(Decision(**d) for d in data))


@dataclasses.dataclass(frozen=True)
class RouterNoise:
    """The measured noise of a model's routers in one 16-bit dtype (module docstring)."""

    model: str
    dtype: str
    scale: float  # QUANTILE of the margin errors
    max_error: float
    decisions: int  # margins measured, every computation's (rounding alone: `_margin_errors`)
    flips: int  # decisions the noisiest 16-bit computation took the other way
    factor: float
    lowered: str = ""  # what an engine declares it computes lower, in words (verdicts/lowered.py), measured instead

    @property
    def tolerance(self) -> float:
        return self.factor * self.scale

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tolerance": self.tolerance}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterNoise:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def describe(self) -> str:
        computed = f" with {self.lowered}" if self.lowered else ""
        return (f"{self.dtype} router noise of '{self.model}'{computed}: p99 error {self.scale:.3g} on "
                f"{self.decisions} routing-decision margins (max {self.max_error:.3g}), tolerance "
                f"{self.tolerance:.3g}; the noisiest computation routed {self.flips} decisions the other way")


def blocks(model: Any) -> dict[int, str]:
    """id -> name of each mixture-of-experts block of `model` (a module with an `experts` child); empty: dense."""
    root = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    found = {}
    for name, module in root.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, torch.nn.Module) and not any(name.startswith(f"{other}.") for other in found.values()):
            found[id(module)] = name
    return found


class Routes(TorchFunctionMode):
    """While active over a forward of `model`: records every top-k of its blocks (`calls`: (block, call, scores,
    indices)), and takes `swap` (a `Decision`, or a `Route`'s several) the other way."""

    def __init__(self, model: Any, swap: Decision | Route | None = None):
        super().__init__()
        self.swaps = swap.swaps if isinstance(swap, Route) else () if swap is None else (swap,)
        self.calls = []
        self._names = blocks(model)
        root = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
        self._modules = [m for m in root.modules() if id(m) in self._names]
        self._current: list[tuple[str, list[int]]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Routes:
        for module in self._modules:
            self._handles += [module.register_forward_pre_hook(self._enter_block),
                              module.register_forward_hook(self._leave_block, always_call=True)]
        return super().__enter__()

    def _enter_block(self, module: torch.nn.Module, _: Any) -> None:
        self._current.append((self._names[id(module)], [0]))

    def _leave_block(self, *_: Any) -> None:
        self._current.pop()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in (torch.topk, torch.Tensor.topk) or not self._current:
            return out
        block, counter = self._current[-1]
        call = counter[0]
        counter[0] += 1
        scores = args[0]
        values, indices = out
        swaps = [swap for swap in self.swaps if swap.block == block and swap.call == call]
        if swaps:
            indices = indices.clone()
            flat = indices.view(-1, indices.size(-1))
            for swap in swaps:
                slot = (flat[swap.row] == swap.kept).nonzero()
                if len(slot):
                    flat[swap.row, int(slot[0, 0])] = swap.dropped
            values = scores.reshape(-1, scores.size(-1)).gather(-1, flat).view_as(values)
            out = torch.return_types.topk((values, indices))
        self.calls.append((block, call, scores.detach().reshape(-1, scores.size(-1)).double(),
                           out[1].detach().reshape(-1, out[1].size(-1))))
        return out


class Pinned(Routes):
    """While active over forwards of `model` (the run's 16-bit model): the top-k of every block at each position of
    the batch's first sequence takes the truth's choice there (`chosen`: (block, call) -> indices [positions, k], from
    `truth_routing`), its values gathered from the 16-bit scores: the computation routes as the truth does, so what it
    differs by is rounding alone (`precision.calibrate`'s scale). Positions: the forward's position_ids (padding, where
    its attention mask has it, and the batch's other sequences: not pinned), else the cache's length onward."""

    def __init__(self, model: Any, chosen: dict[tuple[str, int], torch.Tensor]):
        super().__init__(model)
        self.chosen, self.positions = chosen, None
        self._root = model

    def __enter__(self) -> Pinned:
        self._handles.append(self._root.register_forward_pre_hook(self._rows, with_kwargs=True))
        return super().__enter__()

    def _rows(self, _: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        batch, length = ids.shape
        given, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        if given is not None:
            first = given[0].clone()
            if mask is not None:
                first[mask[0, -length:] == 0] = -1
        else:
            cache = kwargs.get(cache_keyword())
            start = cache.get_seq_length() if cache is not None else 0
            first = torch.arange(start, start + length, device=ids.device)
        self.positions = torch.cat((first, first.new_full(((batch - 1) * length,), -1))).cpu()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk) or not self._current or self.positions is None:
            return func(*args, **kwargs)
        block, counter = self._current[-1]
        call = counter[0]
        counter[0] += 1
        values, indices = func(*args, **kwargs)
        chosen = self.chosen.get((block, call))
        flat_scores = args[0].reshape(-1, args[0].size(-1))
        if chosen is None or flat_scores.size(0) != len(self.positions):
            return torch.return_types.topk((values, indices))
        flat = indices.reshape(-1, indices.size(-1)).clone()
        rows = ((self.positions >= 0) & (self.positions < len(chosen))).nonzero()[:, 0]
        flat[rows.to(flat.device)] = chosen[self.positions[rows]].to(flat.device)
        values = flat_scores.gather(-1, flat).view_as(values)
        return torch.return_types.topk((values, flat.view_as(indices)))


def truth_routing(truth: Any, ids: Sequence[int], device: Any) -> dict[tuple[str, int], torch.Tensor]:
    """The truth's choices over one sequence: (block, call) -> indices [positions, k] (`Pinned`'s)."""
    return {(block, call): chosen.cpu() for block, call, _, chosen in _forward(truth, ids, device)[1]}


def decisions(calls: Sequence[tuple[str, int, torch.Tensor, torch.Tensor]]) -> list[Decision]:
    """Every call's decision per row (`Decision`)."""
    last = {}
    for block, call, _, _ in calls:
        last[block] = max(last.get(block, call), call)
    found = []
    for block, call, scores, chosen in calls:
        inside = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, chosen, True)
        if bool(inside.all()):
            continue
        kept_score, kept = scores.masked_fill(~inside, torch.inf).min(-1)
        dropped_score, dropped = scores.masked_fill(inside, -torch.inf).max(-1)
        margin = (kept_score - dropped_score).tolist()
        found += [Decision(block, call, row, int(kept[row]), int(dropped[row]), margin[row], call < last[block])
                  for row in range(scores.size(0))]
    return found


def _forward(model: Any, ids: Sequence[int], device: Any,
             swap: Decision | Route | None = None) -> tuple[torch.Tensor, list]:
    """`model` over one sequence without a cache: the last row's logits (float32, CPU) and its top-k calls."""
    with torch.inference_mode(), Routes(model, swap) as routes:
        logits = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False).logits[0, -1]
    return logits.float().cpu(), routes.calls


def _margin_errors(truth: list, computed: list) -> tuple[torch.Tensor, int]:
    """The computed run's error on each of the truth's decision margins (the calls in the same order), and how many
    decisions it took the other way. Rounding alone: a row is measured only before the first row any earlier call
    routed the other way (a causal model: that row's and every later row's hidden states then follow another
    routing, which `alternatives` recomputes, not noise)."""
    errors, flips, clean = [], 0, None
    for (block, call, t, chosen), (other, other_call, c, got) in zip(truth, computed, strict=True):
        if (block, call) != (other, other_call) or t.shape != c.shape:
            raise RuntimeError(f"the 16-bit run's routing calls differ from the truth's at {block} (call {call})")
        rows = t.size(0) if clean is None else clean
        inside = torch.zeros_like(t, dtype=torch.bool).scatter(-1, chosen, True)
        flipped = (chosen.sort(-1).values != got.sort(-1).values).any(-1)
        flips += int(flipped.sum())
        if bool(flipped.any()):
            clean = min(rows, int(flipped.nonzero()[0, 0]))
        if bool(inside.all()) or not rows:
            continue
        kept = t.masked_fill(~inside, torch.inf).argmin(-1, keepdim=True)
        dropped = t.masked_fill(inside, -torch.inf).argmax(-1, keepdim=True)
        errors.append(((c.gather(-1, kept) - c.gather(-1, dropped)) - (t.gather(-1, kept) - t.gather(-1, dropped)))
                      [:rows, 0].abs())
    return (torch.cat(errors) if errors else torch.zeros(0, dtype=torch.float64)), flips


def calibrate(name: str, dtype: str, truth: Any, computed: Sequence[Any], sequences: Sequence[Sequence[int]],
              device: Any, factor: float, quantile: float, lowered: str = "") -> RouterNoise:
    """The router noise of `computed` (the model in the run's dtype, each way it is computed: transformers' default
    attention, and where the model has latent attention that attention absorbed, oracles/absorbed.py; or, `lowered`,
    computing lower as an engine declares: oracles/computations.py's KVComputation) against `truth` (module
    docstring) over `sequences` (prompt + the truth's tokens): every computation's errors together, the flips of the
    one that routed most decisions the other way."""
    errors, flipped = [], [0] * len(computed)
    for ids in sequences:
        _, t = _forward(truth, ids, device)
        for i, model in enumerate(computed):
            error, flips = _margin_errors(t, _forward(model, ids, device)[1])
            errors.append(error)
            flipped[i] += flips
    flips = max(flipped, default=0)
    error = torch.cat(errors)
    if not len(error):
        return RouterNoise(name, dtype, 0.0, 0.0, 0, 0, factor, lowered)
    return RouterNoise(name, dtype, float(error.quantile(quantile)), float(error.max()), len(error), flips, factor,
                       lowered)


def alternatives(truth: Any, ids: Sequence[int], device: Any, tolerance: float) -> list[tuple[Route, torch.Tensor]]:
    """The truth's logits at the last position of `ids` with near-tied decisions (margin <= `tolerance`) taken the
    other way, each beside its `Route`: one decision, up to MAX_ALTERNATIVES, the last position's first (they route the
    very token whose logits are judged), then the earlier ones nearest first; then up to MAX_CHAINS chains, in that
    order: one of those and a decision at the last position after it (a later top-k of the forward) that is near-tied
    in its swapped forward (nearest first)."""
    last = len(ids) - 1
    _, calls = _forward(truth, ids, device)
    order = {(block, call): i for i, (block, call, _, _) in enumerate(calls)}  # the forward's top-k calls in turn
    near = sorted((d for d in decisions(calls) if d.margin <= tolerance), key=lambda d: (d.row != last, d.margin))
    found, chains = [], []
    for first in near[:MAX_ALTERNATIVES]:
        route = Route((first,))
        row, swapped = _forward(truth, ids, device, route)
        found.append((route, row))
        chains += [Route((first, then)) for then in sorted(decisions(swapped), key=lambda d: d.margin)
                   if then.row == last and 0 <= then.margin <= tolerance
                   and order[then.block, then.call] > order[first.block, first.call]]
    return found + [(route, _forward(truth, ids, device, route)[0]) for route in chains[:MAX_CHAINS]]


__all__ = ["Decision", "Pinned", "Route", "RouterNoise", "Routes", "alternatives", "blocks", "calibrate", "decisions",
           "truth_routing"]
