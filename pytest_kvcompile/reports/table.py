"""Cells of the results table, shared by the terminal summary, Markdown and HTML reports."""

from __future__ import annotations

from collections.abc import Sequence

from pytest_kvcompile.errors import COULD_NOT_RUN
from pytest_kvcompile.verdicts.failures import Problem
from pytest_kvcompile.verdicts.rows import Outcomes, Row

REFERENCE_ENGINE = "hf-eager"  # latency ratios are given against it when it ran on the same model, device, dtype
HEADERS = ("engine", "model", "device", "tests", "tokens identical", "near ties", "compiles (build / warmup / after)",
           "KV bytes (expected / measured)", "prefill ms (p90)", "decode ms/token (p90)", "tokens/s",
           f"x {REFERENCE_ENGINE} (prefill / decode)")


def tokens_per_s(row: Row) -> float | None:
    return row.latency.tokens_per_s if row.latency else None


def reference_ratio(row: Row, rows: list[Row]) -> tuple[float, float] | None:
    """(prefill, decode) median ratios of `row` to REFERENCE_ENGINE on the same model, device and dtype."""
    ref = next((r for r in rows if r.engine == REFERENCE_ENGINE and r is not row and r.latency
                and (r.model, r.device, r.dtype) == (row.model, row.device, row.dtype)), None)
    if not row.latency or ref is None:
        return None
    return (row.latency.prefill.median / ref.latency.prefill.median,
            row.latency.decode.median / ref.latency.decode.median)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def cells(row: Row, rows: list[Row]) -> tuple[str, ...]:
    """One formatted line of HEADERS for `row` (`rows`: all rows, for the reference ratio)."""
    tests = ", ".join(f"{n} {name}" for name, n in row.tests.items() if n) or "-"
    checked = row.tokens.checked
    identical = f"{row.tokens.identical}/{checked}" if checked else "-"
    near = str(row.near_tie_tokens) if checked else "-"
    comp = row.compiles
    compiles = f"{comp.build} / {comp.warmup} / {comp.after_warmup}" if comp else "-"
    if comp and any(comp.cuda_graph_captures.values()):
        compiles += (f"; CUDA graphs {comp.captures('build')} / {comp.captures('warmup')} / "
                     f"{comp.captures('after_warmup')}")
    kv = row.kv_bytes
    kv_cell = f"{human_bytes(kv.expected)} / {human_bytes(kv.measured)}" if kv else "-"
    lat = row.latency
    prefill = f"{lat.prefill.median:.3f} ({lat.prefill.p90:.3f})" if lat else "-"
    decode = f"{lat.decode.median:.3f} ({lat.decode.p90:.3f})" if lat else "-"
    tps = tokens_per_s(row)
    ratio = reference_ratio(row, rows)
    return (row.engine, row.model, f"{row.device} {row.dtype}", tests, identical, near, compiles, kv_cell,
            prefill, decode, f"{tps:.1f}" if tps else "-", f"{ratio[0]:.2f} / {ratio[1]:.2f}" if ratio else "-")


def text_table(rows: list[Row]) -> list[str]:
    """A fixed-width table for the terminal."""
    lines = [HEADERS] + [cells(r, rows) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADERS))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]


def verdicts(rows: list[Row], problems: Sequence[Problem] = ()) -> list[tuple[str, str, str]]:
    """(engine, verdict, counts) per engine, the first thing every report says.

    FAIL: a test failed or errored on any model, or a run rule (`problems`, e.g. no token verified) names the engine
    in its field (listed first). PASS with known findings: nothing failed, and strict xfails absorbed the failures its
    known findings name. PASS: tests ran and none failed. NOT CHECKED: every test was skipped."""
    found = []
    for engine in dict.fromkeys(r.engine for r in rows):
        mine = [r for r in rows if r.engine == engine]
        counts = Outcomes()
        for r in mine:
            counts.merge(r.tests)
        if not any(n for _, n in counts.items()):  # only measured for others (a relative latency budget's reference)
            continue
        ruled = sum(p.engine == engine for p in problems)
        if counts.failed or counts.error or counts.xpassed or ruled:
            verdict = "FAIL"
        elif not counts.ran:
            verdict = "NOT CHECKED"
        elif counts.xfailed:
            verdict = "PASS with known findings"
        else:
            verdict = "PASS"
        shown = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
        models = len({r.model for r in mine})
        rule = f", {ruled} run rule(s) failed" if ruled else ""
        unjudged = sorted({r.model for r in mine if r.oracle_errors})
        if unjudged:  # skips, named: the oracle failed its self-check there, or could not run (oracles/store.py)
            rule += ", not judged on " + ", ".join(f"{m} ({_unjudged(mine, m)})" for m in unjudged)
        excluded = sorted({i for r in mine for i in r.excluded_ids})
        if excluded:  # Declaration.never_emits: named, with the steps it decided
            steps = sum(r.excluded_tokens for r in mine)
            rule += (f"; ids {excluded} out of the oracle's choice (declared never emitted), "
                     f"decided {steps} step(s)")
        oracles = [r.oracle for r in mine if r.oracle and r.oracle.engine]
        if oracles:  # an engine as the oracle (oracles/engine.py): which, and what it could not judge
            limits = list(dict.fromkeys(x for o in oracles for x in o.limitations))
            rule += f"; against {oracles[0].source}" + "".join(f"; {x}" for x in limits)
        found.append((engine, verdict, f"{shown or 'no tests'}{rule} ({models} model{'s' if models != 1 else ''})"))
    order = ("FAIL", "NOT CHECKED", "PASS with known findings", "PASS")
    return sorted(found, key=lambda f: order.index(f[1]))  # failures first


def _unjudged(rows: list[Row], model: str) -> str:
    """Why an engine's token checks on `model` were not judged, in a verdict line: the oracle could not run there, or
    failed its self-check."""
    errors = [e for r in rows if r.model == model for e in r.oracle_errors]
    return COULD_NOT_RUN if any(e.startswith(COULD_NOT_RUN) for e in errors) else "oracle unreliable"


def verdict_lines(rows: list[Row], problems: Sequence[Problem] = ()) -> list[str]:
    """``FAIL  engine: 2 failed, 40 passed (3 models)``, one per engine, verdicts aligned."""
    found = verdicts(rows, problems)
    width = max((len(v) for _, v, _ in found), default=0)
    return [f"{verdict.ljust(width)}  {engine}: {counts}" for engine, verdict, counts in found]
