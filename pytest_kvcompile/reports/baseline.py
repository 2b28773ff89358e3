"""``--kv-baseline=FILE`` with ``--kv-fail-on=latency:10%,memory:5%,recompiles:0``.

Rows of the baseline and of this run are matched by (engine, model, device, dtype). A run
regresses when, on a matched row:

- ``latency:P%``: the prefill or the decode median grew by more than P percent;
- ``memory:P%``: the measured KV-cache bytes grew by more than P percent;
- ``recompiles:N``: compiles after warmup grew by more than N.

A name left out of ``--kv-fail-on`` is not checked. Rows only in one side are listed, never failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvcompile.verdicts.results import Results
from pytest_kvcompile.verdicts.rows import Row

SYNTAX = "latency:10%,memory:5%,recompiles:0"
PERCENT_NAMES = ("latency", "memory")
COUNT_NAMES = ("recompiles",)


def parse_fail_on(spec: str) -> dict[str, float]:
    """{name: allowed growth} (percent for latency and memory, a count for recompiles); ValueError naming the syntax."""
    found: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = (s.strip() for s in part.partition(":"))
        if not sep or name not in PERCENT_NAMES + COUNT_NAMES:
            raise ValueError(f"{part!r}: expected NAME:LIMIT with NAME one of "
                             f"{', '.join(PERCENT_NAMES + COUNT_NAMES)}, "
                             f"e.g. {SYNTAX}")
        number = value.removesuffix("%") if name in PERCENT_NAMES else value
        try:
            limit = float(number) if name in PERCENT_NAMES else int(number)
        except ValueError:
            limit = -1
        if name in PERCENT_NAMES and not value.endswith("%") or limit < 0:
            wanted = "a percentage such as 10%" if name in PERCENT_NAMES else "a whole number such as 0"
            raise ValueError(f"{part!r}: {name} takes {wanted}, e.g. {SYNTAX}")
        found[name] = limit
    if not found:
        raise ValueError(f"nothing to check; e.g. {SYNTAX}")
    return found


@dataclass(frozen=True)
class Change:
    check: str  # latency, memory, recompiles
    where: str
    what: str
    old: float
    new: float
    limit: float | None  # None: not checked (its name is not in --kv-fail-on); shown, never failed

    @property
    def checked(self) -> bool:
        return self.limit is not None

    @property
    def regressed(self) -> bool:
        if self.limit is None:
            return False
        if self.check in PERCENT_NAMES:
            return self.new > self.old * (1 + self.limit / 100)
        return self.new - self.old > self.limit

    @property
    def improved(self) -> bool:
        """Moved the good way by more than the limit would allow the bad way (checked numbers only)."""
        if self.limit is None:
            return False
        if self.check in PERCENT_NAMES:
            return self.new < self.old * (1 - self.limit / 100)
        return self.old - self.new > self.limit

    @property
    def growth(self) -> str:
        if self.check in PERCENT_NAMES:
            return f"{(self.new / self.old - 1) * 100:+.1f}%" if self.old else "from zero"
        return f"{self.new - self.old:+g}"

    @property
    def allowed(self) -> str:
        if self.limit is None:
            return "not checked"
        return f"allowed +{self.limit:g}{'%' if self.check in PERCENT_NAMES else ''}"

    def line(self) -> str:
        fmt = "{:.4g}" if self.check in PERCENT_NAMES else "{:g}"
        return (f"{self.check}: {self.where}: {self.what} {fmt.format(self.old)} -> {fmt.format(self.new)} "
                f"({self.growth}, {self.allowed})")


def _numbers(row: Row) -> dict[str, tuple[str, float]]:
    """check name + what -> value, for the numbers a row has."""
    found = {}
    if row.latency:
        found["latency/prefill"] = ("prefill median ms", row.latency.prefill.median)
        found["latency/decode"] = ("decode median ms/token", row.latency.decode.median)
    if row.kv_bytes:
        found["memory/kv"] = ("KV-cache bytes", row.kv_bytes.measured)
    if row.compiles:
        found["recompiles/after"] = ("compiles after warmup", row.compiles.after_warmup)
    return found


def compare(baseline: Results, current: Results, fail_on: dict[str, float]) -> tuple[list[Change], list[str]]:
    """(every number of matched rows, old -> new, with fail_on's limit where it names the check; notes on rows that
    could not be matched)."""
    old_rows = {r.key: r for r in baseline.rows}
    new_rows = {r.key: r for r in current.rows}
    changes, notes = [], []
    for k in sorted(old_rows.keys() | new_rows.keys()):
        where = " / ".join(k)
        if k not in new_rows or k not in old_rows:
            notes.append(f"{where}: only in the {'baseline' if k in old_rows else 'current run'}")
            continue
        old, new = _numbers(old_rows[k]), _numbers(new_rows[k])
        for name in sorted(old.keys() & new.keys()):
            check = name.split("/")[0]
            changes.append(Change(check, where, new[name][0], old[name][1], new[name][1], fail_on.get(check)))
    return changes, notes
