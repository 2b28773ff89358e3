"""Zero recompiles after warmup, observed not declared.

Every engine runs this check: it is warmed up on prompt lengths 7 and 48 (and a batch of both if it batches),
then given unseen lengths (1, 2, 3, 13, 33, 100 and the model's sliding-window lengths W-1, W, W+1, 2W+3),
batch sizes 1..4 and 32-step decodes (which cross the window). Every call runs under the compile recorder
(pytest_kvcompile/run/harness.py), which sees what dynamo compiled and whether compiled code matched its guards
and ran. If dynamo compiled nothing and no compiled code ran, the check has nothing to judge: it is skipped
for an engine that does not declare ``compiled``, and FAILS one that declares it. Otherwise it fails on:

- a compile after warmup (a recompile, or a first compile of a path warmup missed);
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

from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.recompiles.recorder import CAPTURE_HINT, explain, isolate

DECODE_STEPS = 32
UNSEEN_LENGTHS = (1, 2, 3, 13, 33, 100)


def _calls(prompts: list[Prompt], batching: bool, vocab: int):
    """(warmup calls, unseen calls): each call is a list of prompts."""
    by_len = {len(p): p for p in prompts}
    short, long = by_len[7], by_len[48]
    warmup = [[short], [long]] + ([[short, long]] if batching else [])
    others = {len(p): p for p in prompts if p not in (short, long) and len(p) <= 100}
    others.update({n: of_length(n, vocab, salt=2) for n in UNSEEN_LENGTHS if n not in others})
    others = [others[n] for n in sorted(others)]
    unseen = [[p] for p in others]
    if batching:
        unseen += [[others[0], others[-1]], others[1:4], [long] + others[2:5]]
    return warmup, unseen


def _reason(event) -> str:
    """One line per compile: which compile and the guard each cached entry failed (dynamo tries every entry:
    the one that explains the recompile is not always the first)."""
    failed = "; ".join(event.guard_failures)
    return event.describe().splitlines()[0] + (f": guards failed: {failed}" if failed else "")


def test_no_recompiles_after_warmup(kv_engine, kv_prompts, kv_record, kv_settings):
    declared = kv_engine.ref.declaration
    warmup, unseen = _calls(kv_prompts, declared.batching, kv_engine.spec.vocab_size)
    isolate()  # count this engine's compiles from scratch
    start = len(kv_engine.history)
    for call in warmup:
        kv_engine.generate(call, DECODE_STEPS)
    warm_calls = kv_engine.history[start:]
    for call in unseen:
        kv_engine.generate(call, DECODE_STEPS)
    after_calls = kv_engine.history[start + len(warm_calls):]
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
            pytest.fail(f"{at} declares compiled=True but no compiled code ran: dynamo compiled nothing while it was "
                        f"built or in {len(warm_calls) + len(after_calls)} generate() calls, and no compiled frame was "
                        "entered. Turn compilation on (transformers skips torch.compile on CPU unless "
                        "CompileConfig._compile_all_devices is set; a stance such as force_eager disables it), or "
                        "drop compiled=True", pytrace=False)
        pytest.skip(f"{at}: no torch.compile code observed (dynamo compiled nothing and no compiled frame ran), so "
                    "there are no recompiles to check")

    line = (f"{kv_engine.name} / {kv_engine.spec.name}: {len(build)} compile(s) while building, {len(warm)} warmup "
            f"compile(s) over {len(warm_calls)} call(s), {len(after)} after warmup over {len(after_calls)} call(s)"
            + (f", {len(breaks)} graph break(s)" if breaks else "")
            + (f"; CUDA graph captures: {captured[0]} while building, {captured[1]} in warmup, {captured[2]} after"
               if any(captured) else ""))
    if not any(c.ran_compiled for c in warm_calls + after_calls) and build:
        line += (" -- no compiled code seen running during generate(): the engine runs what it compiled while "
                 "building outside dynamo's frame evaluation; recompiles it makes there are not seen")
    kv_record("compiles", line, compiles={
        "build": len(build), "warmup": len(warm), "after_warmup": len(after),
        "reasons": [f"{c}: {_reason(e)}" for c in after_calls for e in c.compiles],
        "graph_breaks": list(dict.fromkeys(breaks)),
        "eager_runs": sum(c.eager_runs for c in after_calls),
        "cuda_graph_captures": {"build": captured[0], "warmup": captured[1], "after_warmup": captured[2]},
    })

    problems = []
    culprits = [f"  {c}: {len(c.compiles)} compile(s)" for c in after_calls if c.compiles]
    culprits += [f"  {c}: CUDA graph capture after warmup: {site}" for c in after_calls for site in c.captures]
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
            problems.append(f"compiled code stopped running: warmup ran compiled code, but {len(stopped)} unseen call(s) "
                            f"entered no compiled frame ({'; '.join(map(str, stopped[:4]))}): new shapes were served "
                            "eagerly (an engine falling back to eager, a stance, or a compiled path bypassed)")
    if breaks and not kv_settings.allow_graph_breaks:
        problems.append(f"{len(breaks)} graph break(s) in the engine's compiled code, none allowed (each splits the "
                        "graph: host round trips, no fusion across it; --kv-allow-graph-breaks reports them "
                        "without failing)")
    if problems:
        detail = explain(after, allow_graph_breaks=kv_settings.allow_graph_breaks,
                         warmup_events=build + warm).split("\n", 1)
        pytest.fail(
            f"{at}: {'; '.join(dict.fromkeys(problems))}\n"
            f"  warmup: {', '.join(map(str, warm_calls))}\n" + "\n".join(culprits)
            + (("\n" + detail[1]) if len(detail) > 1 else ""),
            pytrace=False,
        )
