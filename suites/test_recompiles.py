"""Zero recompiles after warmup: a compiled engine, warmed up on prompt lengths 7 and 48 (and a batch
of both if it batches), compiles nothing more for unseen lengths (1, 2, 3, 13, 33, 100 and the
model's sliding-window lengths W-1, W, W+1, 2W+3), batch sizes 1..4 and 32-step decodes (which
cross the window). The build, warmup and after-warmup compile counts are reported, with a note when
dynamo saw nothing compile during generate() (an engine compiling at build time, as vLLM does, or
outside dynamo: this check cannot see those recompile). An engine declaring compiled=True of which
dynamo compiled nothing at all is skipped with that reason: there is nothing to check."""

import pytest

from pytest_kvcompile.prompts import Prompt, of_length
from pytest_kvcompile.recompiles import CompileRecorder, isolate, verdict

DECODE_STEPS = 32
UNSEEN_LENGTHS = (1, 2, 3, 13, 33, 100)


def _calls(prompts: list[Prompt], batching: bool, vocab: int):
    """(warmup calls, unseen calls): each call is a list of prompts."""
    by_len = {len(p): p for p in prompts}
    short, long = by_len[7], by_len[48]
    warmup = [[short], [long]] + ([[short, long]] if batching else [])
    others = {len(p): p for p in prompts if p not in (short, long)}
    others.update({n: of_length(n, vocab, salt=2) for n in UNSEEN_LENGTHS if n not in others})
    others = [others[n] for n in sorted(others)]
    unseen = [[p] for p in others]
    if batching:
        unseen += [[others[0], others[-1]], others[1:4], [long] + others[2:5]]
    return warmup, unseen


def _reason(event) -> str:
    """One line per compile after warmup: which compile and the guard each cached entry failed (dynamo
    tries every entry: the one that explains the recompile is not always the first)."""
    failed = "; ".join(event.guard_failures)
    return event.describe().splitlines()[0] + (f": guards failed: {failed}" if failed else "")


def _describe(call: list[Prompt]) -> str:
    return f"generate(<batch of {len(call)}, lengths {[len(p) for p in call]}>, {DECODE_STEPS})"


@pytest.mark.kv_requires("compiled")
def test_no_recompiles_after_warmup(kv_engine, kv_prompts, kv_record):
    warmup, unseen = _calls(kv_prompts, kv_engine.ref.declaration.batching, kv_engine.spec.vocab_size)
    isolate()  # count this engine's compiles from scratch
    culprits = []
    with CompileRecorder() as recorder:
        for call in warmup:
            kv_engine.generate(call, DECODE_STEPS)
        recorder.mark_warmup_done()
        for call in unseen:
            before = len(recorder.events)
            kv_engine.generate(call, DECODE_STEPS)
            if len(recorder.events) > before:
                culprits.append(f"{_describe(call)}: {len(recorder.events) - before} compile(s)")
    after, build = recorder.post_warmup_events, kv_engine.build_compiles
    line = (f"{kv_engine.name} / {kv_engine.spec.name}: {build} compile(s) while building, "
            f"{len(recorder.warmup_events)} warmup compile(s) over {len(warmup)} call(s), "
            f"{len(after)} after warmup over {len(unseen)} call(s)")
    if build and not recorder.events:
        line += (" -- nothing compiled during generate(): the engine runs what it compiled while building; "
                 "recompiles it makes outside dynamo are not seen")
    kv_record("compiles", line, compiles={"build": build, "warmup": len(recorder.warmup_events),
                                          "after_warmup": len(after),
                                          "reasons": culprits + [_reason(event) for event in after]})
    if not build and not recorder.events:
        pytest.skip(f"engine '{kv_engine.name}' declares compiled=True but dynamo compiled nothing, neither while "
                    "building nor in generate(): this check sees dynamo compiles only, so it has nothing to check")
    failure = verdict(recorder, warmup=True)
    if failure:
        pytest.fail(
            f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}' recompiled after warmup "
            f"(warmup: {', '.join(_describe(c) for c in warmup)})\n"
            + "\n".join(f"  {line}" for line in culprits) + "\n" + failure,
            pytrace=False,
        )
