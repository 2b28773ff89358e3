"""Zero recompiles after warmup, observed not declared.

Every engine runs this check: it is warmed up on prompt lengths 7 and 48 (and a batch of both if it batches) with
32-step decodes, then given calls that each change ONE dimension warmup fixed, so a compile names the one that was
new (issue 24): unseen lengths (1, 2, 3, 13, 33, 100 and the model's sliding-window lengths W-1, W, W+1, 2W+3),
a prompt past 256 positions, more decode steps than warmup took (64 on the warmup lengths), batch sizes warmup
never used (3 and 4 rows of the warmup lengths); then calls that change several at once. Every call runs under the
compile recorder (pytest_kvcompile/run/harness.py), which sees what dynamo compiled and whether compiled code
matched its guards and ran. If dynamo compiled nothing and no compiled code ran, the check has nothing to judge: it
is skipped for an engine that does not declare ``compiled``, and FAILS one that declares it. Otherwise it fails on:

- a compile after warmup (a recompile, or a first compile of a path warmup missed);
- (``test_identical_calls_compile_nothing``) a compile in a fresh engine object's second or third call identical
  to its first (same prompt, same new tokens): state the first call left (a cache initialised lazily on first
  use) was baked into its compiled graph, so every new engine or cache pays a recompile (transformers #46421
  shipped this; docs/released-bugs.md);
- a CUDA graph capture after warmup (a re-capture for an unseen batch size or length: an engine's own
  ``torch.cuda.graph`` or inductor's cudagraph trees), named with the call that caused it;
- a compile that failed, or hit dynamo's recompile limit, in any phase (building included);
- a frame that ran eagerly after its guards failed (``set_stance("eager_on_recompile")``, the recompile limit),
  or an unseen call in which no compiled code ran at all although warmup ran compiled code;
- a graph break anywhere (``--kv-allow-graph-breaks`` reports them without failing).

The build, warmup and after-warmup compile counts are reported, with a note when dynamo saw nothing compile
during generate() (an engine compiling at build time, as vLLM does: later recompiles outside dynamo are not seen).
"""

import pytest

from pytest_kvcompile.models.checkpoints import max_positions
from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.recompiles.recorder import CAPTURE_HINT, explain
from pytest_kvcompile.verdicts.failures import Kind, fail
from pytest_kvcompile.verdicts.rows import Compile, Compiles, TimelineCall

DECODE_STEPS = 32
UNSEEN_LENGTHS = (1, 2, 3, 13, 33, 100)
LONG_STEPS = 2 * DECODE_STEPS  # more decode steps than warmup took
PAST_256 = 300  # a prompt past 256 positions (where it fits with the decode steps)


def _calls(prompts: list[Prompt], batching: bool, vocab: int, limit: int | None):
    """(warmup calls, unseen calls): a warmup call is a list of prompts; an unseen call is (prompts, new tokens,
    what is new in it compared with warmup). Calls that change one dimension come first."""
    by_len = {len(p): p for p in prompts}
    short, long = by_len[7], by_len[48]
    warmup = [[short], [long]] + ([[short, long]] if batching else [])
    others = {len(p): p for p in prompts if len(p) not in (len(short), len(long)) and len(p) <= 100}
    others.update({n: of_length(n, vocab, salt=2) for n in UNSEEN_LENGTHS if n not in others})
    others = [others[n] for n in sorted(others)]
    unseen = [([p], DECODE_STEPS, f"new prompt length {len(p)}") for p in others]
    if (limit or 512) >= PAST_256 + DECODE_STEPS:
        unseen.append(([of_length(PAST_256, vocab, salt=2)], DECODE_STEPS, f"a prompt past 256 positions ({PAST_256})"))
    unseen += [([p], LONG_STEPS, f"more decode steps ({LONG_STEPS}) than warmup's {DECODE_STEPS}, on warmup length "
                                 f"{len(p)}") for p in (short, long)]
    if batching:
        unseen += [([short, long, short], DECODE_STEPS,
                    "a batch size warmup never used (3 rows of warmup lengths)"),
                   ([short, long, long, short], DECODE_STEPS,
                    "a batch size warmup never used (4 rows of warmup lengths)")]
        unseen += [(call, DECODE_STEPS, "new lengths and batch size together")
                   for call in ([others[0], others[-1]], others[1:4], [long] + others[2:5])]
    return warmup, unseen


