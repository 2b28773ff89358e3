"""The one adapter between pytest-kvcompile (and `reference_impls`) and the private APIs of torch and transformers.

Rule: every name with a leading underscore in a torch or transformers path is used here and nowhere else
(tests/test_private_apis.py enforces it), and is listed in `PRIVATE_APIS` (transformers':
`TRANSFORMERS_PRIVATE_APIS`; CUDA builds': `CUDA_PRIVATE_APIS`), which `check_private_apis()` resolves when a
recording starts. When an upgrade moves anything used here, fail loudly with `DynamoHooksBroken` naming what
moved; never report zero compiles because a hook went quiet. Everything version-specific (private names, config
fields, log text formats) lives in this module.

Private torch APIs used, and why (checked against torch 2.13):

- logger ``torch.__trace`` (``torch._logging._internal.trace_log``, torch's structured
  trace behind TORCH_TRACE/tlparse). While any handler is attached, torch emits, for every
  dynamo frame compilation whatever the backend, a ``compilation_metrics`` record (compile
  id, frame, recompile reason, failure), preceded by ``recompile_reasons`` (the failed guard
  of every cache entry) and ``dynamo_graph_break_reason`` artifacts. A handler there sees
  every compile as it happens: unbounded, and unaffected by ``torch._dynamo.reset()``.
- ``torch._dynamo.utils.get_compilation_metrics()``: the same records in a bounded deque
  (64), holding only the *first* guard failure. Used to cross-check the tap (torch recorded
  more frame compilations than the tap saw: the tap is broken) and to name a frame whose
  limit-hit record carries no name.
- ``torch._dynamo.config.recompile_limit`` / ``accumulated_recompile_limit`` (old aliases
  ``cache_size_limit`` / ``accumulated_cache_size_limit``): the limits, for messages.
- ``torch._dynamo.reset()``: forget compiled code and per-frame cache entries.
- ``torch._C._dynamo.eval_frame.set_guard_complete_hook(hook)``: dynamo calls ``hook(hit)`` each time a
  frame that has compiled code is entered, after evaluating its guards: ``True`` = a cache entry matched
  and compiled code runs; ``False`` = none matched, so dynamo recompiles (a compile record follows) or,
  past the recompile limit or under ``torch.compiler.set_stance("eager_on_recompile")``, runs the frame
  eagerly (no compile record follows). This is how "did compiled code run?" is observed, not declared.
  One hook slot: the tap chains to the hook it found and restores it.

- ``torch.export._trace._export`` (patched): every ``torch.export.export`` call goes through it, strict or not.
  A non-strict export traces without dynamo's frame evaluation, so no compile record says it happened; the
  tap records each outermost export as a compile event (frame ``torch.export of <module> called from <site>``),
  so an engine that re-exports for an unseen shape (the export world's recompile) is seen like one that recompiles.
- ``torch.cuda.graphs.CUDAGraph.capture_begin`` (public class, patched): every CUDA graph capture goes through
  it, an engine's own ``torch.cuda.graph(...)`` and inductor's cudagraph trees (``mode="reduce-overhead"``)
  alike. A capture after warmup is a re-capture (a new graph for an unseen shape), which dynamo never
  reports: the tap counts captures, with the engine code that asked for one.
- ``torch._dynamo.eval_frame._stance.stance``: the stance ``torch.compiler.set_stance`` set (`forced_eager`).
- ``torch._inductor.compile_fx``: imported early with one warning ignored (`import_inductor_quietly`); not
  resolved when a recording starts (importing inductor costs seconds), so listed in `IMPORTED_ON_USE`.
- ``torch._C._cuda_clearCublasWorkspaces`` (CUDA builds only): free cuBLAS workspaces before reading allocated
  memory, as torch's own CUDA leak check does (`clear_cublas_workspaces`).
- For `reference_impls`' compiled code: ``torch._check`` (state a size fact dynamo cannot prove; exported as
  `torch_check`, the function itself, which dynamo knows by identity) and
  ``torch._dynamo.decorators.mark_unbacked`` (a dynamic dim with no 0/1 specialisation; not in ``torch._dynamo``
  in torch 2.13).

Private transformers API used (checked against transformers 5.23):

- ``CompileConfig._compile_all_devices``: off CUDA, ``generate()`` compiles only with it set
  (`compile_on_every_device`).

Not used: the ``torch._dynamo.guards.__recompiles`` logger only fires when TORCH_LOGS
enables it (torch checks its own log state, not the logger's level), so a handler alone
there silently sees nothing; ``config.error_on_recompile`` raises at the first recompile
instead of recording it; ``fail_on_recompile_limit_hit`` is not needed: a limit hit is
recorded (``limit_hit``) and the recorder fails on it.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
import threading
import warnings
from typing import Any

import torch

TRACE_LOGGER = "torch.__trace"
FRAME_COMPILE = "compilation_metrics"  # trace record per frame compile (bwd/runtime ones are named apart)
RECOMPILE_REASONS = "recompile_reasons"
GRAPH_BREAK = "dynamo_graph_break_reason"
GUARDS = "guard_complete"  # our own record: one per guard evaluation of a frame with compiled code
CAPTURE = "cuda_graph_capture"  # our own record: one per CUDA graph capture (capture_begin)
EXPORT = "torch_export"  # our own record: one per outermost torch.export call (_trace._export)

#: Every private torch name this module resolves; `check_private_apis()` tries them all.
PRIVATE_APIS = (
    "torch._logging._internal.trace_log",
    "torch._dynamo.utils.get_compilation_metrics",
    "torch._dynamo.config.recompile_limit",
    "torch._dynamo.config.accumulated_recompile_limit",
    "torch._dynamo.reset",
    "torch._C._dynamo.eval_frame.set_guard_complete_hook",
    "torch.cuda.graphs.CUDAGraph",
    "torch.export._trace._export",
    "torch._dynamo.eval_frame._stance.stance",
    "torch._check",
    "torch._dynamo.decorators.mark_unbacked",
)
#: On CUDA builds only (`check_private_apis()` tries them there).
CUDA_PRIVATE_APIS = ("torch._C._cuda_clearCublasWorkspaces",)
#: transformers' private names used here; `check_private_apis()` tries them once transformers is imported.
TRANSFORMERS_PRIVATE_APIS = ("transformers.generation.configuration_utils.CompileConfig._compile_all_devices",
                             "transformers.configuration_utils.PretrainedConfig._attn_implementation")
#: Imported where used, not at each start (too slow); a missing one raises `DynamoHooksBroken` there.
IMPORTED_ON_USE = ("torch._inductor.compile_fx",)
_METRICS_FIELDS = ("compile_id", "co_name", "co_filename", "co_firstlineno", "recompile_reason", "fail_type",
                   "fail_reason")


class DynamoHooksBroken(RuntimeError):
    """torch (or transformers) no longer provides an internal this plugin reads: what it reads can't be trusted."""


