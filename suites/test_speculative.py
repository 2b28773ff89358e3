"""Speculative decoding (pytest_kvcompile/contract/speculative.py): drafted tokens are verified by the target in one
forward over its KV cache, the K/V of rejected ones rolled back, the bonus token appended; greedy speculative decoding
must equal plain greedy decoding token for token, whatever is accepted.

The suite chooses, per generated position, whether a draft is the target's choice (pytest_kvcompile/oracles/
speculation.py): the drafter proposes the oracle's greedy token, or the token the oracle ranks last. Schedules: accept
all; reject first at position j for every j < k (j = 0: reject all); alternate (all, then none). Each runs

- one prompt per call (`test_speculative_schedules`), the calls one after another on one engine object (so each
  follows other prompts and schedules), the first again at the end;
- in batches whose rows follow different schedules, so rows keep different numbers of drafts in the same step
  (`test_speculative_schedules_batched`, engines declaring batching);
- with a draft model (`test_speculative_draft_model`, engines taking one): the target with two rows of its output head
  swapped (pytest_kvcompile/models/drafts.py), chosen from the oracle's continuations, so it proposes the target's own
  choice except where that is one of the two tokens, through the engine's own draft cache and its rollback;
- with prompt lookup forced (`test_speculative_lookup`, engines declaring ``Speculative(lookup=True)``): prompts whose
  last tokens occur once before, followed by a continuation the target keeps for exactly j tokens, j = 0 .. k + 1
  (oracles/speculation.py: lookup_prompt), one per call and, with batching, all in one call;
- with the engine's own drafts (`test_speculative_own_draft`: a draft model, prompt lookup), what they are.

Every token is judged by the oracle (kv_check_tokens). An engine reporting ``acceptance()`` must account for every
generated token exactly once under one convention of its own, decided by its first sequence (the prefill's token or
not, then each step's accepted + 1: oracles/speculation.py `Convention`), and must have kept, at every step, exactly
the drafts a correct engine keeps (a draft model may propose the runner-up at an oracle near tie), and its
steps go to the reports; a speculative engine whose reported steps never accepted and rejected a draft fails the run
as vacuous (verdicts/run_rules.py: run_problems). An engine declaring kv_cache_bytes and a kv_layout must hold, after
each call, exactly the layout's bytes: rejected K/V rolled back.
"""

from __future__ import annotations

import contextlib

import pytest

from pytest_kvcompile.contract.speculative import DRAFT_MODEL, DRAFTER
from pytest_kvcompile.memory.measure import expected_kv_bytes, format_bytes
from pytest_kvcompile.models.checkpoints import OwnConfig
from pytest_kvcompile.models.drafts import head_swapped
from pytest_kvcompile.models.prompts import Prompt
from pytest_kvcompile.oracles.speculation import (
    Convention,
    DraftRow,
    LookupPrompt,
    ScheduledDrafter,
    choose_swap,
    exercised,
    judge,
    judge_lookup,
    lookup_prompt,
    near_ties,
    schedule_rejects,
    swap_rejects,
    unaccounted,
)
from pytest_kvcompile.verdicts.failures import Kind, Where, fail

PROMPTS = (7, 48, 1)  # lengths of the model's prompts the single calls take in turn
#: per engine and model, where its first verify step starts: decided by its first sequence, held in every later one
CONVENTIONS: dict[tuple[str, str], Convention] = {}


def _declared(kv_engine, kind: str | None = None):
    declared = kv_engine.ref.declaration.speculative
    if declared is None:
        pytest.skip(f"engine '{kv_engine.name}' declares no speculative decoding: declare "
                    "Declaration(speculative=pytest_kvcompile.Speculative(k=...)) if it drafts tokens")
    if kind and kind not in declared.drafters:
        pytest.skip(f"engine '{kv_engine.name}' takes no {kind} from the caller (its {declared} does not name "
                    f"{kind!r}): declare it and accept one in use_drafter() to have acceptance forced")
    if kv_engine.max_new_tokens < 3:
        pytest.skip("speculative steps need room to draft: run with --kv-max-new-tokens >= 3")
    return declared


