"""``--kv-report-html``: one self-contained HTML page (inline CSS and SVG, no scripts, no downloads).

Per engine: a table (tests, tokens identical / near ties, compiles and recompile reasons, KV bytes
expected vs measured, prefill and decode latency, tokens/s, ratio to hf-eager) and bar charts of
prefill and decode latency per model. Across engines: one chart per model comparing decode latency.
"""

from __future__ import annotations

from html import escape
from typing import Any

from pytest_kvcompile.reports.baseline import Change
from pytest_kvcompile.reports.table import HEADERS, cells, latency_stats, verdicts

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.3em .6em;font-size:.9em;text-align:left}th{background:#f3f3f3}
.bad{color:#b00020}svg{margin:.5em 1em .5em 0}section{margin-bottom:2em}
.verdict{font-weight:bold;padding:.1em .5em;border-radius:.3em;color:#fff}.v-PASS{background:#2e7d32}
.v-FAIL{background:#b00020}.v-known{background:#b26a00}.v-none{background:#666}"""
BAR_HEIGHT, WIDTH, LABEL_WIDTH = 18, 520, 170


def bar_chart(title: str, bars: list[tuple[str, float]], unit: str) -> str:
    """A horizontal bar chart as an inline <svg>: one bar per (label, value)."""
    top = max((v for _, v in bars), default=0) or 1
    height = 28 + BAR_HEIGHT * len(bars)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<text x="0" y="14" font-size="13" font-weight="bold">{escape(title)}</text>']
    for i, (label, value) in enumerate(bars):
        y = 22 + i * BAR_HEIGHT
        length = (WIDTH - LABEL_WIDTH - 90) * value / top
        parts += [f'<text x="0" y="{y + 12}" font-size="11">{escape(label[:28])}</text>',
                  f'<rect x="{LABEL_WIDTH}" y="{y}" width="{length:.1f}" height="{BAR_HEIGHT - 4}" fill="#4a7bd0"/>',
                  f'<text x="{LABEL_WIDTH + length + 4:.1f}" y="{y + 12}" font-size="11">{value:.3g} {escape(unit)}</text>']
    return "".join(parts) + "</svg>"


def _table(rows: list[dict[str, Any]], all_rows: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells(r, all_rows)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _list(title: str, lines: list[str], css: str = "") -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{escape(line)}</li>" for line in lines)
    return f'<h4>{escape(title)} ({len(lines)})</h4><ul class="{css}">{items}</ul>'


def _engine_section(engine: str, rows: list[dict[str, Any]], all_rows: list[dict[str, Any]]) -> str:
    measured = [(r, latency_stats(r)) for r in rows if r["latency"]]
    charts = ""
    if measured:
        charts = (bar_chart(f"{engine}: prefill median", [(r["model"], s[0]["median"]) for r, s in measured], "ms")
                  + bar_chart(f"{engine}: decode median", [(r["model"], s[1]["median"]) for r, s in measured], "ms/token"))
    reasons = [f"{r['model']}: {x}" for r in rows if r["compiles"] for x in r["compiles"]["reasons"]]
    failures = [f"{f['test']}: {f['message']}" for r in rows for f in r["failures"]]
    return (f'<section class="engine" id="engine-{escape(engine)}"><h2>{escape(engine)}</h2>'
            + _table(rows, all_rows) + charts + _list("recompiles after warmup", reasons, "bad")
            + _list("failures", failures, "bad") + _list("near ties", [t for r in rows for t in r["near_ties"]])
            + "</section>")


def render(results: dict[str, Any], changes: list[Change] | None = None) -> str:
    rows = results["rows"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    runs = "".join(f"<li>{escape(', '.join(f'{k}: {v}' for k, v in run.items() if k != 'options'))}</li>"
                   for run in results["runs"])
    baseline = ""
    if changes is not None:
        regressed = [c.line() for c in changes if c.regressed]
        baseline = (f"<h2>Baseline: {len(regressed)} regression(s) in {len(changes)} compared number(s)</h2>"
                    + _list("regressions", regressed, "bad"))
    comparisons = ""
    for model in dict.fromkeys(r["model"] for r in rows):
        bars = [(f"{r['engine']} ({r['device']})", latency_stats(r)[1]["median"]) for r in rows
                if r["model"] == model and r["latency"]]
        if len(bars) > 1:
            comparisons += bar_chart(f"{model}: decode median by engine", bars, "ms/token")
    css = {"PASS": "v-PASS", "FAIL": "v-FAIL", "PASS with known findings": "v-known", "NOT CHECKED": "v-none"}
    summary = "".join(f'<li><span class="verdict {css[v]}">{escape(v)}</span> <a href="#engine-{escape(e)}">'
                      f"{escape(e)}</a>: {escape(c)}</li>" for e, v, c in verdicts(rows, results.get("problems", ())))
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>pytest-kvcompile results</title>"
            f"<style>{STYLE}</style></head><body><h1>pytest-kvcompile results</h1>"
            f'<ul class="verdicts">{summary}</ul><ul>{runs}</ul>{baseline}'
            f"<h2>All engines</h2>{_table(rows, rows)}{comparisons}"
            + "".join(_engine_section(e, [r for r in rows if r["engine"] == e], rows) for e in engines)
            + "</body></html>\n")
