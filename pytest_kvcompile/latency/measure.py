"""Prefill and decode latency of an engine: the rule every latency number of the run follows.

Engines only expose ``generate(prompts, max_new_tokens)``, so latency is derived from two calls
on one prompt of ``PROMPT_LEN`` tokens, batch of one:

- ``prefill_ms``          = time(generate([prompt], 1))  (the prompt's forward plus one token)
- ``decode_ms_per_token`` = (time(generate([prompt], 1 + K)) - time(generate([prompt], 1))) / K

with K = ``DECODE_TOKENS``. Every timed call gets a prompt of its own (same length, other tokens: `fresh`), so
an engine that caches prompts (llama-cpp-python reuses a repeated prompt's KV) is timed computing, not
remembering. Per-call overheads (cache allocation, Python, output conversion)
cancel out of the decode difference. ``WARMUP`` untimed calls of each kind come first (compiled
engines compile there), then N repeats (``--kv-latency-repeats``); the median and p90 (nearest
rank) over the repeats are reported and budgets are checked against the median. Timing is CUDA
events around the call on a CUDA device, ``time.perf_counter`` on CPU; an isolated engine is timed in its own
process (perf_counter around the call, after a CUDA synchronize), so the pipe to it is not counted. Engines measured
side by side (a relative budget) alternate within each repeat, so load changes hit both, in an order reversed every
other repeat (A B, B A: what follows the other engine's calls is shared), and each engine's timed pair is preceded by
one untimed call of its own (its process and threads awake after the other's calls: on a CI machine an isolated
engine, each of its T(1) calls the first after the in-process engine's, came out 4.6x that engine's prefill where an
idle machine measures 0.4-0.8x, with a decode difference of -1.1 ms/token). A relative budget is judged on the
repeats' paired samples, and confirmed by more rounds before it fails (latency/marker.py: check, Probe).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pytest_kvcompile.errors import skip
from pytest_kvcompile.models.prompts import Prompt, of_length, variant
from pytest_kvcompile.verdicts.rows import Timings

if TYPE_CHECKING:
    from pytest_kvcompile.contract.engine import ModelSpec


class Timing(Protocol):
    """Who times a call of an engine (run/host.py: Host): in process the caller, an isolated engine's own process."""

    def timed(self, call: Callable[[], object], time_ms: Callable[[Callable[[], object]], float]) -> float:
        """`call` made, and its time in ms: `time_ms(call)`, or as the engine's process measured it (no pipe)."""
        ...


class Measured(Protocol):
    """What `measure` needs of an engine under test (run/harness.py: EngineUnderTest, which the run layer passes)."""

    name: str
    spec: ModelSpec
    engine: Any  # what calls go to: its generate() is what is timed
    host: Timing  # where the engine runs, which says how a call of it is timed

    def generate(self, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]: ...

PROMPT_LEN = 32
DECODE_TOKENS = 8
WARMUP = 2


# --- measuring --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Latency:
    engine: str
    model: str
    prompt_len: int
    decode_tokens: int
    timer: str
    prefill_ms: tuple[float, ...]
    decode_ms_per_token: tuple[float, ...]

    def record(self) -> Timings:
        """The samples as the reports' row holds them (verdicts/rows.py: Timings, which gives their statistics)."""
        return Timings(self.prompt_len, self.decode_tokens, self.timer, list(self.prefill_ms),
                       list(self.decode_ms_per_token))

    def pooled(self, more: Latency) -> Latency:
        """These samples and `more`'s (a confirmation round of the same protocol), in order."""
        return Latency(self.engine, self.model, self.prompt_len, self.decode_tokens, self.timer,
                       self.prefill_ms + more.prefill_ms, self.decode_ms_per_token + more.decode_ms_per_token)

    prefill = property(lambda self: self.record().prefill, doc="Median and p90 of the prefill samples.")
    decode = property(lambda self: self.record().decode, doc="Median and p90 of the decode samples (per token).")


def timer_for(device: str) -> tuple[str, Callable[[Callable[[], object]], float]]:
    """(name, time_ms(fn)): CUDA events on a CUDA device, perf_counter elsewhere."""
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            skip(f"latency on device '{device}' needs CUDA, which this torch does not have")

        def cuda_ms(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return "cuda-events", cuda_ms

    def cpu_ms(fn):
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return "perf_counter", cpu_ms


def fresh(prompt_len: int, vocab_size: int) -> Iterator[Prompt]:
    """Prompts of `prompt_len` tokens, each with other tokens (a prompt cache cannot answer a timed call)."""
    base = of_length(prompt_len, vocab_size, salt=5)
    return (variant(base, vocab_size, salt=5000 + i) for i in itertools.count())


def _timed(eut: Measured, time_ms: Callable[[Callable[[], object]], float], call: Callable[[], object]) -> float:
    """`call`'s time in ms, as the engine's host times it: `time_ms(call)` in process, an isolated engine's as its own
    process measured it (run/host.py, run/isolation.py), without the pipe."""
    return eut.host.timed(call, time_ms)


def measure(engines: Sequence[Measured], repeats: int, prompt_len: int = PROMPT_LEN,
            decode_tokens: int = DECODE_TOKENS, warmup: int = WARMUP) -> list[Latency]:
    """Latency of each engine (same model) per the module's rule, measured side by side."""
    spec = engines[0].spec
    prompts = fresh(prompt_len, spec.vocab_size)
    name, time_ms = timer_for(spec.device)
    for eut in engines:  # validated calls: a broken engine fails here with a clear message
        for _ in range(warmup):
            eut.generate([next(prompts)], 1)
            eut.generate([next(prompts)], 1 + decode_tokens)
    prefill: list[list[float]] = [[] for _ in engines]
    decode: list[list[float]] = [[] for _ in engines]
    for repeat in range(repeats):
        order = list(enumerate(engines))
        for i, eut in order if repeat % 2 == 0 else order[::-1]:
            eut.engine.generate([list(next(prompts).ids)], 1)  # untimed: the engine awake after the other's calls
            first, second = list(next(prompts).ids), list(next(prompts).ids)
            one = _timed(eut, time_ms, lambda eut=eut, first=first: eut.engine.generate([first], 1))
            more = _timed(eut, time_ms, lambda eut=eut, second=second: eut.engine.generate([second], 1 + decode_tokens))
            prefill[i].append(one)
            decode[i].append((more - one) / decode_tokens)
    return [Latency(eut.name, eut.spec.name, prompt_len, decode_tokens, name, tuple(p), tuple(d))
            for eut, p, d in zip(engines, prefill, decode)]
