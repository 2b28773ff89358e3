"""Eviction engines for the project's own tests (tests/test_eviction.py).

The reference engines of reference_impls/eviction_engine.py on the "eager" compile backend
(an import-path engine gets no --kv-compile-backend), three that carry one bug each while
declaring the correct strategy, so the suite must hold them to the right oracle and fail them,
and TOVANudged, which breaks near-tied eviction choices the other way (correct by the near-tie rule).
"""

from dataclasses import dataclass

from pytest_kvcompile.oracles import eviction
from reference_impls import eviction_engine


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


class StreamingLLMShifted(_Eager, eviction_engine.StreamingLLMShifted):
    pass


NUDGE = 1e-2  # TOVANudged moves every score by NUDGE / 2 of itself


@dataclass(frozen=True)
class _Nudged(eviction.TOVA):
    def score(self, prev, weights, pos, keys=None):
        return super().score(prev, weights, pos) * (1 + NUDGE / 2 * (pos % 2 * 2 - 1))  # odd positions up, even down


def tova_nudged(spec, nudge: float) -> TOVA:
    """TOVA(16) with every score moved by `nudge` / 2 of itself (odd positions up, even down): cuts nearer than
    `nudge` (relative) may go the other way (the 16-bit twins of the measured eviction tolerance)."""

    @dataclass(frozen=True)
    class Nudged(eviction.TOVA):
        def score(self, prev, weights, pos, keys=None):
            return super().score(prev, weights, pos) * (1 + nudge / 2 * (pos % 2 * 2 - 1))

    engine = TOVA(spec)
    engine.policy = Nudged(engine.policy.budget)
    return engine


class TOVANudged(TOVA):
    """Correct within the near-tie rule for a relative score tolerance of NUDGE: TOVA(16) with every score moved
    by NUDGE / 2 of itself (odd positions up, even down), so cuts nearer than NUDGE may go the other way."""

    def __init__(self, spec):
        super().__init__(spec)
        self.policy = _Nudged(self.policy.budget)


@dataclass(frozen=True)
class _Inverted(eviction.TOVA):
    def score(self, prev, weights, pos, keys=None):
        return -super().score(prev, weights, pos)


class TOVAEvictsTheMostAttended(TOVA):
    """Bug: declares tova(budget=16) but evicts the HIGHEST score (the most attended token)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.policy = _Inverted(self.policy.budget)


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("H2OForgetsRecent", "StreamingLLMWithoutSinks", "TOVAEvictsTheMostAttended")
MUST_PASS = ("LastRecent", "StreamingLLM", "H2O", "TOVA", "StreamingLLMShifted", "TOVANudged")
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("tova_nudged",)