def _reason(event) -> str:
    """One line per compile: which compile and the guard each cached entry failed (dynamo tries every entry:
    the one that explains the recompile is not always the first)."""
    failed = "; ".join(event.guard_failures)
    return event.describe().splitlines()[0] + (f": guards failed: {failed}" if failed else "")


def _timeline(build, warm_calls, after_calls) -> list[TimelineCall]:
    """The compiles of the check's calls in order, for the HTML report's compile timeline."""
    def compiles(events):
        return [Compile(e.compile_id, e.frame, e.is_recompile, [g[:300] for g in e.guard_failures[:3]],
                        len(e.graph_breaks)) for e in events]

    return ([TimelineCall("build", "the factory", compiles(build))]
            + [TimelineCall("warmup", str(c), compiles(c.compiles)) for c in warm_calls]
            + [TimelineCall("after warmup", str(c), compiles(c.compiles)) for c in after_calls])


def test_no_recompiles_after_warmup(kv_engine, kv_prompts, kv_record, kv_settings):
    declared = kv_engine.ref.declaration
    warmup, unseen = _calls(kv_prompts, declared.batching, kv_engine.spec.vocab_size,
                            max_positions(kv_engine.spec.config))
    kv_engine.reset_dynamo()  # count this engine's compiles from scratch (in its process, if isolated)
    start = len(kv_engine.history)
    for call in warmup:
        kv_engine.generate(call, DECODE_STEPS)
    warm_calls = kv_engine.history[start:]
    for call, steps, _ in unseen:
        kv_engine.generate(call, steps)
    after_calls = kv_engine.history[start + len(warm_calls):]
    new = [what for _, _, what in unseen]  # one history entry per call, in order
    build = list(kv_engine.build_compiles)
    warm = [e for c in warm_calls for e in c.compiles]
    after = [e for c in after_calls for e in c.compiles]
    everything = build + warm + after
    breaks = [gb for e in everything for gb in e.graph_breaks]
    captured = (len(kv_engine.build_captures), sum(len(c.captures) for c in warm_calls),
                sum(len(c.captures) for c in after_calls))
    at = f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}'"

    if not everything and not any(captured) and not any(c.guard_hits for c in warm_calls + after_calls):
        if declared.compiled:
            fail(Kind.RECOMPILE,
                 f"{at} declares compiled=True but no compiled code ran: dynamo compiled nothing while it was "
                 f"built or in {len(warm_calls) + len(after_calls)} generate() calls, and no compiled frame was "
                 "entered. Turn compilation on (transformers skips torch.compile on CPU unless "
                 "CompileConfig._compile_all_devices is set; a stance such as force_eager disables it), or "
                 "drop compiled=True")
        pytest.skip(f"{at}: no torch.compile code observed (dynamo compiled nothing and no compiled frame ran), so "
                    "there are no recompiles to check")

    line = (f"{kv_engine.name} / {kv_engine.spec.name}: {len(build)} compile(s) while building, {len(warm)} warmup "
            f"compile(s) over {len(warm_calls)} call(s), {len(after)} after warmup over {len(after_calls)} call(s)"
            + (f", {len(breaks)} graph break(s)" if breaks else "")
            + (f"; CUDA graph captures: {captured[0]} while building, {captured[1]} in warmup, {captured[2]} after"
               if any(captured) else ""))
    if not any(c.ran_compiled for c in warm_calls + after_calls) and build:
        line += (" -- no compiled code seen running during generate(): the engine runs what it compiled while "
                 "building outside dynamo's frame evaluation (an exported or AOT-compiled program); a re-export "
                 "would be seen (torch.export calls are recorded), a recompile inside a native runtime would not")
    kv_record("compiles", line, compiles=Compiles(
        build=len(build), warmup=len(warm), after_warmup=len(after),
        reasons=[f"{c}: {_reason(e)}" for c in after_calls for e in c.compiles],
        graph_breaks=list(dict.fromkeys(breaks)),
        eager_runs=sum(c.eager_runs for c in after_calls),
        cuda_graph_captures=dict(zip(("build", "warmup", "after_warmup"), captured)),
        timeline=_timeline(build, warm_calls, after_calls),
    ))

    problems = []
    culprits = [f"  {c} [new: {what}]: {len(c.compiles)} compile(s)" for c, what in zip(after_calls, new) if c.compiles]
    culprits += [f"  {c} [new: {what}]: CUDA graph capture after warmup: {site}" for c, what in zip(after_calls, new)
                 for site in c.captures]
    if captured[2]:
        culprits.append(CAPTURE_HINT)
    if after:
        problems.append(f"{len(after)} dynamo compile(s) after warmup, 0 allowed")
    if captured[2]:
        problems.append(f"{captured[2]} CUDA graph capture(s) after warmup, 0 allowed: a new graph was recorded for a "
                        "shape warmup did not capture (" + "; ".join(str(c) for c in after_calls if c.captures)[:300]
                        + ")")
    for event in everything:
        if event.limit_hit:
            problems.append(f"dynamo hit {event.limit_hit} compiling {event.frame} and fell back to eager")
        if event.failed:
            problems.append(f"a compile of {event.frame} FAILED ({event.failed}): that code ran eagerly, or the engine "
                            "caught the error; either way it was not compiled")
    eager = [c for c in after_calls if c.eager_runs]
    if eager:
        problems.append(f"{sum(c.eager_runs for c in eager)} frame run(s) after warmup ran EAGERLY after failing their "
                        "guards, with no compile: " + "; ".join(f"{c} ({c.eager_runs})" for c in eager) + " -- "
                        "torch.compiler.set_stance('eager_on_recompile'), or a frame past its recompile limit")
    if any(c.ran_compiled for c in warm_calls):
        stopped = [c for c in after_calls if not c.ran_compiled]
        if stopped:
            problems.append(f"compiled code stopped running: warmup ran compiled code, "
                            f"but {len(stopped)} unseen call(s) "
                            f"entered no compiled frame ({'; '.join(map(str, stopped[:4]))}): new shapes were served "
                            "eagerly (an engine falling back to eager, a stance, or a compiled path bypassed)")
    if breaks and not kv_settings.allow_graph_breaks:
        problems.append(f"{len(breaks)} graph break(s) in the engine's compiled code, none allowed (each splits the "
                        "graph: host round trips, no fusion across it; --kv-allow-graph-breaks reports them "
                        "without failing)")
    if problems:
        detail = explain(after, allow_graph_breaks=kv_settings.allow_graph_breaks,
                         warmup_events=build + warm).split("\n", 1)
        fail(
            Kind.RECOMPILE,
            f"{at}: {'; '.join(dict.fromkeys(problems))}\n"
            f"  warmup: {', '.join(map(str, warm_calls))}\n" + "\n".join(culprits)
            + (("\n" + detail[1]) if len(detail) > 1 else ""),
        )


