"""The float64 truth's model (oracles/precision.py): the checkpoint loaded once per process and dtype (`load_lm`,
shared by every oracle path that only calls it), and evaluated in float64 over its stored 16-bit or float32 weights
one module at a time (`Widened`), the vocabulary's matrices in slices: the truth of an 8B model without its 64 GB
float64 copy (issue 54)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from pathlib import Path
from typing import Any

import torch

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models.checkpoints import per_expert

WIDE_AT_ONCE = 1 << 24  # the most weights of one module `Widened` holds in float64 at once (128 MiB)


@dataclasses.dataclass(frozen=True)
class HighPrecisionSpec(ModelSpec):
    """A ModelSpec whose weights are rounded to `weights_dtype` before they are cast to `dtype` (the truth)."""

    weights_dtype: torch.dtype = torch.bfloat16


def high_precision(spec: ModelSpec) -> HighPrecisionSpec:
    """The truth of a 16-bit `spec`: its weights rounded to spec.dtype, evaluated in float64."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}
    return HighPrecisionSpec(**{**fields, "dtype": torch.float64}, weights_dtype=spec.dtype)


def load_lm(spec: ModelSpec, widened: bool = False, **kwargs: Any):
    """transformers' model of the checkpoint in spec.dtype on spec.device, eval mode; a `HighPrecisionSpec`'s weights
    pass through its weights_dtype first. Every oracle loads its model here.

    `widened` (a float64 spec, for callers that only call the model): the weights stay in the dtype they pass through
    (the run's 16-bit dtype; float32 for a float32 checkpoint's float64 path) and the model runs in float64 one module
    at a time (`Widened`): the same function, a quarter (or half) of the memory (issue 54). Models whose weights are
    stored as loaded are shared within the process (`_shared`): a 16-bit run's truth and its equivalent computations
    hold one copy of the weights."""
    through = getattr(spec, "weights_dtype", None) or spec.dtype
    if widened and spec.dtype == torch.float64:
        # a 16-bit run's truth keeps the 16-bit weights; a float32 run's float64 path the float32 ones, unless the
        # checkpoint itself is float64 (read from the config's own fields: the property warns on transformers 5)
        saved = vars(spec.config).get("dtype", vars(spec.config).get("torch_dtype")) if spec.config else None
        stored = through if through != torch.float64 else None if str(saved) in ("float64", "torch.float64") \
            else torch.float32
        if stored is not None:
            return Widened(_shared(spec, stored, kwargs))
    if through == spec.dtype:
        return _shared(spec, through, kwargs)
    from pytest_kvcompile.models.checkpoints import pretrained

    return pretrained(spec.path, through, **kwargs).to(device=spec.device, dtype=spec.dtype).eval()


_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (checkpoint, dtype, device, kwargs) -> model


def _shared(spec: ModelSpec, dtype: torch.dtype, kwargs: dict[str, Any]) -> Any:
    """The checkpoint's model in `dtype` on spec.device, one object per process while anyone holds it. Safe to share:
    the oracles only call it, and what a call changes (`Widened`'s dtypes, `_Switched`'s attention) it restores."""
    from pytest_kvcompile.models.checkpoints import pretrained

    key = (str(Path(spec.path).resolve()), str(dtype), str(spec.device), repr(sorted(kwargs.items())))
    model = _LOADED.get(key)
    if model is None:
        model = _LOADED[key] = pretrained(spec.path, dtype, **kwargs).to(device=spec.device).eval()
    return model