def _broken(what: str, library: str = "torch") -> DynamoHooksBroken:
    version = getattr(sys.modules.get(library), "__version__", "(version unknown)")
    return DynamoHooksBroken(
        f"{what} ({library} {version}): pytest_kvcompile/recompiles/hooks.py must be updated for "
        f"this {library}; until then nothing read through it (compile counts included) can be trusted"
    )


def resolve(path: str) -> Any:
    """The object at a dotted path (a module's attribute, or a class's in a module); `DynamoHooksBroken` if it
    is gone."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module first
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                found = getattr(found, name)
        except AttributeError as exc:
            raise _broken(f"{path} is missing", parts[0]) from exc
        return found
    raise _broken(f"{path} is missing", parts[0])


def check_private_apis() -> None:
    """Resolve every private name this module uses, so a torch (or transformers) upgrade fails here first."""
    for path in PRIVATE_APIS:
        resolve(path)
    for path in CUDA_PRIVATE_APIS if torch.version.cuda else ():
        resolve(path)
    # Importing transformers costs seconds: only once imported, and only on the releases the compiled HF engines
    # support (5 on; 4.x releases run the released-bug rows, eager, and 4.48 has CompileConfig without the flag).
    transformers = sys.modules.get("transformers")
    major = int(str(getattr(transformers, "__version__", "0")).split(".")[0] or 0)
    for path in TRANSFORMERS_PRIVATE_APIS if transformers is not None and major >= 5 else ():
        resolve(path)
    if resolve("torch._logging._internal.trace_log") is not logging.getLogger(TRACE_LOGGER):
        raise _broken(f"torch's structured trace no longer logs to {TRACE_LOGGER!r}")


#: ``torch._check`` itself, for compiled code (dynamo knows it by identity; a wrapper would be traced instead).
torch_check = resolve("torch._check")


def limits() -> str:
    """dynamo's current recompile limits, as ``recompile_limit=8 or accumulated_recompile_limit=256``."""
    return " or ".join(f"{name}={resolve('torch._dynamo.config.' + name)}"
                     for name in ("recompile_limit", "accumulated_recompile_limit"))