def test_identical_calls_compile_nothing(kv_session, kv_engine_name, kv_model_name, kv_prompts, kv_record):
    """A fresh engine object serves one call three times: whatever it compiles, it compiles in the first call."""
    fresh = kv_session.fresh_engine(kv_engine_name, kv_model_name)
    prompt = next(p for p in kv_prompts if len(p) == 7)
    fresh.reset_dynamo()  # from a clean dynamo, as a new process would start
    for _ in range(3):
        fresh.generate([prompt], DECODE_STEPS)
    first, *repeats = fresh.history
    at = f"engine '{fresh.name}' on model '{fresh.spec.name}'"
    if not any(c.compiles or c.guard_hits or c.captures for c in fresh.history) and not fresh.build_compiles:
        pytest.skip(f"{at}: no torch.compile code observed in three identical calls, so there are no recompiles "
                    "to check")
    again = [(i + 2, c) for i, c in enumerate(repeats) if c.compiles or c.captures]
    kv_record.metric(compiles=Compiles(build=len(fresh.build_compiles), warmup=len(first.compiles), after_warmup=0,
                                       reasons=[f"repeat {n}: {_reason(e)}" for n, c in again for e in c.compiles]))
    if again:
        lines = [f"  call {n} of 3, {c}: {_reason(e)}" for n, c in again for e in c.compiles]
        lines += [f"  call {n} of 3, {c}: CUDA graph capture: {site}" for n, c in again for site in c.captures]
        fail(
            Kind.RECOMPILE,
            f"{at}: {sum(len(c.compiles) + len(c.captures) for _, c in again)} compile(s) or capture(s) in a call "
            f"identical to the first of a fresh engine object, 0 allowed: state the first call left (e.g. a cache "
            "initialised lazily on first use, `is_initialized` in the guards below) was baked into its compiled "
            "graph, so the same call recompiles for every new engine or cache (transformers #46421 shipped this; "
            "initialise such state before compiling, or keep it out of the graph's guards)\n"
            f"  first call: {first} compiled {len(first.compiles)} frame(s)\n" + "\n".join(lines),
        )
