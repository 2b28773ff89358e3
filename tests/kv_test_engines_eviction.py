"""Eviction engines for the project's own tests (tests/test_eviction.py).

The reference engines of reference_impls/eviction_engine.py on the "eager" compile backend
(an import-path engine gets no --kv-compile-backend), and two that carry one bug each while
declaring the correct strategy, so the suite must hold them to the right oracle and fail them.
"""

from dataclasses import dataclass

from reference_impls import eviction, eviction_engine


class _Eager:
    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")


class LastRecent(_Eager, eviction_engine.LastRecent):
    pass


class StreamingLLM(_Eager, eviction_engine.StreamingLLM):
    pass


class H2O(_Eager, eviction_engine.H2O):
    pass


class TOVA(_Eager, eviction_engine.TOVA):
    pass


@dataclass(frozen=True)
class _H2OWithoutRecent(eviction.H2O):
    def protected(self, pos, newest):
        return pos < -1  # bug: nothing protected, the recent window competes on score


class H2OForgetsRecent(H2O):
    """Bug: declares h2o(heavy=8, recent=8) but never protects the recent window."""

    def __init__(self, spec):
        super().__init__(spec)
        self.policy = _H2OWithoutRecent(self.policy.heavy, self.policy.recent)


class StreamingLLMWithoutSinks(StreamingLLM):
    """Bug: declares streaming_llm(sinks=4, recent=12) but keeps the last 16 tokens (no sinks)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.policy = eviction.LastRecent(self.policy.budget)