def forced_eager() -> bool:
    """Whether ``torch.compiler.set_stance("force_eager")`` is in effect (torch.compile directives ignored)."""
    return resolve("torch._dynamo.eval_frame._stance.stance") == "force_eager"


def reset() -> None:
    """Forget every compiled frame, its cache entries and its recompile count."""
    resolve("torch._dynamo.reset")()


def import_inductor_quietly() -> None:
    """Import inductor with one warning of torch's own ignored: torch 2.13's inductor imports
    ``torch.utils.mkldnn``, whose classes use the deprecated ``torch.jit.script_method``, so the first compile of a
    run put a DeprecationWarning about torch's code into the user's warnings summary (issue 31). Narrow: that
    message, during this import only; torch versions without the warning import as usual."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        try:
            importlib.import_module("torch._inductor.compile_fx")
        except ImportError as exc:
            raise _broken("torch._inductor.compile_fx is missing") from exc


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-(handle, stream) workspaces, as torch's own CUDA leak check does; nothing off CUDA builds."""
    if torch.version.cuda:
        resolve("torch._C._cuda_clearCublasWorkspaces")()


def attention_kernel(model: Any) -> str | None:
    """The attention implementation transformers runs `model` with ("eager", "sdpa", ...: its config's private
    ``_attn_implementation``, which transformers itself reads to choose the kernel)."""
    return getattr(model.config, "_attn_implementation", None)


def mark_unbacked(tensor: torch.Tensor, dim: int, **kwargs: Any) -> None:
    """``torch._dynamo.decorators.mark_unbacked``: `dim` of `tensor` is dynamic, sizes 0 and 1 not specialised."""
    resolve("torch._dynamo.decorators.mark_unbacked")(tensor, dim, **kwargs)


def compile_on_every_device(compile_config: Any) -> Any:
    """Set transformers' private ``CompileConfig._compile_all_devices`` on `compile_config` (off CUDA,
    ``generate()`` compiles only with it) and return it."""
    resolve("transformers.generation.configuration_utils.CompileConfig._compile_all_devices")  # renamed: set in vain
    compile_config._compile_all_devices = True
    return compile_config


def _frame_metrics() -> list[Any]:
    """torch's own (bounded) list of frame compilations, oldest first."""
    metrics = resolve("torch._dynamo.utils.get_compilation_metrics")()
    return [m for m in metrics if getattr(m, "is_forward", None) is not False and not getattr(m, "is_runtime", False)]


_CAPTURING: list[CompileTap] = []  # taps started and not stopped, oldest first
_CAPTURE_BEGIN: Any = None  # CUDAGraph.capture_begin as torch defines it, while patched


