"""Record dynamo compilations and fail on the ones after warmup ("zero recompiles after warmup").

Rule: after warmup, a compiled engine compiles nothing. Every dynamo frame compilation
counts, recompiles and first compiles alike (a frame first compiled after warmup is a code
path warmup missed), on any backend (inductor adds stride recompiles the eager backend
never makes). Hitting dynamo's recompile limit always fails: past it dynamo silently runs
that frame in eager. CUDA graph captures count too: a capture after warmup (an engine's own
``torch.cuda.graph`` or inductor's cudagraph trees) is a re-capture for an unseen shape, which
dynamo does not report as a recompile.

    with expect_no_recompiles(warmup=True) as rec:
        engine.generate(prompts, 2)          # warmup: compiles are expected here
        rec.mark_warmup_done()
        engine.generate(prompts, 32)         # must not compile

All private torch access goes through `dynamo_hooks`.
"""

from __future__ import annotations

import re
import textwrap
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from pytest_kvcompile.recompiles import hooks as dynamo_hooks
from pytest_kvcompile.recompiles.hooks import DynamoHooksBroken
from pytest_kvcompile.verdicts.failures import Kind

__all__ = [
    "CompileEvent", "CompileRecorder", "DynamoHooksBroken", "RecompileError", "expect_no_recompiles", "explain",
    "hints", "reset_dynamo", "verdict",
]


class RecompileError(AssertionError):
    """Dynamo compiled after warmup (or hit its recompile limit) where that was not allowed."""

    kind = Kind.RECOMPILE


@dataclass(frozen=True)
class CompileEvent:
    """One dynamo frame compilation."""

    frame: str  # "function_name (file.py:123)"
    compile_id: str  # "<frame>/<nth compile of it>", e.g. "0/1"
    is_recompile: bool  # the frame already had compiled code whose guards failed
    guard_failures: tuple[str, ...] = ()  # verbatim, one per cache entry, newest (the one hints read) first
    graph_breaks: tuple[str, ...] = ()  # "<file:line>: <reason>" of breaks hit while compiling this frame
    user_stack: str = ""  # where user code used the guarded value, when torch says
    limit_hit: str | None = None  # e.g. "recompile_limit=8": dynamo gave up on this frame
    failed: str | None = None  # "<fail type>: <reason>": the compile raised (the frame ran eagerly, if at all)

    def describe(self) -> str:
        kind = "recompile" if self.is_recompile else "first compile"
        lines = [f"{kind} {self.compile_id} of {self.frame}"]
        if self.limit_hit:
            lines.append(f"  hit {self.limit_hit}: "
                         f"dynamo stopped compiling this frame and runs it in eager from now on")
        if self.failed:
            lines.append(f"  compile FAILED: {self.failed}")
        lines += [f"  guard failed: {re.sub(' {3,}', '  ', guard)}" for guard in self.guard_failures]
        if self.user_stack:
            lines += ["  guarded value used at:", textwrap.indent(self.user_stack.strip("\n"), "    ")]
        lines += ["  graph break at " + textwrap.indent(gb, "    ").lstrip() for gb in self.graph_breaks]
        return "\n".join(lines)


