"""The ``torch.export`` path (ExecuTorch's sibling of ``torch.compile``) as an engine, and what the ExecuTorch
runtime engine (engines/executorch.py) shares with it.

- ``hf-export``: transformers' own export recipe, `transformers.integrations.executorch.
  TorchExportableModuleForDecoderOnlyLM` (a `StaticCache` of `MAX_CACHE_LEN` positions, batch 1, its K/V
  registered as buffers the program mutates), exported once per engine with ``torch.export.export`` and run
  with ``ExportedProgram.module()`` in a greedy loop: one prefill call (the whole prompt), then one call per
  new token. No dynamo at run time: nothing recompiles.
- ``executorch`` (engines/executorch.py, its own module because check-engine finds a recipe per module): the same
  exported program lowered by ExecuTorch and run by its runtime.

The contract point of export: the shapes are declared up front (`torch.export.Dim`), a shape outside them is
an error, never a recompile. Before any call both engines check every prompt against the shapes the program
accepts (read from the exported program itself: `ExportedShapes.of`) and raise `OutsideExportedShapes`
naming the accepted shapes and the call; the program's own guard failure (``Guard failed:
input_ids.size()[1] <= 511``) or out-of-range cache write (``index_copy_(): index 512 is out of bounds``)
names neither. Findings: docs/engines/hf-export.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from pytest_kvcompile.contract.engine import Bounds, Declaration, KVLayout, ModelNotSupported, ModelSpec
from pytest_kvcompile.memory.measure import held_bytes
from pytest_kvcompile.models.layers import states_of

MAX_CACHE_LEN = 512  # static cache positions (prompt + new tokens - 1 must fit: the suites reach 266)
#: The example prompt length torch.export traces with; the seq-len dim is exported dynamic in [1, MAX_CACHE_LEN].
EXAMPLE_LEN = 5


#: transformers' export wrapper replaces every sliding-window layer by a full-length StaticLayer
#: (TorchExportableModuleWithHybridCache: "StaticSlidingWindow have dynamic control flow") and masks by position:
#: sliding layers hold max_cache_len positions, not W. KV-sharing layers get a 0-length layer (0 bytes).
KV_LAYOUT = KVLayout("static", max_cache_len=MAX_CACHE_LEN, rows=1, windowed=False)


class OutsideExportedShapes(ValueError):
    """A call whose shapes the exported program does not accept: export fixes them, nothing recompiles."""


@dataclass(frozen=True)
class ExportedShapes:
    """What one exported decoder program accepts: ``input_ids [batch, s]`` and ``cache_position [s]`` with
    `seq_min` <= s <= `seq_max` (equal when the dim was exported static), positions < `max_cache_len`."""

    batch: int
    seq_min: int
    seq_max: int
    max_cache_len: int

    @classmethod
    def of(cls, program: torch.export.ExportedProgram) -> ExportedShapes:
        """Read the shapes from the program itself: the input_ids placeholder's (symbolic) sizes, the range
        constraint of its seq-len symbol, and the length of the first key-cache buffer."""
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        user_inputs = program.graph_signature.user_inputs
        ids = placeholders[next(name for name in user_inputs if "input_ids" in name)].meta["val"]
        batch, seq = ids.shape
        if isinstance(seq, torch.SymInt):
            ranges = program.range_constraints[seq.node.expr]
            seq_min, seq_max = int(ranges.lower), int(ranges.upper)
        else:
            seq_min = seq_max = int(seq)
        keys = [buf for name, buf in program.named_buffers() if name.startswith("key_cache")]
        return cls(int(batch), seq_min, seq_max, max(k.shape[2] for k in keys))

    def __str__(self) -> str:
        seq = f"s = {self.seq_min}" if self.seq_min == self.seq_max else f"{self.seq_min} <= s <= {self.seq_max}"
        return (f"input_ids [{self.batch}, s] and cache_position [s] with {seq}, "
                f"cache positions 0..{self.max_cache_len - 1}"
                f" (static cache of max_cache_len={self.max_cache_len}, batch {self.batch})")

    def problem(self, prompt_len: int, fed: int) -> str | None:
        """Why a prefill of `prompt_len` tokens followed by `fed` one-token calls is outside, or None."""
        if not self.seq_min <= prompt_len <= self.seq_max:
            return (f"the prefill's input_ids [{self.batch}, {prompt_len}] is outside "
                    f"{self.seq_min} <= s <= {self.seq_max}")
        if fed and not self.seq_min <= 1 <= self.seq_max:
            return (f"a decode step's input_ids [{self.batch}, 1] is outside s = {self.seq_min} "
                    f"(seq-len dim exported static)")
        last = prompt_len + fed - 1
        if last >= self.max_cache_len:
            return (f"it writes cache positions 0..{last}, past the static cache's {self.max_cache_len} positions "
                    f"(at most {self.max_cache_len - prompt_len + 1} new tokens after a {prompt_len}-token prompt)")
        return None


def outside_error(engine: str, shapes: ExportedShapes, what: str, problem: str) -> OutsideExportedShapes:
    return OutsideExportedShapes(
        f"{engine}: {what} is outside the shapes the exported program accepts: {problem}. Accepted: {shapes}. "
        "torch.export fixes shapes at export time: a shape outside them is an error, never a recompile; "
        f"export with a larger max_cache_len ({engine} engine: MAX_CACHE_LEN in pytest_kvcompile/engines/export.py) "
        "or call with shorter prompts / fewer new tokens"
    )


def _load_model(spec: ModelSpec):
    """The checkpoint as transformers loads it, with the generation config the export wrapper reads."""
    from transformers import GenerationConfig

    from pytest_kvcompile.models.checkpoints import pretrained

    model = pretrained(spec.path, spec.dtype).to(spec.device).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


def export_program(spec: ModelSpec, max_cache_len: int = MAX_CACHE_LEN, dynamic: bool = True,
                   example_len: int = EXAMPLE_LEN) -> torch.export.ExportedProgram:
    """`spec`'s model exported through `TorchExportableModuleForDecoderOnlyLM` (batch 1, static cache of
    `max_cache_len`), its seq-len dim dynamic in [1, max_cache_len] (`dynamic`) or fixed at `example_len`.

    ModelNotSupported where transformers' wrapper refuses the model (its constructor's ValueError/AssertionError:
    no cache, no generation config) or cannot hold a layer's cache (an AttributeError on a model with recurrent-state
    layers: its static cache has K/V buffers only); an export crash is not caught (a finding, not a skip)."""
    from transformers.integrations.executorch import (
        TorchExportableModuleForDecoderOnlyLM,
    )

    model = _load_model(spec)
    try:
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len,
                                                        device=torch.device(spec.device))
    except (ValueError, AssertionError) as exc:
        raise ModelNotSupported(
            f"transformers' TorchExportableModuleForDecoderOnlyLM refuses {spec.name}: {exc}") from exc
    except AttributeError as exc:
        states = states_of(spec.config)
        if not states:
            raise  # not a layer kind it lacks: a crash, reported as one
        raise ModelNotSupported(
            f"transformers' TorchExportableModuleForDecoderOnlyLM makes every layer's keys and values buffers of its "
            f"static cache and has none for a recurrent state ({type(exc).__name__}: {exc}); model '{spec.name}' "
            f"has {states}") from exc
    ids = torch.arange(1, example_len + 1, device=spec.device).unsqueeze(0)
    positions = torch.arange(example_len, device=spec.device)
    dynamic_shapes = None
    if dynamic:
        seq = torch.export.Dim("seq_len", min=1, max=max_cache_len)
        dynamic_shapes = {"input_ids": {1: seq}, "cache_position": {0: seq}}
    with torch.no_grad(), warnings.catch_warnings():
        # transformers sets its own globals inside forward (_OWN_SOURCES); dynamo reports them as side effects on
        # every export. Only when they are the only sources listed: any other side effect still warns.
        warnings.filterwarnings("ignore", category=UserWarning, message=_TRANSFORMERS_SIDE_EFFECT)
        return wrapper.export(input_ids=ids, cache_position=positions, dynamic_shapes=dynamic_shapes)


# transformers' own globals that dynamo lists as side effects of every export: its output-capturing context variable
# (5.24) and, from 5.25, the hub kernels' registry of active kernel functions (the `kernels` package it requires)
_OWN_SOURCES = (r"\"G\['__import_transformers_dot_utils_dot_output_capturing'\]\._active_collector\"",
                r"\"G\['__import_kernels_dot__internals_dot_layer_dot_layer'\]\._ACTIVE_KERNEL_FUNCS\"")
_OWN = "(?:" + "|".join(_OWN_SOURCES) + ")"
_TRANSFORMERS_SIDE_EFFECT = (r"While compiling, we found certain side effects happened in the model\.forward\. .*: "
                             rf"\[{_OWN}(?:, {_OWN})*\]$")


def _guard_failure(exc: BaseException) -> bool:
    """The exported module's own shape errors: an input guard (``AssertionError: Guard failed: ...``, or
    ``RuntimeError: Expected input at 'input_ids'.shape[1] to be <= 512, but got 600`` where executorch is imported
    too), or a cache write past the buffer."""
    text = str(exc)
    return any(sign in text for sign in ("Guard failed", "Expected input at", "index_copy_(): index"))


class HFExport:
    """`torch.export` of transformers' static-cache export wrapper, run as ``ExportedProgram.module()``."""

    NAME = "hf-export"
    kv_declaration = Declaration(
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KV_LAYOUT,
        bounds=Bounds(max_positions=MAX_CACHE_LEN),  # a call holding more is refused
        devices=("cpu",),  # CUDA not verified (no GPU here)
        dtypes=("float32", "bfloat16"),  # float16 not verified
        description=f"transformers TorchExportableModuleForDecoderOnlyLM + torch.export "
                    f"(seq-len dynamic 1..{MAX_CACHE_LEN}, "
                    f"static cache {MAX_CACHE_LEN}, batch 1), ExportedProgram.module() greedy loop",
    )

    def __init__(self, spec: ModelSpec, max_cache_len: int = MAX_CACHE_LEN, dynamic: bool = True):
        self.spec = spec
        program = export_program(spec, max_cache_len, dynamic)
        self.shapes = ExportedShapes.of(program)
        self.module = program.module()  # the program's buffers are the cache it mutates

    def _forward(self, ids: list[int], start: int, what: str) -> torch.Tensor:
        """Logits [len(ids), vocab] of one call of the exported program at cache positions start.."""
        device = self.spec.device
        try:
            logits = self.module(input_ids=torch.tensor([ids], device=device),
                                 cache_position=torch.arange(start, start + len(ids), device=device))
        except (AssertionError, IndexError, RuntimeError) as exc:
            if not _guard_failure(exc):
                raise
            problem = f"the program raised {type(exc).__name__}: {exc}"
            raise outside_error(self.NAME, self.shapes, what, problem) from exc
        return logits[0]

    def _check(self, prompts: list[list[int]], fed: int, verb: str) -> None:
        """Every prompt against the accepted shapes, before anything runs."""
        for i, prompt in enumerate(prompts):
            problem = self.shapes.problem(len(prompt), fed)
            if problem:
                what = f"{verb} (prompt {i} of {len(prompts)}: {len(prompt)} tokens, then {fed} one-token calls)"
                raise outside_error(self.NAME, self.shapes, what, problem)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        self._check(prompts, max_new_tokens - 1, f"generate(<{len(prompts)} prompt(s)>, {max_new_tokens})")
        out = []
        for prompt in prompts:
            what = f"generate() of a {len(prompt)}-token prompt, {max_new_tokens} new tokens"
            token = int(self._forward(prompt, 0, what)[-1].argmax())
            tokens = [token]
            for step in range(max_new_tokens - 1):
                token = int(self._forward([token], len(prompt) + step, what)[-1].argmax())
                tokens.append(token)
            out.append(tokens)
        return out

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits [len(continuation), vocab] through generate()'s calls: prefill `prompt`, then each
        continuation token at its position; row i predicts continuation[i]."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size)
        self._check([prompt], len(continuation) - 1, f"score(<{len(prompt)} tokens>, <{len(continuation)} tokens>)")
        what = f"score() of a {len(prompt)}-token prompt"
        rows = [self._forward(prompt, 0, what)[-1]]
        for i, token in enumerate(continuation[:-1]):
            rows.append(self._forward([token], len(prompt) + i, what)[-1])
        return torch.stack(rows).float().cpu()

    def kv_cache_bytes(self) -> int:
        """Bytes of the program's key/value cache buffers (allocated at export: max_cache_len positions on every
        layer with its own KV, sliding layers included; 0 on KV-sharing layers)."""
        return held_bytes(buf for name, buf in self.module.named_buffers()
                          if name.startswith(("key_cache_", "value_cache_")))