def _capture_site(depth: int = 2) -> str:
    """Who asked for a CUDA graph capture: the innermost two frames outside torch (the engine's code), and whether
    inductor's cudagraph trees made it."""
    torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
    frame, trees, user = sys._getframe(depth), False, []
    while frame is not None and len(user) < 2:
        code = frame.f_code
        if code.co_filename.startswith(torch_dir):
            trees = trees or "cudagraph_trees" in code.co_filename
        else:
            user.append(f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    where = " called from ".join(user) or "(no frame outside torch)"
    if trees:
        return f"cudagraph trees (torch.compile mode='reduce-overhead') recording for {where}"
    return f"torch.cuda.CUDAGraph capture in {where}"


def _capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
    if _CAPTURING:
        site = _capture_site()
        for tap in _CAPTURING:
            tap._raw.append((CAPTURE, site))
    return _CAPTURE_BEGIN(graph, *args, **kwargs)


_EXPORT: Any = None  # torch.export._trace._export as torch defines it (kept once found: a wrapper may wrap ours)
_EXPORTING = threading.local()  # exports in progress in this thread: only the outermost is recorded


def _export(mod: Any, *args: Any, **kwargs: Any) -> Any:
    depth = getattr(_EXPORTING, "depth", 0)
    if _CAPTURING and not depth:
        site = _capture_site(depth=3).removeprefix("torch.cuda.CUDAGraph capture in ")
        for tap in _CAPTURING:
            tap._raw.append((EXPORT, f"torch.export of {type(mod).__name__} called from {site}"))
    _EXPORTING.depth = depth + 1
    try:
        return _EXPORT(mod, *args, **kwargs)
    finally:
        _EXPORTING.depth = depth


def _watch_exports(on: bool) -> None:
    """Patch torch.export's one entry point while any tap is watching (called after _CAPTURING changed)."""
    global _EXPORT
    trace = importlib.import_module("torch.export._trace")
    if _EXPORT is None:
        _EXPORT = trace._export
    if on and trace._export is _EXPORT:
        trace._export = _export
    elif not on and not _CAPTURING and trace._export is _export:
        trace._export = _EXPORT


def _watch_captures(tap: CompileTap, on: bool) -> None:
    """Add/remove a tap from the capture watchers; patch capture_begin while any is watching."""
    global _CAPTURE_BEGIN
    graph_class = resolve("torch.cuda.graphs.CUDAGraph")
    if on:
        if not _CAPTURING:
            _CAPTURE_BEGIN = graph_class.capture_begin
            graph_class.capture_begin = _capture_begin
        _CAPTURING.append(tap)
    elif tap in _CAPTURING:
        _CAPTURING.remove(tap)
        if not _CAPTURING and graph_class.capture_begin is _capture_begin:
            graph_class.capture_begin = _CAPTURE_BEGIN
    _watch_exports(on)


class CompileTap(logging.Handler):
    """Collects every dynamo frame compilation while attached (`start()` ... `stop()`).

    Records are kept raw and parsed on read, so a format change raises in the caller
    instead of inside logging (which would swallow it). `stop()` cross-checks against
    `get_compilation_metrics()` and raises `DynamoHooksBroken` if the tap missed compiles.
    """

    def __init__(self) -> None:
        super().__init__()
        self._raw: list[tuple[str, Any]] = []
        self._baseline: Any = None
        self._propagate = True
        self._hook_before: Any = None
        self._hooked = False

    def start(self) -> None:
        check_private_apis()
        seen = _frame_metrics()
        self._baseline = seen[-1] if seen else None
        logger = logging.getLogger(TRACE_LOGGER)
        # Trace records are for this tap only: propagated, they flood pytest's captured log (thousands of lines).
        self._propagate, logger.propagate = logger.propagate, False
        logger.addHandler(self)
        self._hooked = True
        self._hook_before = resolve("torch._C._dynamo.eval_frame.set_guard_complete_hook")(self._guard_complete)
        _watch_captures(self, True)

    def _guard_complete(self, hit: bool) -> bool:
        """dynamo's guard hook: record whether compiled code matched, pass the result on unchanged."""
        if self._hook_before is not None:
            hit = self._hook_before(hit)
        if self._hooked:
            self._raw.append((GUARDS, bool(hit)))
        return hit

    def stop(self) -> None:
        logger = logging.getLogger(TRACE_LOGGER)
        logger.removeHandler(self)
        logger.propagate = self._propagate
        self._hooked = False  # a tap started later and still running keeps chaining through us, inertly
        _watch_captures(self, False)
        set_hook = resolve("torch._C._dynamo.eval_frame.set_guard_complete_hook")
        current = set_hook(self._hook_before)
        if current is not None and current != self._guard_complete:  # not ours on top: put it back
            set_hook(current)
        metrics = _frame_metrics()
        ids = [id(m) for m in metrics]
        new = metrics[ids.index(id(self._baseline)) + 1:] if id(self._baseline) in ids else metrics
        if len(new) > self.frame_compiles():
            raise _broken(
                f"torch recorded {len(new)} frame compilation(s) (torch._dynamo.utils.get_compilation_metrics) "
                f"but the {TRACE_LOGGER!r} tap saw {self.frame_compiles()}: the structured trace format changed"
            )

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None) or {}
        if FRAME_COMPILE in metadata:  # limits read now: a config.patch around the call may end before parsing
            self._raw.append((FRAME_COMPILE, (metadata[FRAME_COMPILE], limits())))
        elif (metadata.get("artifact") or {}).get("name") in (RECOMPILE_REASONS, GRAPH_BREAK):
            self._raw.append((metadata["artifact"]["name"], getattr(record, "payload", None)))

    def count(self) -> int:
        """Compile events seen so far (frame compilations and exports: one per `compiles()` entry)."""
        return sum(kind in (FRAME_COMPILE, EXPORT) for kind, _ in self._raw)

    def frame_compiles(self) -> int:
        """Dynamo frame compilations seen so far (what torch's own metrics count)."""
        return sum(kind == FRAME_COMPILE for kind, _ in self._raw)

    def captures(self) -> list[str]:
        """One line per CUDA graph capture seen so far: who asked for it (`_capture_site`)."""
        return [data for kind, data in self._raw if kind == CAPTURE]

    def guards(self) -> tuple[int, int]:
        """(hits, eager misses): guard evaluations where compiled code matched and ran, and misses that no
        compile followed (the frame ran eagerly: recompile limit, ``eager_on_recompile`` stance, ...)."""
        hits = misses = 0
        pending = False  # a miss waiting to see whether a compile follows
        for kind, data in self._raw:
            if kind == GUARDS:
                misses += pending
                pending = not data
                hits += bool(data)
            elif kind == FRAME_COMPILE:
                pending = False
        return hits, misses + pending

    def compiles(self) -> list[dict[str, Any]]:
        """One dict per frame compilation, in order, with the `CompileEvent` fields.

        A compile's guard failures and graph breaks are the artifacts torch logged since the
        previous compile record (torch logs them just before the record of the compile they
        belong to; frames compile one at a time).
        """
        out: list[dict[str, Any]] = []
        reasons: list[str] = []
        breaks: list[str] = []
        for kind, data in self._raw:
            if kind in (GUARDS, CAPTURE):
                continue
            if kind == RECOMPILE_REASONS:
                reasons = _reasons(data)
            elif kind == GRAPH_BREAK:
                breaks.append(_graph_break(data))
            elif kind == EXPORT:
                exports = sum(e["compile_id"].startswith("export/") for e in out)
                out.append({"frame": data, "compile_id": f"export/{exports}", "is_recompile": False})
            else:
                out.append(_frame_compile(*data, reasons, breaks, out))
                reasons, breaks = [], []
        return out