class CompileRecorder:
    """Context manager recording every dynamo frame compilation in this process, any backend.

    `mark_warmup_done()` splits `events` into `warmup_events` and `post_warmup_events`
    (never called: everything is post-warmup; called again: the last call wins). Events stay
    readable after exit. Exit raises `DynamoHooksBroken` if torch's hooks went quiet.
    """

    def __init__(self) -> None:
        self._tap: dynamo_hooks.CompileTap | None = None
        self._warmup_count: int | None = None
        self._warmup_captures = 0

    def __enter__(self) -> CompileRecorder:
        if self._tap is not None:
            raise RuntimeError("a CompileRecorder records once; create a new one")
        self._tap = dynamo_hooks.CompileTap()
        self._tap.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._started().stop()

    def _started(self) -> dynamo_hooks.CompileTap:
        if self._tap is None:
            raise RuntimeError(
                "this CompileRecorder is not recording: enter it (`with CompileRecorder() as rec:`); the "
                "kv_compile_recorder fixture records the test call only, not fixture setup"
            )
        return self._tap

    def mark_warmup_done(self) -> None:
        """Compiles from here on are post-warmup."""
        self._warmup_count = self._started().count()
        self._warmup_captures = len(self._started().captures())

    @property
    def warmup_done(self) -> bool:
        return self._warmup_count is not None

    @property
    def events(self) -> list[CompileEvent]:
        return [CompileEvent(**fields) for fields in self._started().compiles()]

    @property
    def warmup_events(self) -> list[CompileEvent]:
        return self.events[: self._warmup_count or 0]

    @property
    def post_warmup_events(self) -> list[CompileEvent]:
        return self.events[self._warmup_count or 0 :]

    @property
    def captures(self) -> list[str]:
        """Every CUDA graph capture while recording, in order: who asked for it (dynamo_hooks._capture_site)."""
        return self._started().captures()

    @property
    def post_warmup_captures(self) -> list[str]:
        return self.captures[self._warmup_captures if self.warmup_done else 0:]

    @property
    def guards(self) -> tuple[int, int]:
        """(hits, eager runs) while recording: guard evaluations where compiled code matched and ran, and
        guard failures no compile followed (the frame ran eagerly; see dynamo_hooks.CompileTap.guards)."""
        return self._started().guards()

    @property
    def graph_breaks(self) -> list[str]:
        """Every graph break seen while recording (warmup included), in order."""
        return [gb for event in self.events for gb in event.graph_breaks]


def reset_dynamo() -> None:
    """Start the next engine from a clean dynamo (``torch._dynamo.reset()``); not to be confused with
    ``--kv-isolate``, which runs an engine in a process of its own.

    Compiled code and recompile counts are kept per code object, and every transformers
    model's forward runs through one shared wrapper function, so compiling several models
    in one process adds up against ``torch._dynamo.config.recompile_limit`` on that one
    frame; past it dynamo silently runs eager. Call this between engines; the
    ``no_recompile(warmup=True)`` marker calls it before the test. Cost: everything compiled
    earlier recompiles on next use, and dynamo's compile callbacks are cleared.
    """
    dynamo_hooks.reset()


def __getattr__(name: str) -> object:
    if name == "isolate":  # renamed in issue 27: "isolate" is the engine's own process (--kv-isolate)
        warnings.warn("pytest_kvcompile.recompiles.recorder.isolate() is deprecated: call reset_dynamo()",
                      DeprecationWarning, stacklevel=2)
        return reset_dynamo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SIZE_MISMATCH = re.compile(r"tensor '(.+?)' size mismatch at index (\d+)\. expected (\d+), actual (\d+)")
# both constants of "2 <= x.size()[0] <= 8"
_SIZE_BOUND = re.compile(r"size\(\)\[\d+\]\s*[<>=!]=?\s*(\d+)|(\d+)\s*[<>]=?\s*(?=\S*size\(\)\[\d+\])")
_PYTHON_VALUE = re.compile(r"^\S+ == -?\d+\b|___check_obj_id")


