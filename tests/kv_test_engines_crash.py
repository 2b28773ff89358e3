"""Engines that crash or hang on one prompt length and are correct otherwise, for the isolation and
--kv-call-timeout tests (tests/test_isolation.py). The bad length is 7 (zoo prompt 'short7')."""

import ctypes
import dataclasses
import os
import time

from kv_test_engines import CompiledGreedy, Greedy, RecompilingGreedy, StaleCache
from pytest_kvcompile import Declaration

BAD_LENGTH = 7


def _hit(prompts) -> bool:
    return any(len(p) == BAD_LENGTH for p in prompts)


class Segfaults(Greedy):
    """Bug: reads address 0 (SIGSEGV) on a 7-token prompt, as a native runtime with a bad buffer would."""

    kv_declaration = Declaration(batching=True, isolated=True, description="test engine: segfaults on short7")

    def generate(self, prompts, max_new_tokens):
        if _hit(prompts):
            ctypes.string_at(0)
        return super().generate(prompts, max_new_tokens)


class Aborts(Segfaults):
    """Bug: abort() (SIGABRT) on a 7-token prompt, as a failed C++ assertion would."""

    def generate(self, prompts, max_new_tokens):
        if _hit(prompts):
            os.abort()
        return super().generate(prompts, max_new_tokens)


class Hangs(Greedy):
    """Bug: never returns on a 7-token prompt (a deadlock); not isolated unless the run says so."""

    kv_declaration = Declaration(batching=True, description="test engine: hangs on short7")

    def generate(self, prompts, max_new_tokens):
        if _hit(prompts):
            while True:
                time.sleep(3600)
        return super().generate(prompts, max_new_tokens)


class SwallowsEverything(Hangs):
    """Bug: hangs, and catches every Exception around its loop (the timeout must still get out)."""

    def generate(self, prompts, max_new_tokens):
        while True:
            try:
                return super().generate(prompts, max_new_tokens)
            except Exception:
                continue


class AbortsOnThirdCall(Greedy):
    """Bug: abort() in its third generate() (a failed C++ assertion), declaring nothing about isolation: under the
    default --kv-isolate=auto it runs in a process of its own, as every engine that is not built-in."""

    kv_declaration = Declaration(batching=True, description="test engine: aborts on its third call")
    calls = 0

    def generate(self, prompts, max_new_tokens):
        self.calls += 1
        if self.calls == 3:
            os.abort()
        return super().generate(prompts, max_new_tokens)


class AbortsInProcess(AbortsOnThirdCall):
    """The same, declaring isolated=False (trusted to run in the pytest process): the abort kills the run, and the
    reports written so far must survive it, naming the call."""

    kv_declaration = Declaration(batching=True, isolated=False, description="test engine: aborts, in process")


class HangsInC(Greedy):
    """Bug: deadlocks in native code on a 7-token prompt (a non-recursive pthread mutex locked twice): no Python
    signal handler ever runs there, so only killing its process stops it. Declares nothing about isolation."""

    kv_declaration = Declaration(batching=True, description="test engine: deadlocks in C on short7")

    def generate(self, prompts, max_new_tokens):
        if _hit(prompts):
            libc = ctypes.CDLL(None)
            mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
            libc.pthread_mutex_lock(mutex)
            libc.pthread_mutex_lock(mutex)  # never returns
        return super().generate(prompts, max_new_tokens)


class IsolatedCompiled(CompiledGreedy):
    """Correct and compiled, run in its own process: its compiles must still be observed there."""

    kv_declaration = dataclasses.replace(CompiledGreedy.kv_declaration, isolated=True)


class IsolatedRecompiling(RecompilingGreedy):
    """Bug (recompiles after warmup), run in its own process: the recompile check must still fail it."""

    kv_declaration = dataclasses.replace(RecompilingGreedy.kv_declaration, isolated=True)


class IsolatedStaleCache(StaleCache):
    """Bug (cache never reset), run in its own process: state kept between forwarded calls is still caught."""

    kv_declaration = dataclasses.replace(StaleCache.kv_declaration, isolated=True)


class ForksThenSegfaults(Segfaults):
    """Forks a helper that sleeps (a worker pool), then segfaults on short7: the helper must not hide the crash."""

    def __init__(self, spec):
        super().__init__(spec)
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("Segfaults", "Aborts", "Hangs", "SwallowsEverything", "AbortsOnThirdCall", "AbortsInProcess",
    "HangsInC", "IsolatedRecompiling", "IsolatedStaleCache", "ForksThenSegfaults")
MUST_PASS = ("IsolatedCompiled",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
