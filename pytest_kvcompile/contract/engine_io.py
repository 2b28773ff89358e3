"""Calling an engine: its exceptions and malformed outputs become clear test failures.

Everything the suite asks of an engine goes through here, so an engine that raises
shows *its own* traceback, and an output that breaks the contract says exactly what
was wrong and how to fix it, never a traceback from the plugin's internals.
"""

from __future__ import annotations

import numbers
import operator
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec
from pytest_kvcompile.contract.registry import EngineRef
from pytest_kvcompile.errors import (
    EngineFailed,
    Failed,
    MalformedOutput,
    NotApplicable,
    RemoteError,
    fail,
    skip,
)


def _engine_traceback(exc: BaseException) -> str:
    """The exception's traceback without the frames of this module (an isolated engine's: as its process sent it)."""
    if isinstance(exc, RemoteError):
        return exc.remote_traceback
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename != __file__]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc))


def _fail_raised(ref: EngineRef, what: str, exc: Exception, lengths: Sequence[int] = ()) -> None:
    """Fail the test naming the engine's exception; the failure carries it as data (known findings match these,
    contract/findings.py): ``raised``, the exception's type name, and ``lengths``, a generate() call's prompt
    lengths (() for other calls)."""
    __tracebackhide__ = True
    if isinstance(exc, EngineFailed):  # its message is the whole failure (a process died, a server failed)
        from pytest_kvcompile.verdicts.failures import Kind

        error = Failed(str(exc), pytrace=False)
        error.kind = Kind(getattr(exc, "kind", Kind.CRASH.value)).value
        raise error from None  # the message says it all: not the exception it replaces again
    kind = exc.remote_type if isinstance(exc, RemoteError) else type(exc).__name__
    error = Failed(f"engine '{ref.name}' raised {kind} in {what}: {exc}\n"
                   f"The engine's traceback:\n{_engine_traceback(exc)}", pytrace=False)
    error.raised, error.lengths = kind, tuple(lengths)
    raise error


def build(ref: EngineRef, spec: ModelSpec, compile_backend: str) -> Any:
    """Construct the engine for `spec`, or fail the test with the engine's traceback."""
    __tracebackhide__ = True
    try:
        engine = ref.build(spec, compile_backend)
    except ModelNotSupported as exc:
        raise NotApplicable(f"engine '{ref.name}' does not support model '{spec.name}': {exc}") from None
    except Exception as exc:
        _fail_raised(ref, f"its factory {ref.target}(ModelSpec(name='{spec.name}', ...))", exc)
    if not callable(getattr(engine, "generate", None)):
        fail(
            f"engine '{ref.name}': its factory returned a {type(engine).__name__} without a generate() method; "
            "the engine contract needs generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]",
            pytrace=False,
        )
    for capability, method in (("scoring", "score"), ("kv_cache_bytes", "kv_cache_bytes")):
        if getattr(ref.declaration, capability) and not callable(getattr(engine, method, None)):
            fail(
                f"engine '{ref.name}' declares {capability}=True but has no {method}() method: "
                f"add it or drop the declaration",
                pytrace=False,
            )
    speculative, needed = ref.declaration.speculative, {}
    if speculative and speculative.drafters:
        needed["use_drafter"] = f"drafters={speculative.drafters}"
    if speculative and speculative.acceptance:
        needed["acceptance"] = "acceptance=True"
    for method, declared in needed.items():
        if not callable(getattr(engine, method, None)):
            fail(f"engine '{ref.name}' declares Speculative({declared}) but has no {method}() method: add it "
                 "or drop it from the declaration (pytest_kvcompile/contract/speculative.py)", pytrace=False)
    return engine


def use_drafter(ref: EngineRef, engine: Any, drafter: Any) -> None:
    """engine.use_drafter(drafter) (a Drafter, a draft ModelSpec, or None: its own draft), its raising a failure."""
    __tracebackhide__ = True
    try:
        engine.use_drafter(drafter)
    except Exception as exc:
        _fail_raised(ref, f"use_drafter({type(drafter).__name__})", exc)


