"""The reports' sections, decided once as data: what each list of the terminal summary, the Markdown summary and the
HTML report holds (`sections`); the renderers only format them (a heading, then lines) and choose which to show."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pytest_kvcompile.verdicts.lines import (
    concurrency_line,
    coverage_line,
    eviction_noise_line,
    noise_line,
    router_noise_line,
)
from pytest_kvcompile.verdicts.rows import Row
from pytest_kvcompile.verdicts.run_rules import run_rates

SLOWEST_BUILDS = 5


@dataclass(frozen=True)
class Section:
    """One list of a report: its title, its lines, and which of them are bad (shown red)."""

    title: str
    lines: tuple[str, ...] = ()
    bad: tuple[bool, ...] = ()  # per line (empty: none)

    def __bool__(self) -> bool:
        return bool(self.lines)

    @property
    def heading(self) -> str:
        """The title with its count: where the title says ``{n}``, else after it."""
        n = len(self.lines)
        return self.title.format(n=n) if "{n}" in self.title else f"{self.title} ({n})"


def _engine_model(row: Row) -> str:
    return f"{row.engine} / {row.model}"


@dataclass(frozen=True)
class Sections:
    """Every section of a report's rows (`sections`), empty ones included."""

    measured: Section  # the verdict rules measured per model (16-bit, KV stored lower), eviction rules
    rates: Section  # the run-level rates against the dtype's computations
    fuzz: Section
    speculation: Section
    concurrency: Section
    builds: Section  # the slowest engine builds
    declared: Section  # what was not checked, for declared or known limitations
    recompiles: Section
    near_ties: Section
    failures: Section


def sections(rows: list[Row], max_near_tie_rate: float | None = None,
             label: Callable[[Row], str] = _engine_model) -> Sections:
    """Every section of `rows` (empty ones included; `label` names a row in a line: "engine / model", or the
    model alone on an engine's own page): the rules measured per model, the run-level rates, the fuzzer's walks,
    speculative verify steps, concurrent rounds, the slowest builds, declared limitations, recompiles after warmup,
    near ties and failures."""
    noise = {r.noise_key: r for r in rows if r.noise}
    evictions = {(r.model, r.dtype, r.eviction_policy): r for r in rows if r.eviction_noise}
    routers = {(r.model, r.dtype, r.router_noise.lowered): r for r in rows if r.router_noise}
    rates = [(r, found) for r in rows for found in run_rates(r, max_near_tie_rate) if found.positions]
    builds = sorted((r for r in rows if r.builds), key=lambda r: -r.build_s)[:SLOWEST_BUILDS]
    return Sections(
        measured=Section("verdict rules measured per model ({n}): 16-bit, KV stored lower",
                         tuple([noise_line(r) for _, r in sorted(noise.items())]
                               + [eviction_noise_line(r) for _, r in sorted(evictions.items())]
                               + [router_noise_line(r) for _, r in sorted(routers.items())])),
        rates=Section("run-level rates vs the dtype's equivalent computations",
                      tuple(f"{label(r)} ({r.dtype}): {found.line()}" for r, found in rates),
                      tuple(found.failed for _, found in rates)),
        fuzz=Section("fuzz covering walk", tuple(f"{label(r)}: {coverage_line(r.fuzz_coverage)}"
                                                 for r in rows if r.fuzz_coverage)),
        speculation=Section("speculative decoding, verify steps as reported",
                            tuple(f"{label(r)}: {r.speculation.line()}" for r in rows if r.speculation)),
        concurrency=Section("concurrent requests per round",
                            tuple(f"{label(r)}: {concurrency_line(r.concurrency)}" for r in rows if r.concurrency)),
        builds=Section("slowest engine builds",
                       tuple(f"{r.build_s:8.1f} s  {label(r)}" + (f" ({r.builds} builds)" if r.builds > 1 else "")
                             for r in builds)),
        declared=Section("not checked, declared or known limitations",
                         tuple(sorted({f"{label(r)}: {why}" for r in rows for why in r.declared_skips}))),
        recompiles=Section("recompiles after warmup", tuple(f"{label(r)}: {reason}" for r in rows if r.compiles
                                                            for reason in r.compiles.reasons)),
        near_ties=Section("near ties", tuple(tie for r in rows for tie in r.near_ties)),
        failures=Section("failures", tuple(f.line() for r in rows for f in r.failures)),
    )