def _reasons(payload: Any) -> list[str]:
    """The ``recompile_reasons`` payload: one reason, or a JSON list of them (one per cache entry)."""
    if not isinstance(payload, str):
        raise _broken(f"{RECOMPILE_REASONS} payload is a {type(payload).__name__}, not text")
    return json.loads(payload) if payload.startswith("[") else [payload]


_COMPILE_ID_PREFIX = re.compile(r"^\S*\d+/\d+: ")
_USER_STACK = "\nUser stack trace:\n"


def _split_reason(reason: str) -> tuple[str, str]:
    """``"0/0: <guard>\\nUser stack trace:\\n<stack>"`` -> (guard text, stack)."""
    guard, _, stack = reason.partition(_USER_STACK)
    return _COMPILE_ID_PREFIX.sub("", guard, count=1).rstrip(), stack.rstrip()


def _graph_break(payload: Any) -> str:
    """``"<where>: <reason and hints>"`` from a graph-break artifact, tracebacks dropped."""
    if not isinstance(payload, str):
        raise _broken(f"{GRAPH_BREAK} payload is a {type(payload).__name__}, not text")
    text = payload.split("\n\nUser code traceback:", 1)[0].split("\nTraceback (most recent call last):", 1)[0]
    where, sep, reason = text.partition("\nGraph Break Reason: ")
    if not sep:
        return text.strip()
    reason = re.sub(r"^Encountered graph break when attempting to trace [^\n]*\n+", "", reason)
    reason = reason.split("\n\n  Developer debug context:", 1)[0]
    return f"{where.removeprefix('Graph break in user code at ')}: {reason.strip()}"