class Widened:
    """`model`, its weights in a lower dtype, evaluated in float64 one module at a time: while a module's forward
    runs, float64 copies of its own parameters and floating-point buffers, and of its leaf children's (a forward may
    read a child's weight without calling the child), stand in for them (the stored tensors are
    left untouched: nothing is reallocated). Exact (every bfloat16, float16 and float32 value is a float64 value), so
    the model computes what its float64 copy computes,
    while the whole model is never held in float64: at most the modules being run (a layer, the embedding, the output
    head). Call it as the model; other attributes (config, ...) are the model's. For callers that only call it: a
    submodule called on its own runs in the stored dtype. A constant a model computes when it is built (Gemma's
    embedding scale) has the precision of the dtype it was built in: bit for bit a 16-bit run's float64 copy (also
    built through the 16-bit dtype), ~1e-7 relative from a float32 checkpoint loaded straight into float64."""

    def __init__(self, model: Any):
        self.model = model

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in (its weights are stored in another)."""
        return torch.float64

    def __getattr__(self, name: str) -> Any:
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run({}, args, kwargs)

    def screened(self, tolerance: float, *args: Any, **kwargs: Any) -> Any:
        """The call's output, for a caller asking only which token is a position's best and whether another trails it
        by more than `tolerance` (a float32 oracle's self-check): an output head projected in slices is screened
        instead (`_screen`: a float32 pass, the entries that can matter recomputed in float64). Where the model
        changes the head's output afterwards (a softcap, a scale), the plain call's output is returned."""
        head = self.model.get_output_embeddings()
        if not (type(head) is torch.nn.Linear and head.bias is None and head.weight.numel() > WIDE_AT_ONCE):
            return self(*args, **kwargs)
        given: list[torch.Tensor] = []

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = _screen(head, tolerance, x)
            given.append(_sliced(head, x) if out is None else out)
            return given[-1]

        output = self._run({id(head): forward}, args, kwargs)
        if len(given) == 1 and torch.equal(output.logits, given[0]):
            return output
        return self(*args, **kwargs)

    def _run(self, forwards: dict[int, Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        big = [m for m in self.model.modules() if type(m) in (torch.nn.Linear, torch.nn.Embedding)
               and m.weight.numel() > WIDE_AT_ONCE]  # the vocabulary's: in slices (`_sliced`)
        depth: dict[int, int] = {}
        saved: dict[int, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}

        def own(module: torch.nn.Module) -> bool:
            return not any(module is b for b in big) and (any(True for _ in module.parameters(recurse=False)) or any(
                True for _ in module.buffers(recurse=False)))

        # a module's own tensors, and its leaf children's: a forward may read a child's weight without calling it
        # (transformers' Mamba2 and Gated DeltaNet mixers hand `self.conv1d.weight` to a conv function, which then
        # casts its input to that weight's dtype: the truth's conv ran in 16-bit before)
        widened = {id(m): [m] + [c for c in m.children() if not any(True for _ in c.children()) and own(c)]
                   for m in self.model.modules()}

        def widen(module: torch.nn.Module, *_: Any) -> None:
            key = id(module)
            depth[key] = depth.get(key, 0) + 1
            if depth[key] > 1:
                return
            saved[key] = []
            with torch.no_grad():  # the stored tensors stay as they are: a float64 copy stands in for each meanwhile
                for owner in widened[key]:
                    for name, param in owner.named_parameters(recurse=False):
                        if param.is_floating_point() and param.dtype != torch.float64:
                            saved[key].append((owner, name, param))
                            setattr(owner, name, torch.nn.Parameter(param.detach().double(), requires_grad=False))
                    for name, buffer in owner.named_buffers(recurse=False):
                        if buffer.is_floating_point() and buffer.dtype != torch.float64:
                            saved[key].append((owner, name, buffer))
                            setattr(owner, name, buffer.double())  # a registered buffer's name: replaced as a buffer

        def narrow(module: torch.nn.Module, *_: Any) -> None:
            key = id(module)
            depth[key] -= 1
            if depth[key]:
                return
            for owner, name, tensor in reversed(saved.pop(key)):
                setattr(owner, name, tensor)

        owners = [m for m in self.model.modules() if len(widened[id(m)]) > 1 or own(m)]
        handles = [h for m in owners for h in (m.register_forward_pre_hook(widen),
                                               m.register_forward_hook(narrow, always_call=True))]
        for module in big:
            module.forward = forwards.get(id(module)) or functools.partial(_sliced, module)
        experts = per_expert(self.model)  # routed experts: the grouped kernel refuses float64
        try:
            return self.model(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            for module in big:
                del module.forward
            if experts is not None:
                self.model.set_experts_implementation(experts)


def _sliced(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module` (an nn.Linear or nn.Embedding of over WIDE_AT_ONCE weights: the vocabulary's) in float64 without its
    float64 copy: an embedding gathers its stored rows, then widens them; a linear layer widens its weight WIDE_AT_ONCE
    values at a time, each slice of output features computed from its own float64 slice (the same dot products)."""
    if isinstance(module, torch.nn.Embedding):
        return torch.nn.functional.embedding(x, module.weight, module.padding_idx, module.max_norm, module.norm_type,
                                             module.scale_grad_by_freq, module.sparse).double()
    x = x.double()
    rows = max(1, WIDE_AT_ONCE // module.in_features)
    out = torch.cat([x @ module.weight[i:i + rows].double().T for i in range(0, module.out_features, rows)], dim=-1)
    return out if module.bias is None else out + module.bias.double()


_U32 = 2.0 ** -24  # float32's unit roundoff
_ROW_NORMS: dict[int, tuple[Any, int, float]] = {}  # id(a head weight) -> (weak reference, version, largest row norm)


def _screen(module: torch.nn.Linear, tolerance: float, x: torch.Tensor) -> torch.Tensor | None:
    """`_sliced(module, x)` wherever it can decide which token is a position's best and whether another trails it by
    more than `tolerance`, without widening the head: every entry is computed in float32 from the float64 input, off
    by at most B = (n u / (1 - n u) + u) |x| max_j |w_j| (Higham's bound for a float32 dot product of length n, u
    float32's roundoff, Cauchy-Schwarz; doubled for safety), then every column within `tolerance` + 2B of some
    position's best is recomputed in float64 (WIDE_AT_ONCE weights at a time). So the best token and every entry
    within `tolerance` of it are exactly the float64 head's, and every other entry trails the best by more than
    `tolerance` in either computation. None (project in slices) where float32 matmuls may run in a lower precision
    (TF32), the bound is not finite, or it keeps over half of the columns."""
    if torch.get_float32_matmul_precision() != "highest":
        return None
    weight, n = module.weight, module.in_features
    ref, version, largest = _ROW_NORMS.get(id(weight), (None, -1, 0.0))
    if ref is None or ref() is not weight or version != weight._version:
        if len(_ROW_NORMS) > 8:
            _ROW_NORMS.clear()
        largest = float(torch.linalg.vector_norm(weight.float(), dim=1).max())
        _ROW_NORMS[id(weight)] = (weakref.ref(weight), weight._version, largest)
    x = x.double()
    flat = x.reshape(-1, n)
    approx = (flat.float() @ weight.float().T).double()
    bound = 2 * (n * _U32 / (1 - n * _U32) + _U32) * torch.linalg.vector_norm(flat, dim=1) * largest
    best = approx.max(dim=1).values
    if not (torch.isfinite(bound).all() and torch.isfinite(best).all()):
        return None
    columns = (approx >= (best - tolerance - 2 * bound)[:, None]).any(dim=0).nonzero().squeeze(1)
    if 2 * columns.numel() > module.out_features:  # the bound rules out too little to save anything
        return None
    rows = max(1, WIDE_AT_ONCE // n)
    for i in range(0, columns.numel(), rows):
        approx[:, columns[i:i + rows]] = flat @ weight[columns[i:i + rows]].double().T
    return approx.reshape(*x.shape[:-1], -1)
