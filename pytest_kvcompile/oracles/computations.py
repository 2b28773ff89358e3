"""The equivalent 16-bit computations the noise is measured over (oracles/precision.py's module docstring, "The
noise"): transformers in the run's dtype with its cache, without one, in a left-padded batch, with the prompt prefilled
in chunks, and on a model with latent attention that attention absorbed, with its cache (`Computations`,
oracles/absorbed.py); and an engine computing lower as it declares: a KV cache stored lower, matmul inputs quantised
(`KVComputation`, `kv_round`, `matmul_round`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch

from pytest_kvcompile.contract.engine import Lowered, ModelSpec
from pytest_kvcompile.models.checkpoints import keep_last, max_positions, positions, with_cache
from pytest_kvcompile.oracles import routing
from pytest_kvcompile.oracles.truth import Widened, load_lm
from pytest_kvcompile.recompiles.hooks import attention_kernel

CHUNK = 5  # prefill chunk of the chunked computation
COMPANION = 7  # tokens the left-padded computation's companion sequence is longer by
COMPUTATIONS = ("eager, cache", "sdpa, no cache", "sdpa, left-padded batch", "eager, chunked prefill")
ABSORBED = "absorbed latent attention, cache"  # a fifth on models with latent layers (oracles/absorbed.py)
KV_GROUP = 32  # values per quantization group along head_dim in the integer KV simulation (llama.cpp's q8_0 block)


class Computations:
    """The equivalent 16-bit computations (`COMPUTATIONS`) of `spec` (its own dtype and device). A model transformers
    gives no SDPA path (GPT-OSS: its sinks) computes the no-cache and padded ones with its eager kernel: other
    roundings still (other shapes, other reductions), one attention family (`family_spread`). A model with latent
    attention (MLA) adds `ABSORBED`: decoded through its cache as serving engines decode it (oracles/absorbed.py)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    @property
    def names(self) -> tuple[str, ...]:
        names = COMPUTATIONS if self.sdpa is not self.eager else tuple(n.replace("sdpa", "eager") for n in COMPUTATIONS)
        return names + ((ABSORBED,) if self.absorbed is not None else ())

    @functools.cached_property
    def base(self) -> Any:
        """The model in the run's dtype with transformers' default attention, loaded on first use (measured noise and
        local rows come from the disk store when they are there): the same object as the 16-bit run's truth holds
        (oracles/truth.py: `load_lm`), so the harness keeps one copy of the weights."""
        return load_lm(self.spec)

    @functools.cached_property
    def eager(self) -> Any:
        return self._kernel("eager")

    @functools.cached_property
    def sdpa(self) -> Any:
        try:
            return self._kernel("sdpa")
        except ValueError:  # transformers: "does not support an attention implementation through ... sdpa"
            return self.eager

    def _kernel(self, kernel: str) -> Any:
        """The base model computing attention with `kernel`: itself, or switched per call where transformers switches
        a model's attention in place (5.x), else a second copy (issue 54: the harness's memory is the engine's
        order, not a multiple of it)."""
        home = attention_kernel(self.base)
        if home == kernel:
            return self.base
        switch = getattr(self.base, "set_attn_implementation", None)
        can = getattr(self.base, "_can_set_attn_implementation", lambda: False)
        if switch is None or not can():
            return load_lm(self.spec, attn_implementation=kernel)
        switch(kernel)  # refused here (ValueError) where transformers has no such path for the model
        switch(home)
        return _Switched(self.base, kernel, home)

    @functools.cached_property
    def absorbed(self) -> Any:
        """The base model with its latent attention absorbed (oracles/absorbed.py), None where it has none."""
        from pytest_kvcompile.oracles.absorbed import absorbed

        return absorbed(self.base)

    @functools.cached_property
    def routed(self) -> bool:
        """Whether the model routes tokens to experts (oracles/routing.py): its computations can be `pinned`."""
        return bool(routing.blocks(self.base))

    @torch.inference_mode()
    def along(self, prompt: Sequence[int], tokens: Sequence[int], pinned: bool = False) -> torch.Tensor:
        """Logits [computations, len(tokens), vocab] (float64, CPU) of each computation at every step of
        prompt + tokens (row i predicts tokens[i]). `pinned` (a mixture-of-experts model): each routes every token as
        the float64 truth does (routing.Pinned), so the rows differ from the truth's by rounding alone."""
        prompt, tokens = [int(t) for t in prompt], [int(t) for t in tokens]
        if not tokens:
            return torch.empty(len(self.names), 0, self.spec.vocab_size, dtype=torch.float64)
        with contextlib.ExitStack() as stack:
            if pinned and self.routed:
                chosen = routing.truth_routing(Widened(self.base), prompt + tokens[:-1], self.spec.device)
                stack.enter_context(routing.Pinned(self.base, chosen))
            rows = [self._cached(self.eager, [prompt], tokens), self._whole(self.sdpa, prompt, tokens),
                    self._padded(self.sdpa, prompt, tokens), self._cached(self.eager, _chunks(prompt), tokens)]
            if self.absorbed is not None:
                rows.append(self._cached(self.absorbed, [prompt], tokens))
        return torch.stack([r.double().cpu() for r in rows])

    def _ids(self, ids) -> torch.Tensor:
        return torch.tensor([ids], device=self.spec.device)

    def _cached(self, model, prefill: list[list[int]], tokens: list[int]) -> torch.Tensor:
        from pytest_kvcompile.models.checkpoints import dynamic_cache, per_layer_cache

        if not per_layer_cache():  # see per_layer_cache: the same computation without a cache
            return self._whole(model, [t for chunk in prefill for t in chunk], tokens)
        cache, rows, fed = dynamic_cache(model.config), [], 0
        for chunk in prefill:
            logits = model(input_ids=self._ids(chunk), **with_cache(cache), use_cache=True,
                           **positions(fed, len(chunk), self.spec.device)).logits[0, -1]
            fed += len(chunk)
        rows.append(logits)
        for token in tokens[:-1]:
            rows.append(model(input_ids=self._ids([token]), **with_cache(cache), use_cache=True,
                              **positions(fed, 1, self.spec.device)).logits[0, -1])
            fed += 1
        return torch.stack(rows)

    def _whole(self, model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        ids = prompt + tokens[:-1]
        return model(input_ids=self._ids(ids), use_cache=False,
                     **keep_last(self.base, len(tokens))).logits[0, -len(tokens):]

    def _padded(self, model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """The sequence left-padded beside a companion up to COMPANION tokens longer (positions count real tokens
        only): shorter where the model's positions end sooner (a sequence reaching a learned position table's end is
        padded by what is left, none at the very end: a batch of two without padding, still another computation)."""
        ids = prompt + tokens[:-1]
        vocab = self.spec.vocab_size
        limit = max_positions(self.base.config)
        pad = COMPANION if limit is None else max(0, min(COMPANION, limit - len(ids)))
        companion = [(t * 7 + 3) % vocab for t in ids] + [(i * 11 + 1) % vocab for i in range(pad)]
        width = len(companion)
        batch = torch.tensor([[0] * pad + ids, companion], device=self.spec.device)
        mask = torch.tensor([[0] * pad + [1] * len(ids), [1] * width], device=self.spec.device)
        logits = model(input_ids=batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       use_cache=False, **keep_last(self.base, len(tokens))).logits
        return logits[0, -len(tokens):]  # from pad + len(prompt) - 1 on


class _Switched:
    """`model` called with another attention implementation (`kernel`), switched back to `home` after each call: two
    equivalent computations over one copy of the weights."""

    def __init__(self, model: Any, kernel: str, home: str):
        self.model, self.kernel, self.home = model, kernel, home
        self.config = model.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.model.set_attn_implementation(self.kernel)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.set_attn_implementation(self.home)


def kv_round(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """`x` as a KV cache storing `kv_dtype` holds it (Declaration.kv_cache_dtype; the module docstring), back in
    x.dtype."""
    if kv_dtype in ("float16", "bfloat16"):
        return x.to(getattr(torch, kv_dtype)).to(x.dtype)
    if kv_dtype.startswith("float8"):  # scale 1, saturating at the format's largest value (vLLM's default): the
        top = torch.finfo(getattr(torch, kv_dtype)).max  # coarsest a correct fp8 cache rounds (a finer scale keeps
        return x.float().clamp(-top, top).to(getattr(torch, kv_dtype)).to(x.dtype)  # small values out of subnormals)
    levels = 2 ** (int(kv_dtype.removeprefix("int")) - 1) - 1
    size = x.shape[-1]
    group = next(g for g in range(min(KV_GROUP, size), 0, -1) if size % g == 0)
    groups = x.double().reshape(*x.shape[:-1], size // group, group)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
    return ((groups / scale).round().clamp(-levels, levels) * scale).reshape(x.shape).to(x.dtype)


def matmul_round(x: torch.Tensor, inputs: str) -> torch.Tensor:
    """`x` as a matmul quantising its inputs to `inputs` (Declaration.matmul_inputs) multiplies it, back in x.dtype:
    int8 in symmetric blocks of KV_GROUP along the last (reduced) dimension, q = round(x / d) with d = absmax / 127,
    then q times d rounded to float16 (ggml's quantize_row_q8_0 and q8_1, which store d as a half)."""
    if inputs != "int8":
        raise ValueError(f"matmul inputs {inputs!r}: only 'int8' is simulated")
    size = x.shape[-1]
    group = next(g for g in range(min(KV_GROUP, size), 0, -1) if size % g == 0)
    blocks = x.float().reshape(*x.shape[:-1], size // group, group)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / scale.clamp(min=torch.finfo(torch.float32).tiny), 0).round()
    return (q * scale.half().float()).reshape(x.shape).to(x.dtype)


class KVComputation:
    """The one computation of an engine computing lower as it declares (`Lowered`: Declaration.kv_cache_dtype,
    matmul_inputs): transformers eager in spec.dtype, every K and V rounded (`kv_round`) as it enters the cache, and
    every linear layer's input rounded (`matmul_round`) as it enters the matmul; `along` as `Computations.along`,
    [1, steps, vocab]."""

    def __init__(self, spec: ModelSpec, lowered: Lowered | str):
        from transformers import DynamicCache

        lowered = Lowered(lowered) if isinstance(lowered, str) else lowered
        kv_dtype, inputs = lowered.kv, lowered.matmul_inputs
        self.spec, self.kv_dtype, self.matmul_inputs = spec, kv_dtype, inputs
        self.names = (f"eager, {lowered}",)
        self.model = load_lm(spec, attn_implementation="eager")  # shared in the process: hooked per call only

        class Rounded(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                return super().update(kv_round(key_states, kv_dtype), kv_round(value_states, kv_dtype), layer_idx,
                                      *args, **kwargs)

        self._cache = Rounded if kv_dtype is not None else DynamicCache

    @functools.cached_property
    def routed(self) -> bool:
        """Whether the model routes tokens to experts (oracles/routing.py): `along` can be `pinned`, and the routers'
        noise of this computation is measured (`__call__`)."""
        return bool(routing.blocks(self.model))

    def __call__(self, input_ids: torch.Tensor, **_: Any) -> Any:
        """One forward over `input_ids` computing lower as declared (a fresh rounded cache: attention reads K and V as
        stored; linear inputs rounded): the model's output, for routing.calibrate's forwards (`_forward`)."""
        from pytest_kvcompile.models.checkpoints import dynamic_cache

        with self._inputs_rounded():
            return self.model(input_ids=input_ids, **with_cache(dynamic_cache(self.model.config, self._cache)),
                              use_cache=True)

    @torch.inference_mode()
    def along(self, prompt: Sequence[int], tokens: Sequence[int], pinned: bool = False) -> torch.Tensor:
        """As `Computations.along`; `pinned` (a mixture-of-experts model): every token routed as the truth routes (in
        a 16-bit run the float64 truth, else the model in the run's dtype computing nothing lower)."""
        from pytest_kvcompile.models.checkpoints import dynamic_cache

        tokens = [int(t) for t in tokens]
        if not tokens:
            return torch.empty(1, 0, self.spec.vocab_size, dtype=torch.float64)
        cache, ids = dynamic_cache(self.model.config, self._cache), [int(t) for t in prompt]
        rows, fed = [], 0
        with contextlib.ExitStack() as stack:
            if pinned and self.routed:
                truth = Widened(self.model) if self.spec.dtype in (torch.float16, torch.bfloat16) else self.model
                stack.enter_context(routing.Pinned(self.model, routing.truth_routing(truth, ids + tokens[:-1],
                                                                                     self.spec.device)))
            stack.enter_context(self._inputs_rounded())
            for token in [None, *tokens[:-1]]:
                step = ids if token is None else [token]
                rows.append(self.model(input_ids=torch.tensor([step], device=self.spec.device), **with_cache(cache),
                                       use_cache=True, **positions(fed, len(step), self.spec.device)).logits[0, -1])
                fed += len(step)
        return torch.stack(rows)[None].double().cpu()

    @contextlib.contextmanager
    def _inputs_rounded(self):
        """Every linear layer's input through `matmul_round` while it runs (none without matmul_inputs)."""
        inputs = self.matmul_inputs
        hooks = [] if inputs is None else [
            m.register_forward_pre_hook(lambda _, args: (matmul_round(args[0], inputs), *args[1:]))
            for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def _chunks(prompt: list[int]) -> list[list[int]]:
    return [prompt[i:i + CHUNK] for i in range(0, len(prompt), CHUNK)]
