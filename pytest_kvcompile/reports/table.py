"""Cells of the results table, shared by the terminal summary, Markdown and HTML reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_kvcompile.verdicts.rows import stats

REFERENCE_ENGINE = "hf-eager"  # latency ratios are given against it when it ran on the same model, device, dtype
HEADERS = ("engine", "model", "device", "tests", "tokens identical", "near ties", "compiles (build / warmup / after)",
           "KV bytes (expected / measured)", "prefill ms (p90)", "decode ms/token (p90)", "tokens/s",
           f"x {REFERENCE_ENGINE} (prefill / decode)")


def latency_stats(row: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]] | None:
    """(prefill, decode) median/p90 of a row, or None when not measured."""
    lat = row["latency"]
    return (stats(lat["prefill_ms"]), stats(lat["decode_ms_per_token"])) if lat else None


def tokens_per_s(row: dict[str, Any]) -> float | None:
    found = latency_stats(row)
    return 1e3 / found[1]["median"] if found and found[1]["median"] > 0 else None


def reference_ratio(row: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(prefill, decode) median ratios of `row` to REFERENCE_ENGINE on the same model, device and dtype."""
    mine = latency_stats(row)
    ref = next((r for r in rows if r["engine"] == REFERENCE_ENGINE and r is not row and r["latency"]
                and (r["model"], r["device"], r["dtype"]) == (row["model"], row["device"], row["dtype"])), None)
    if not mine or ref is None:
        return None
    theirs = latency_stats(ref)
    return mine[0]["median"] / theirs[0]["median"], mine[1]["median"] / theirs[1]["median"]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """One formatted line of HEADERS for `row` (`rows`: all rows, for the reference ratio)."""
    tests = ", ".join(f"{n} {name}" for name, n in row["tests"].items() if n) or "-"
    tokens = row["tokens"]
    checked = sum(tokens.values())
    identical = f"{tokens['identical']}/{checked}" if checked else "-"
    near = str(row.get("near_tie_tokens", tokens["near_tie"])) if checked else "-"
    comp = row["compiles"]
    compiles = f"{comp.get('build', 0)} / {comp['warmup']} / {comp['after_warmup']}" if comp else "-"
    captured = (comp or {}).get("cuda_graph_captures") or {}
    if any(captured.values()):
        compiles += (f"; CUDA graphs {captured.get('build', 0)} / {captured.get('warmup', 0)} / "
                     f"{captured.get('after_warmup', 0)}")
    kv = row["kv_bytes"]
    kv_cell = f"{human_bytes(kv['expected'])} / {human_bytes(kv['measured'])}" if kv else "-"
    lat = latency_stats(row)
    prefill = f"{lat[0]['median']:.3f} ({lat[0]['p90']:.3f})" if lat else "-"
    decode = f"{lat[1]['median']:.3f} ({lat[1]['p90']:.3f})" if lat else "-"
    tps = tokens_per_s(row)
    ratio = reference_ratio(row, rows)
    return (row["engine"], row["model"], f"{row['device']} {row['dtype']}", tests, identical, near, compiles, kv_cell,
            prefill, decode, f"{tps:.1f}" if tps else "-", f"{ratio[0]:.2f} / {ratio[1]:.2f}" if ratio else "-")


def text_table(rows: list[dict[str, Any]]) -> list[str]:
    """A fixed-width table for the terminal."""
    lines = [HEADERS] + [cells(r, rows) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADERS))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]


def verdicts(rows: list[dict[str, Any]], problems: Sequence[dict[str, Any]] = ()) -> list[tuple[str, str, str]]:
    """(engine, verdict, counts) per engine, the first thing every report says.

    FAIL: a test failed or errored on any model, or a run rule (`problems`: Problem.to_dict(), e.g. no token
    verified) names the engine in its field (listed first). PASS with known findings: nothing failed, and strict
    xfails absorbed the failures its known findings name. PASS: tests ran and none failed. NOT CHECKED: every test
    was skipped."""
    found = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine]
        counts = {name: sum(r["tests"].get(name, 0) for r in mine) for name in mine[0]["tests"]}
        if not any(counts.values()):  # only measured for others (a relative latency budget's reference engine)
            continue
        ruled = sum(p["engine"] == engine for p in problems)
        ran = sum(n for name, n in counts.items() if name != "skipped")
        if counts.get("failed") or counts.get("error") or counts.get("xpassed") or ruled:
            verdict = "FAIL"
        elif not ran:
            verdict = "NOT CHECKED"
        elif counts.get("xfailed"):
            verdict = "PASS with known findings"
        else:
            verdict = "PASS"
        shown = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
        models = len({r["model"] for r in mine})
        rule = f", {ruled} run rule(s) failed" if ruled else ""
        unjudged = sorted({r["model"] for r in mine if r.get("oracle_errors")})
        if unjudged:  # skips, named: the oracle failed its self-check there (oracles/store.py)
            rule += f", not judged on {', '.join(unjudged)} (oracle unreliable)"
        excluded = sorted({i for r in mine for i in r.get("excluded_ids", [])})
        if excluded:  # Declaration.never_emits: named, with the steps it decided
            steps = sum(r.get("excluded_tokens", 0) for r in mine)
            rule += (f"; ids {excluded} out of the oracle's choice (declared never emitted), "
                     f"decided {steps} step(s)")
        oracles = [r["oracle"] for r in mine if r.get("oracle") and r["oracle"]["engine"]]
        if oracles:  # an engine as the oracle (oracles/engine.py): which, and what it could not judge
            limits = list(dict.fromkeys(x for o in oracles for x in o["limitations"]))
            rule += f"; against {oracles[0]['source']}" + "".join(f"; {x}" for x in limits)
        found.append((engine, verdict, f"{shown or 'no tests'}{rule} ({models} model{'s' if models != 1 else ''})"))
    order = ("FAIL", "NOT CHECKED", "PASS with known findings", "PASS")
    return sorted(found, key=lambda f: order.index(f[1]))  # failures first


def verdict_lines(rows: list[dict[str, Any]], problems: Sequence[dict[str, Any]] = ()) -> list[str]:
    """``FAIL  engine: 2 failed, 40 passed (3 models)``, one per engine, verdicts aligned."""
    found = verdicts(rows, problems)
    width = max((len(v) for _, v, _ in found), default=0)
    return [f"{verdict.ljust(width)}  {engine}: {counts}" for engine, verdict, counts in found]