def hints(event: CompileEvent, *, after_warmup: bool = True) -> list[str]:
    """What to try for this compile, from the failed guards' text (most likely cause first)."""
    found: list[str] = []
    if event.limit_hit:
        found.append(
            f"dynamo hit {event.limit_hit} on {event.frame} and now runs it in eager: fix the recompiles "
            "listed; if many models share this frame (transformers' forward wrapper), call "
            "pytest_kvcompile.recompiles.recorder.reset_dynamo() between engines. Raising the limit only hides it."
        )
    if after_warmup and not event.is_recompile:
        found.append(
            "first compile of this frame after warmup: warmup never ran this code path (decode vs prefill, "
            "a new batch size, a graph-break resume function): extend the warmup to cover it"
        )
    # Only the newest cache entry's failure: older entries (e.g. the prefill graph) rightly fail.
    guards = event.guard_failures[0] if event.guard_failures else ""
    causes: list[str] = []
    for name, dim, expected, actual in _SIZE_MISMATCH.findall(guards):
        if min(int(expected), int(actual)) <= 1:
            causes.append(
                f"size {expected} -> {actual} at dim {dim} of {name}: dynamo specialises sizes 0 and 1 even on "
                f"dynamic dims; use torch._dynamo.decorators.mark_unbacked(tensor, {dim}) or warm up with sizes >= 2"
            )
        else:
            causes.append(
                f"dim {dim} of {name} was compiled static ({expected}) and changed to {actual}: call "
                f"torch._dynamo.mark_dynamic(tensor, {dim}) (or maybe_mark_dynamic) on it before the "
                "compiled call, e.g. the sequence dim of input_ids, masks and the KV cache tensors"
            )
    bounds = [int(n) for match in _SIZE_BOUND.findall(guards) for n in match if n and int(n) > 2]  # 2: the 0/1 bound
    if bounds:
        causes.append(
            f"a size crossed a constant the code compares it with ({bounds[0]}), typically a sliding-window "
            "boundary: warm up on both sides of it, or compute the branch with tensor ops "
            "(torch.where, clamped slicing) so it does not guard"
        )
    elif "0/1 specialization" in guards:
        causes.append("dynamo specialised a size to 0/1: use torch._dynamo.decorators.mark_unbacked(tensor, dim) on it")
    if _PYTHON_VALUE.search(guards):
        causes.append(
            "guard on a Python value (int, flag or object identity) kept in the cache/engine state, e.g. a "
            "position counter or cumulative_length: keep it in a tensor (updated in place) so it is a graph "
            "input, or pass the same object each call"
        )
    if "stride mismatch" in guards:
        causes.append(
            "input strides changed (inductor guards on strides; the eager backend does not): pass the "
            "same layout each call, e.g. .contiguous() before the compiled call"
        )
    if re.search(r"(dtype|device) mismatch|___check_type_id", guards):
        causes.append("an input's dtype, device or Python type changed between calls: keep them fixed")
    if event.is_recompile and not causes:
        causes.append("run with TORCH_LOGS=recompiles_verbose to see every failing guard")
    return found + causes


def _problems(
    post: list[CompileEvent], warmup: list[CompileEvent], max_recompiles: int, allow_graph_breaks: bool,
    captures: Sequence[str] = (),
) -> list[str]:
    problems: list[str] = []
    if captures:
        problems.append(f"{len(captures)} CUDA graph capture(s) after warmup, 0 allowed")
    hit = next((event for event in warmup + post if event.limit_hit), None)
    if hit:
        problems.append(f"dynamo hit {hit.limit_hit} compiling {hit.frame} and fell back to eager")
    failed = next((event for event in warmup + post if event.failed), None)
    if failed:
        problems.append(f"a compile of {failed.frame} failed ({failed.failed})")
    if len(post) > max_recompiles:
        problems.append(f"{len(post)} dynamo compile(s) after warmup, {max_recompiles} allowed")
    breaks = sum(len(event.graph_breaks) for event in warmup + post)
    if breaks and not allow_graph_breaks:
        problems.append(f"{breaks} graph break(s), none allowed")
    return problems


def _blocks(events: Iterable[CompileEvent], start: int = 1, after_warmup: bool = True) -> list[str]:
    lines: list[str] = []
    for i, event in enumerate(events, start):
        lines += ["", f"#{i} {event.describe()}"]
        lines += [f"  HINT: {hint}" for hint in hints(event, after_warmup=after_warmup)]
    return lines


