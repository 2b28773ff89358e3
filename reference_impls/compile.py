"""How the reference engines compile: a private torch.compile per engine, unbacked dynamic sizes, left padding.

Why unbacked sizes and private compiles, and what that buys (two compiles per engine, then none):
reference_impls/compiled_dynamic.py's docstring.
"""

from __future__ import annotations

import types

import torch

from pytest_kvcompile.recompiles.hooks import mark_unbacked
from reference_impls.model import State


def compile_fresh(fn, backend: str, *, writes_buffers: bool = False):
    """torch.compile a private copy of `fn`.

    Dynamo keeps compiled code (and its recompile limit) per code object. A fresh code object
    per engine gives each engine its own cache: exactly its own compiles, never a
    "recompile" because another engine served a different model, dtype or backend first.

    `writes_buffers`: `fn` writes a cache preallocated outside it in place (the static and paged engines). Inductor
    then runs without reusing its intermediate buffers: with reuse (torch 2.13, CPU) the static engine's prefill
    graph on deepseek-v3 left its first latent layer's cache slots holding another intermediate's values while the
    prefill's own logits were right, so every decode step went wrong (docs/findings.md, 2026-12-07).
    """
    code = fn.__code__.replace()  # an equal but distinct code object
    fn = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    options = None
    if backend == "inductor":
        options = {"triton.cudagraphs": False}  # shapes change every step
        if writes_buffers:
            options["allow_buffer_reuse"] = False
    return torch.compile(fn, backend=backend, fullgraph=True, options=options)


def mark_dynamic(tokens, valid, cache=None):
    """Batch, prompt and cache lengths vary: unbacked, so sizes 0/1 are not specialised either."""
    mark_unbacked(tokens, 0)
    mark_unbacked(valid, 0)
    mark_unbacked(valid, 1)
    if cache is None:
        mark_unbacked(tokens, 1)  # prefill: any prompt length; decode: one token
    for entry in cache or ():
        for x in entry:
            mark_unbacked(x, 0)
            if not isinstance(entry, State):  # a recurrent layer's state: the batch varies, its own sizes do not
                mark_unbacked(x, 1)


def fresh(x):
    """A copy of the slice x with a fresh tensor's strides (`contiguous()` keeps a one-row slice's row stride, and the
    compiled graphs guard on it)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [b, width] left-padded with 0, and valid [b, width] marking the real tokens."""
    if not all(prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(map(len, prompts))
    tokens = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
    return tokens, valid