def _limit_hit(metrics: dict[str, Any], limits_then: str) -> str | None:
    """Which recompile limit a failed compile hit (all of them if torch doesn't say), or None."""
    fail = metrics["fail_reason"] or ""
    if metrics["fail_type"] != "FailOnRecompileLimitHit" and "recompile limit exceeded" not in fail:
        return None
    found = re.search(r"exceeding the (\w+) cache size limit \(currently set to (\d+)\)", fail)
    return f"{found[1]}={found[2]}" if found else limits_then


def _failure(metrics: dict[str, Any]) -> str | None:
    """``"<fail type>: <first line of the reason>"`` of a compile that failed (dynamo ran the frame eagerly, or
    the error reached the engine, which may have swallowed it), else None."""
    if not metrics["fail_type"]:
        return None
    reason = (metrics["fail_reason"] or "").strip().splitlines()
    return f"{metrics['fail_type']}: {reason[0] if reason else '(no reason given)'}"


def _frame_name(compile_id: str, earlier: list[dict[str, Any]]) -> str:
    """``name (file:line)`` of a compile whose record has no frame (a limit hit)."""
    frame_id = compile_id.split("/")[0] + "/"
    for item in reversed(earlier):
        if item["compile_id"].startswith(frame_id):
            return item["frame"]
    for m in reversed(_frame_metrics()):
        if str(m.compile_id).startswith(frame_id) and m.co_name:
            return f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})"
    return f"frame {compile_id} (torch did not report its name)"


def _frame_compile(
    metrics: Any, limits_then: str, reasons: list[str], breaks: list[str], earlier: list[dict[str, Any]],
) -> dict[str, Any]:
    if not isinstance(metrics, dict) or not all(key in metrics for key in _METRICS_FIELDS):
        raise _broken(f"{FRAME_COMPILE} trace record lacks some of {', '.join(_METRICS_FIELDS)}")
    compile_id = str(metrics["compile_id"]) if metrics["compile_id"] is not None else "(no id)"
    if not reasons and metrics["recompile_reason"]:
        reasons = [metrics["recompile_reason"]]  # no artifact: torch's first reason only
    split = [_split_reason(r) for r in reasons]
    limit_hit = _limit_hit(metrics, limits_then)
    name = metrics["co_name"]
    if name:
        frame = f"{name} ({metrics['co_filename']}:{metrics['co_firstlineno']})"
    elif metrics["compile_id"] is None:  # torch records neither for torch._dynamo.aot_compile (vLLM uses it)
        frame = "an AOT-compiled function (torch._dynamo.aot_compile; torch records no frame name)"
    else:
        frame = _frame_name(compile_id, earlier)
    return {
        "frame": frame,
        "compile_id": compile_id,
        "is_recompile": metrics["recompile_reason"] is not None,
        "guard_failures": tuple(guard for guard, _ in split),
        "graph_breaks": tuple(breaks),
        "user_stack": next((stack for _, stack in split if stack), ""),
        "limit_hit": limit_hit,
        "failed": _failure(metrics) if not limit_hit else None,
    }
