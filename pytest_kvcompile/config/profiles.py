"""Profiles (``--kv-profile``): how much of the suites a run spends, as hypothesis has its profiles (issue 54).

A checkpoint of billions of parameters on one GPU cannot take the whole suite on every pull request; its nightly run
can. A profile narrows the checks and the prompts; it never widens what passes, and the run's summary names what it
left out (a smaller profile is a choice, not a silent pass). The default, ``full``, is every check on every prompt.

- ``full``: everything (the default).
- ``ci``: every check but the longest ones: the long generations (hundreds of steps per model), the call histories,
  the near-tie rate's power check and the latency budgets (the 16-bit run-level rates then have less power: the
  summary says so through the near-tie rate's own line).
- ``smoke``: the token checks a cache bug breaks first, on three prompts (1, 7 and 48 tokens): token identity alone
  and batched, stale state, batch consistency, and the recompile and KV-footprint checks. Its 16-bit calibration
  measures the noise only as far as those checks attend (`attends`): the long calibration prompts (256 and 990
  tokens, a third of a 3B checkpoint's smoke run on a CPU) are left out where they attend no farther; a sequence
  judged past what was calibrated is then a named skip, never judged by a noise measured on shorter ones.

A run narrowed otherwise (``-k token_identity``, ``-m``, node ids) calibrates as far as the checks it selected attend
where every one of them is a check of bounded length (`BOUNDED`: smoke's), on the prompts it selected (`Selection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """`keeps`: the check functions run (None: all but `leaves_out`); `prompts`: the prompt names parametrized tests run
    on (None: all)."""

    name: str
    description: str
    leaves_out: tuple[str, ...] = ()
    keeps: tuple[str, ...] | None = None
    prompts: tuple[str, ...] | None = None
    calibrates_all: bool = True  # the 16-bit noise measured at every length (else as far as `attends`)

    def runs(self, check: str) -> bool:
        """Whether the check function named `check` (a test function's name, parameters stripped) runs."""
        if self.keeps is not None:
            return check in self.keeps
        return check not in self.leaves_out

    def runs_prompt(self, prompt: str | None) -> bool:
        return prompt is None or self.prompts is None or prompt in self.prompts

    def attends(self, prompts: dict[str, int], batch: Sequence[int], new_tokens: int,
                selection: Selection | None = None) -> int | None:
        """The most positions this profile's token checks attend (its prompts of the model's `prompts`, name ->
        length, the model's `batch` lengths and the stale-state check's prompts of at most 64 tokens, plus
        `new_tokens`), of the run's `selection` alone where it has only checks of bounded length; None: every length
        (a run of the long checks)."""
        bounded = selection is not None and selection.bounded
        if self.calibrates_all and not bounded:
            return None
        kept = [n for name, n in prompts.items() if self.runs_prompt(name)
                and (not bounded or name in selection.prompts)]
        return max([*kept, *batch, min(64, max(prompts.values(), default=0))]) + new_tokens


@dataclass(frozen=True)
class Selection:
    """The engine checks a run selected, after -k, -m and the profile: the check functions' names and the prompts of
    those parametrized by one. `bounded`: every one attends its prompt (or the model's batch, or a stale-state
    prompt) plus the new tokens alone (`BOUNDED`), so the calibration need not reach the longest lengths."""

    checks: frozenset[str]
    prompts: frozenset[str]

    @property
    def bounded(self) -> bool:
        return bool(self.checks) and self.checks <= BOUNDED


PROFILES = {p.name: p for p in (
    Profile("full", "every check on every prompt (the default)"),
    Profile("ci", "every check but the long generations, call histories, the near-tie rate's power check and latency",
            leaves_out=("test_long_generation", "test_long_generation_batched", "test_single_after_each_batch_size",
                        "test_same_batch_size_new_length_mix", "test_near_tie_rate", "test_latency", "test_benchmark")),
    Profile("smoke", "token identity, stale state, batch consistency, recompiles and the KV footprint on prompts of "
                     "1, 7 and 48 tokens",
            keeps=("test_token_identity", "test_token_identity_batched", "test_stale_state", "test_batch_consistency",
                   "test_no_recompiles_after_warmup", "test_identical_calls_compile_nothing", "test_kv_cache_bytes",
                   "test_kv_cache_bytes_batched"),
            prompts=("len1", "short7", "long48"), calibrates_all=False),
)}
DEFAULT = "full"
#: the checks whose sequences are their prompt (or the model's batch, or a stale-state prompt of at most 64 tokens)
#: plus the new tokens: smoke's
BOUNDED = frozenset(PROFILES["smoke"].keeps or ())