def _schedules(k: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, acceptance lengths per step, in turn)."""
    reject = [(f"reject first at {j}" + (" (reject all)" if j == 0 else ""), (j,)) for j in range(k)]
    return [("accept all", (k,)), *reject, ("alternate", (k, 0))]


class Calls:
    """The calls of one test on one engine object: each call's tokens judged, its steps judged and kept for the
    reports, its KV bytes held to the declared layout."""

    def __init__(self, kv_engine, kv_oracle, kv_check_tokens, kv_record):
        self.engine, self.oracle, self.check, self.record = kv_engine, kv_oracle, kv_check_tokens, kv_record
        self.declared = kv_engine.ref.declaration.speculative
        self.served, self.steps, self.judged = [], [], 0

    def reference(self, prompt):
        return self.oracle.reference(prompt.ids, self.engine.max_new_tokens)

    def row(self, prompt, rejects) -> DraftRow:
        return DraftRow.of(self.reference(prompt), rejects, self.engine.spec.vocab_size)

    def __call__(self, prompts, rows: list[DraftRow | LookupPrompt] | None, drafter, what: list[str], calls: int,
                 ties: list | None = None) -> None:
        """generate(prompts) with `drafter` (None: the engine's own), `rows` the drafts each prompt gets (a
        LookupPrompt: what its lookup proposes first; None: unknown, the engine's own), `what` each row's drafts, for
        messages; `ties`: per row, where a draft model may propose the runner-up (oracles/speculation.py: judge)."""
        engine, lengths = self.engine, tuple(len(p) for p in prompts)
        number = len(self.served) + 1
        with engine.drafting(drafter) if drafter is not None else contextlib.nullcontext():
            got = engine.generate(prompts)
            steps = engine.acceptance(len(prompts)) if self.declared.acceptance else None
        wrong = []
        for i, (prompt, tokens) in enumerate(zip(prompts, got)):
            where = Where(index=i, lengths=lengths, number=number, calls=calls, before=tuple(self.served[-3:]),
                          note=what[i], speculation=_rows(steps) if steps else ())
            self.check(self.reference(prompt), tokens, prompt, where)
            if steps is None:
                continue
            self.steps += steps[i]
            convention = CONVENTIONS.setdefault((engine.name, engine.spec.name), Convention())
            broken = convention.check(steps[i], len(tokens), f"prompt '{prompt.name}'")
            if broken:
                wrong.append(f"  prompt '{prompt.name}': {broken}    ({where.describe()}); its steps (drafted, "
                             f"accepted): {steps[i]}")
                continue
            if rows is None:  # the engine's own drafts: its steps must still account for its tokens
                found = unaccounted(steps[i], len(tokens))
            elif isinstance(rows[i], LookupPrompt):
                reference = self.reference(prompt)
                verdict = judge_lookup(rows[i], steps[i], tokens, reference.tokens,
                                       near_ties(reference, engine.tie_tolerance))
                self.judged, found = self.judged + verdict.checked, verdict.wrong
            else:
                verdict = judge(rows[i], steps[i], tokens, ties[i] if ties else None)
                self.judged, found = self.judged + verdict.checked, verdict.wrong
            if found:
                wrong.append(f"  prompt '{prompt.name}' ({where.describe()}): {found}; its steps (drafted, accepted): "
                             f"{steps[i]}")
        self.served += [p.name for p in prompts]
        self._kv_bytes(prompts, what)
        if wrong:
            fail(Kind.SPECULATION,
                 f"engine '{engine.name}' on model '{engine.spec.name}' kept another number of drafts than a correct "
                 f"speculative decoder (the target keeps the drafts equal to its own greedy choices, up to the first "
                 f"that is not):\n" + "\n".join(wrong) + "\n  hint: check the acceptance rule (the longest prefix of "
                 "drafts equal to the target's argmax at each position), what acceptance() reports, and the context "
                 "the drafts come from: a draft model whose own cache keeps the drafts the target rejected proposes "
                 "from a context that is not the sequence\n" + engine.served(len(engine.history) - 1))

    def _kv_bytes(self, prompts, what) -> None:
        """After rollback the cache holds the declared layout's bytes (engines declaring kv_cache_bytes + kv_layout)."""
        engine, declared = self.engine, self.engine.ref.declaration
        if not (declared.kv_cache_bytes and declared.kv_layout) or declared.kv_cache_dtype \
                or isinstance(engine.spec.config, OwnConfig):
            return
        got = engine.engine.kv_cache_bytes()
        footprint = expected_kv_bytes(declared.kv_layout, engine.spec.config, engine.spec.dtype, len(prompts),
                                      max(map(len, prompts)), engine.max_new_tokens)
        if got != footprint.total:
            fail(Kind.MEMORY,
                 f"engine '{engine.name}' on model '{engine.spec.name}', generate(<{len(prompts)} prompt(s) of lengths "
                 f"{[len(p) for p in prompts]}>, {engine.max_new_tokens}) with drafts {what}: kv_cache_bytes() = "
                 f"{format_bytes(got) if isinstance(got, int) else repr(got)} but its declared {declared.kv_layout} "
                 f"holds {format_bytes(footprint.total)} after the call\n{footprint.explain()}\n  hint: the K/V of "
                 "rejected drafts are not rolled back (or rolled back by the wrong count): after a step, a row holds "
                 "its tokens so far, never a rejected draft")

    def finish(self, kind: str) -> None:
        """The steps to the reports, and which acceptance lengths the test exercised."""
        if not self.declared.acceptance:
            self.record("speculative decoding", f"{self.engine.name} / {self.engine.spec.name}: {kind}: tokens "
                        "judged; acceptance not reported (declare Speculative(acceptance=True) and acceptance())")
            return
        found = exercised(self.steps, self.declared.k)
        kept = sorted({a for d, a in self.steps if a < d}) + (["all"] if any(a == d > 0 for d, a in self.steps) else [])
        self.record("speculative decoding", f"{self.engine.name} / {self.engine.spec.name}: {kind}: {found.steps} "
                    f"verify step(s), {self.judged} judged; rejected first at {kept or 'none'}", speculation=found)


def _rows(steps) -> tuple[tuple[tuple[int, int], ...], ...]:
    """acceptance()'s rows as the failure's `Where.speculation`."""
    return tuple(tuple((int(d), int(a)) for d, a in row) for row in steps)


def _prompts(kv_prompts):
    by_length = {len(p): p for p in kv_prompts}
    return [by_length[n] for n in PROMPTS if n in by_length]


def test_speculative_schedules(kv_engine, kv_oracle, kv_prompts, kv_check_tokens, kv_record):
    """Every schedule, one prompt per call, the calls one after another; the first call again at the end."""
    declared = _declared(kv_engine, DRAFTER)
    calls, n = Calls(kv_engine, kv_oracle, kv_check_tokens, kv_record), kv_engine.max_new_tokens
    prompts, schedules = _prompts(kv_prompts), _schedules(declared.k)
    plan = [(prompts[i % len(prompts)], schedule) for i, schedule in enumerate(schedules)]
    for prompt, (name, lengths) in [*plan, plan[0]]:
        row = calls.row(prompt, schedule_rejects(lengths, declared.k, n))
        calls([prompt], [row], ScheduledDrafter((row,)), [f"schedule '{name}'"], len(plan) + 1)
    calls.finish("every schedule alone")


@pytest.mark.kv_requires("batching")
def test_speculative_schedules_batched(kv_engine, kv_oracle, kv_batch, kv_check_tokens, kv_record):
    """Rows of one call follow different schedules: they keep different numbers of drafts in the same step."""
    declared = _declared(kv_engine, DRAFTER)
    calls, n = Calls(kv_engine, kv_oracle, kv_check_tokens, kv_record), kv_engine.max_new_tokens
    schedules = _schedules(declared.k)
    for shift in range(len(schedules)):
        chosen = [schedules[(i + shift) % len(schedules)] for i in range(len(kv_batch))]
        rows = [calls.row(p, schedule_rejects(lengths, declared.k, n)) for p, (_, lengths) in zip(kv_batch, chosen)]
        calls(kv_batch, rows, ScheduledDrafter(tuple(rows)), [f"schedule '{name}'" for name, _ in chosen],
              len(schedules))
    calls.finish("rows of a batch on different schedules")


def test_speculative_draft_model(kv_engine, kv_oracle, kv_prompts, kv_batch, kv_settings, kv_check_tokens,
                                 kv_record):
    """A draft model the caller gives: the target with two output rows swapped, run over the engine's draft cache."""
    declared = _declared(kv_engine, DRAFT_MODEL)
    spec = kv_engine.spec
    if isinstance(spec.config, OwnConfig):
        pytest.skip(f"model '{spec.name}' is not a transformers checkpoint: no draft model is derived from it")
    calls = Calls(kv_engine, kv_oracle, kv_check_tokens, kv_record)
    prompts = _prompts(kv_prompts)
    batched = [kv_batch] if kv_engine.ref.declaration.batching else []
    continuations = [calls.reference(p).tokens for p in prompts + [p for b in batched for p in b]]
    a, b = choose_swap(continuations, declared.k, spec.vocab_size)
    draft = head_swapped(spec, kv_settings.cache_dir / "drafts", a, b)
    what = f"draft model '{draft.name}' (output rows {a} and {b} swapped)"
    for call in [[p] for p in prompts] + batched:
        rows = [calls.row(p, swap_rejects(calls.reference(p).tokens, (a, b))) for p in call]
        ties = [near_ties(calls.reference(p), kv_engine.tie_tolerance) for p in call]
        calls(call, rows, draft, [what] * len(call), len(prompts) + len(batched), ties)
    calls.finish(f"draft model with output rows {a} and {b} swapped")


def test_speculative_lookup(kv_engine, kv_oracle, kv_check_tokens, kv_record):
    """Prompt lookup forced: per j = 0 .. k + 1 a prompt whose lookup proposes a continuation the target keeps for
    exactly j tokens (k + 1: all of a step after the prefill's token), one per call, the calls one after another, then
    all in one call (engines declaring batching): rows keeping different lengths in one step."""
    declared = _declared(kv_engine)
    if not declared.lookup:
        pytest.skip(f"engine '{kv_engine.name}' declares no prompt lookup (its {declared}): declare "
                    "Speculative(lookup=True) if its own drafts are looked up in the sequence, to have them forced")
    n, spec = kv_engine.max_new_tokens, kv_engine.spec
    if n < declared.k + 2:
        pytest.skip(f"forcing every acceptance length of {declared.k} drafts needs --kv-max-new-tokens >= "
                    f"{declared.k + 2} (got {n})")
    calls = Calls(kv_engine, kv_oracle, kv_check_tokens, kv_record)
    built, missing = [], []
    for j in range(declared.k + 2):
        found = lookup_prompt(lambda ids: kv_oracle.cached_reference(ids, n), j, declared.k, spec.vocab_size,
                              kv_engine.tie_tolerance)
        if found is None:
            missing.append(j)
        else:
            built.append((Prompt(f"lookup keeps {j}", found.ids), found))
    if not built:
        pytest.skip(f"no prompt found on model '{spec.name}' whose lookup the target keeps for exactly j tokens, for "
                    f"any j: the oracle's continuation moved with every proposal planted in the prompt")
    if missing:
        kv_record("speculative decoding", f"{kv_engine.name} / {spec.name}: no lookup prompt found for j = {missing} "
                  "(the oracle's continuation moved with the planted proposal): those lengths were not forced")
    what = [f"its lookup, proposing {list(found.proposal)} (the target keeps {found.accepts})" for _, found in built]
    batched = [list(range(len(built)))] if kv_engine.ref.declaration.batching and len(built) > 1 else []
    plan = [[i] for i in range(len(built))] + batched
    for call in plan:
        calls([built[i][0] for i in call], [built[i][1] for i in call], None, [what[i] for i in call], len(plan))
    calls.finish(f"prompt lookup forced to keep {sorted(found.accepts for _, found in built)}")


def test_speculative_own_draft(kv_engine, kv_oracle, kv_prompts, kv_batch, kv_check_tokens, kv_record):
    """The engine's own drafts (its default draft model, prompt lookup): tokens judged, steps reported as they are."""
    _declared(kv_engine)
    calls = Calls(kv_engine, kv_oracle, kv_check_tokens, kv_record)
    batched = [kv_batch] if kv_engine.ref.declaration.batching else []
    plan = [[p] for p in _prompts(kv_prompts)] + batched
    for prompts in plan:
        calls(prompts, None, None, ["the engine's own drafts"] * len(prompts), len(plan))
    calls.finish("its own drafts")