CAPTURE_HINT = ("  HINT: a graph is captured per static shape: pad batches and lengths to the buckets warmup captured "
                "(vLLM's cudagraph_capture_sizes), capture every bucket during warmup, and reuse graphs by shape; "
                "under mode='reduce-overhead' mark the varying dims dynamic or pad them")


def capture_lines(captures: Iterable[str]) -> list[str]:
    """Failure-message lines for CUDA graph captures after warmup, with what to try."""
    lines = [f"CUDA graph capture after warmup: {site}" for site in captures]
    return [*lines, CAPTURE_HINT] if lines else []


def explain(
    events: Iterable[CompileEvent], *, max_recompiles: int = 0, allow_graph_breaks: bool = False,
    warmup_events: Iterable[CompileEvent] = (), captures: Iterable[str] = (),
) -> str:
    """The failure message: a one-line summary, then each post-warmup compile (`events`) with
    its frame, guard failures and HINTs, and each CUDA graph capture after warmup; then warmup
    compiles that still fail the check (limit hits; graph breaks when not allowed)."""
    post, warm, captures = list(events), list(warmup_events), list(captures)
    summary = (_problems(post, warm, max_recompiles, allow_graph_breaks, captures)
               or [f"{len(post)} dynamo compile(s) after warmup"])
    lines = ["; ".join(summary), *_blocks(post)]
    if captures:
        lines += ["", *capture_lines(captures)]
    warm_bad = [e for e in warm if e.limit_hit or e.failed or (e.graph_breaks and not allow_graph_breaks)]
    if warm_bad:
        lines += ["", "during warmup:", *_blocks(warm_bad, len(post) + 1, after_warmup=False)[1:]]
    return "\n".join(lines)


def verdict(
    recorder: CompileRecorder, *, max_recompiles: int = 0, allow_graph_breaks: bool = False, warmup: bool = False,
) -> str | None:
    """The failure message for this recording under these rules, or None if it passes."""
    if warmup and not recorder.warmup_done:
        return ("warmup=True but mark_warmup_done() was never called, so every compile counted as warmup and "
                "nothing was checked: call mark_warmup_done() where warmup ends")
    if not warmup and recorder.warmup_done:
        return ("mark_warmup_done() was called but warmup=False counts every compile: pass warmup=True to "
                "declare the warmup phase")
    post, warm, captures = recorder.post_warmup_events, recorder.warmup_events, recorder.post_warmup_captures
    if not _problems(post, warm, max_recompiles, allow_graph_breaks, captures):
        return None
    return explain(post, max_recompiles=max_recompiles, allow_graph_breaks=allow_graph_breaks, warmup_events=warm,
                   captures=captures)


def _validate(max_recompiles: object, flags: dict[str, object]) -> None:
    if type(max_recompiles) is not int or max_recompiles < 0:
        raise ValueError(f"max_recompiles must be an int >= 0, got {max_recompiles!r}")
    for name, value in flags.items():
        if type(value) is not bool:
            raise ValueError(f"{name} must be True or False, got {value!r}")


@contextmanager
def expect_no_recompiles(
    *, max_recompiles: int = 0, allow_graph_breaks: bool = False, warmup: bool = False,
) -> Iterator[CompileRecorder]:
    """Record the block; on a clean exit raise `RecompileError` (with `explain`'s message) if more
    than `max_recompiles` compiles happened after warmup, a CUDA graph was captured after warmup, a compile failed
    or hit a recompile limit, or (unless `allow_graph_breaks`) any graph break was seen. `warmup=True`: the block calls
    ``rec.mark_warmup_done()``; otherwise every compile in the block counts."""
    _validate(max_recompiles, {"allow_graph_breaks": allow_graph_breaks, "warmup": warmup})
    with CompileRecorder() as recorder:
        yield recorder
    message = verdict(recorder, max_recompiles=max_recompiles, allow_graph_breaks=allow_graph_breaks, warmup=warmup)
    if message:
        raise RecompileError(message)