def acceptance(ref: EngineRef, engine: Any, rows: int, k: int) -> list[list[tuple[int, int]]]:
    """engine.acceptance() after a generate() of `rows` prompts: per row its (drafted, accepted) pairs, validated."""
    __tracebackhide__ = True
    try:
        found = engine.acceptance()
    except Exception as exc:
        _fail_raised(ref, "acceptance()", exc)
    rule = (f"acceptance() must return one list per prompt of the last generate() ({rows}), each of (drafted, "
            f"accepted) int pairs per verify step with 0 <= accepted <= drafted <= k={k}")
    try:
        steps = [[(operator.index(d), operator.index(a)) for d, a in row] for row in found]
        ok = len(steps) == rows and all(0 <= a <= d <= k for row in steps for d, a in row)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        fail(f"engine '{ref.name}' returned malformed output from acceptance(): {rule}; got "
             f"{str(found)[:300]}", pytrace=False)
    return steps


def generate(ref: EngineRef, engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             vocab_size: int, outside: str | None = None) -> list[list[int]]:
    """engine.generate(prompts, max_new_tokens), validated against the contract. `outside`: why the call is outside
    the engine's declared Bounds; then its raising is a refusal, a named skip (an answer is validated as any)."""
    __tracebackhide__ = True
    lengths = [len(p) for p in prompts]
    try:
        out = engine.generate([list(p) for p in prompts], max_new_tokens)
    except Exception as exc:
        if outside:
            kind = exc.remote_type if isinstance(exc, RemoteError) else type(exc).__name__
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            skip(f"{outside}, and the engine refused it ({kind}: {first})")
        _fail_raised(ref, f"generate(<{len(prompts)} prompt(s) of lengths {lengths}>, "
                          f"max_new_tokens={max_new_tokens})", exc, lengths)
    try:
        return validate_generate(out, len(prompts), max_new_tokens, vocab_size)
    except MalformedOutput as exc:
        fail(
            f"engine '{ref.name}' returned malformed output from generate(<{len(prompts)} prompt(s) of lengths "
            f"{lengths}>, max_new_tokens={max_new_tokens}): {exc}",
            pytrace=False,
        )


def score(ref: EngineRef, engine: Any, vocab_size: int):
    """A scorer for token_match: engine.score(prompt, continuation), validated."""

    def scorer(prompt: list[int], continuation: list[int]) -> torch.Tensor:
        __tracebackhide__ = True
        try:
            logits = engine.score(list(prompt), list(continuation))
        except Exception as exc:
            _fail_raised(ref, f"score(<prompt of length {len(prompt)}>, "
                              f"<continuation of length {len(continuation)}>)", exc)
        expected = (len(continuation), vocab_size)
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != expected:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            fail(
                f"engine '{ref.name}' returned malformed output from score(): expected a tensor of shape "
                f"{expected} (one row of logits per continuation token), got {got}",
                pytrace=False,
            )
        return logits.detach().float().cpu()

    return scorer


def validate_generate(out: Any, n_prompts: int, max_new_tokens: int, vocab_size: int) -> list[list[int]]:
    """Check `out` is n_prompts lists of exactly max_new_tokens in-vocab ints; raise MalformedOutput."""
    if isinstance(out, torch.Tensor):
        raise MalformedOutput(f"got a torch.Tensor of shape {tuple(out.shape)}; return plain lists: `tokens.tolist()`")
    if not isinstance(out, (list, tuple)):
        raise MalformedOutput(f"expected a list of {n_prompts} lists of token ids, got {type(out).__name__}")
    if len(out) != n_prompts:
        raise MalformedOutput(f"expected one continuation per prompt ({n_prompts}), got {len(out)}")
    result = []
    for i, row in enumerate(out):
        if isinstance(row, torch.Tensor):
            raise MalformedOutput(f"continuation {i} is a torch.Tensor; return plain lists: `tokens.tolist()`")
        if not isinstance(row, (list, tuple)):
            raise MalformedOutput(f"continuation {i} is a {type(row).__name__}, expected a list of ints")
        if len(row) != max_new_tokens:
            raise MalformedOutput(
                f"continuation {i} has {len(row)} tokens, expected exactly max_new_tokens={max_new_tokens} "
                "(the suite never stops at EOS: generate all of them)"
            )
        for step, tok in enumerate(row):
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
                raise MalformedOutput(f"continuation {i}, step {step}: {tok!r} ({type(tok).__name__}) "
                                      f"is not an int token id")
            if not 0 <= int(tok) < vocab_size:
                raise MalformedOutput(f"continuation {i}, step {step}: token id {int(tok)} "
                                      f"is outside the vocabulary [0, {vocab_size})")
        result.append([int(t) for t in row])
    return result
