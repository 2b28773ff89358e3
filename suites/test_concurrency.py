"""Concurrent requests: what a server's users meet (continuous batching, prefix caching, chunked prefill).

A target prompt is sent alone, then among N concurrent requests at N = 2, 4, 8 (all released at once, one
``generate()`` call each, ``kv_engine.concurrently``): requests of mixed lengths, some sharing the target's first 16
tokens (a prefix cache is hit), some of the longest length the model allows (a server chunks their prefill), some
short; then the largest round again once the cache is warm. Every response is judged against the oracle
(``kv_check_tokens``), not only against the target's answer alone (a deterministic but wrong answer is caught), and the
report says per round how many responses were identical, within near ties, or wrong. 23 requests, each bounded by the
engine's own timeout and --kv-call-timeout (else 300 s), loopback only for servers.

It runs on servers (engines/server.py) and on engines declaring ``thread_safe=True``, in process or isolated (the
engine's process releases each round from its own threads); any other engine is a named skip. A server's cap on
requests at once (``?max_concurrency=N`` in its URL) bounds the rounds: those larger are not sent, and the summary
names them. tests/test_servers.py shows it failing on servers whose answers change
under concurrency."""

import pytest

from pytest_kvcompile.models.checkpoints import max_positions
from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.oracles.token_match import TokenMismatch
from pytest_kvcompile.verdicts.failures import Where
from pytest_kvcompile.verdicts.lines import concurrency_line
from pytest_kvcompile.verdicts.rows import Round

ROUNDS = (2, 4, 8)  # concurrent requests per round, the target among them; the last again once the cache is warm
TARGET, SHARED, TAIL = 23, 16, 8
LONGEST = 250  # the long requests' length where the model allows it (past 256 positions with the new tokens)


def _others(vocab: int, longest: int, count: int) -> list[Prompt]:
    """Requests sent beside the target, in this order: sharing its prefix, long, short, ..."""
    target = of_length(TARGET, vocab, salt=50).ids
    found = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            found.append(Prompt(f"shares{SHARED}/{i}", target[:SHARED] + of_length(TAIL + i, vocab, salt=51 + i).ids))
        elif kind == 1:
            found.append(Prompt(f"long{longest}/{i}", of_length(longest, vocab, salt=60 + i).ids))
        else:
            found.append(Prompt(f"short{3 + i}/{i}", of_length(3 + i, vocab, salt=70 + i).ids))
    return found


@pytest.fixture
def concurrent_engine(kv_engine):
    """kv_engine, or a named skip before the oracle is asked for anything: it declares no safety under concurrent
    callers."""
    if not (kv_engine.server or kv_engine.ref.declaration.thread_safe):
        pytest.skip(f"engine '{kv_engine.name}' is neither a server nor declares thread_safe=True: concurrent callers "
                    "would race on its state; declare Declaration(thread_safe=True) if generate() may be called "
                    "from several threads at once")
    return kv_engine


def test_concurrent_requests(concurrent_engine, kv_oracle, kv_check_tokens, kv_record):
    kv_engine = concurrent_engine
    spec, n = kv_engine.spec, kv_engine.max_new_tokens
    limit = max_positions(spec.config)
    longest = min(LONGEST, limit - n) if limit else LONGEST
    target = Prompt(f"target{TARGET}", of_length(TARGET, spec.vocab_size, salt=50).ids)
    others = _others(spec.vocab_size, longest, max(ROUNDS) - 1)
    cap = kv_engine.host.max_concurrency  # a server's ?max_concurrency
    sizes = [size for size in ROUNDS if cap is None or size <= cap]
    left_out = [size for size in ROUNDS if size not in sizes]
    if not sizes:
        pytest.skip(f"engine '{kv_engine.name}' allows {cap} request(s) at once (?max_concurrency={cap} in its URL): "
                    f"no round of {', '.join(map(str, ROUNDS))} concurrent requests fits under that cap")
    rounds = [("alone", [target])] + [(f"N={size}", [target, *others[:size - 1]]) for size in sizes]
    rounds.append((f"warm N={max(sizes)}", rounds[-1][1]))
    counts: dict[str, Round] = {}
    first: TokenMismatch | None = None
    alone = None
    for number, (label, prompts) in enumerate(rounds, 1):
        outputs = kv_engine.concurrently([[p] for p in prompts]) if len(prompts) > 1 else [kv_engine.generate(prompts)]
        lengths = tuple(len(p) for p in prompts)
        tally = counts.setdefault(label, Round())
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            got = out[0]
            alone = got if alone is None else alone
            reference = kv_oracle.reference(prompt.ids, n)
            note = (f"round {label} of {len(rounds)} rounds, {len(prompts)} concurrent request(s)"
                    f"{'' if i or label == 'alone' else f'; the target alone gave {alone}'}")
            where = Where(index=i, lengths=lengths, number=number, calls=len(rounds), note=note)
            try:
                verdict = kv_check_tokens(reference, got, prompt, where)
            except TokenMismatch as exc:
                tally.wrong += 1
                first = first or exc
                continue
            if verdict.near_ties:
                tally.near_tie += 1
            else:
                tally.identical += 1
    table = concurrency_line(counts)
    if left_out:
        table += (f"; rounds N={', N='.join(map(str, left_out))} not sent (the server allows {cap} request(s) at "
                  f"once: ?max_concurrency={cap})")
    kv_record("concurrency (responses per round: identical, within near ties, wrong)",
              f"{kv_engine.name} / {spec.name}: {table}", concurrency=counts)
    if first is not None:
        raise TokenMismatch(f"{first}\n  every round: {table}", first.failure)
