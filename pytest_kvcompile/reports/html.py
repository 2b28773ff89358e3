"""``--kv-report-html``: one self-contained HTML page (inline CSS and SVG, no scripts, no downloads).

Top: one verdict per engine, then (with ``--kv-baseline``) every compared number old -> new with its change and
threshold, regressions first. Per engine: the results table, latency medians and distributions (every timed
repeat), and per model a compile timeline (build / warmup / after-warmup compiles over the recompile check's calls,
each with its frame and failed guards), KV bytes per layer (expected by the declared layout vs measured), and per
failure its message with, for a token mismatch, the token diff: oracle and engine aligned, the first divergence
highlighted, the logit gap against the tolerance, the oracle's top-3 and the hint.
"""

from __future__ import annotations

from html import escape

from pytest_kvcompile.reports.baseline import Change
from pytest_kvcompile.reports.live import status_lines
from pytest_kvcompile.reports.sections import Section, sections
from pytest_kvcompile.reports.table import HEADERS, cells, verdicts
from pytest_kvcompile.verdicts.failures import Failure
from pytest_kvcompile.verdicts.results import Results
from pytest_kvcompile.verdicts.rows import FailureEntry, KVBytes, Row, TimelineCall, stats

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.3em .6em;font-size:.9em;text-align:left}th{background:#f3f3f3}
.bad{color:#b00020}svg{margin:.5em 1em .5em 0}section{margin-bottom:2em}
.verdict{font-weight:bold;padding:.1em .5em;border-radius:.3em;color:#fff}.v-PASS{background:#2e7d32}
.v-FAIL{background:#b00020}.v-known{background:#b26a00}.v-none{background:#666}
.diff td{font-family:ui-monospace,monospace;text-align:center;padding:.15em .3em}.diff th{font-weight:normal}
.diff .off{background:#fde0e0}.diff .first{background:#b00020;color:#fff;font-weight:bold}.diff .tie{background:#fff3cd}
.timeline{display:flex;flex-wrap:wrap;gap:.3em;margin:.5em 0}\
.call{border:1px solid #ccc;border-radius:.3em;padding:.2em .4em;
font-size:.8em;min-width:7em}.call.build{background:#eef}.call.warmup{background:#f3f3f3}.call.after{background:#eaf6ea}
.call.after.compiled{background:#fde0e0;border-color:#b00020}.call b{display:block}details{margin:.3em 0}
pre{white-space:pre-wrap;font-size:.8em;background:#f8f8f8;padding:.5em}.improved{color:#2e7d32}"""
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
                  f'<text x="{LABEL_WIDTH + length + 4:.1f}" y="{y + 12}" font-size="11">'
                  f'{value:.3g} {escape(unit)}</text>']
    return "".join(parts) + "</svg>"


def _table(rows: list[Row], all_rows: list[Row]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells(r, all_rows)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _list(section: Section, css: str = "") -> str:
    if not section:
        return ""
    items = "".join(f"<li>{escape(line)}</li>" for line in section.lines)
    return f'<h4>{escape(section.heading)}</h4><ul class="{css}">{items}</ul>'


def strip_chart(title: str, series: list[tuple[str, list[float]]], unit: str) -> str:
    """Every sample as a dot on one line per (label, samples), the median as a bar: a distribution, not a number."""
    top = max((v for _, values in series for v in values), default=0) or 1
    height = 28 + BAR_HEIGHT * len(series)
    span = WIDTH - LABEL_WIDTH - 90
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH + 70}" height="{height}" role="img" '
             f'aria-label="{escape(title)}" class="distribution"><title>{escape(title)}</title>',
             f'<text x="0" y="14" font-size="13" font-weight="bold">{escape(title)}</text>']
    for i, (label, values) in enumerate(series):
        y = 22 + i * BAR_HEIGHT + 7
        median = stats(values).median
        parts.append(f'<text x="0" y="{y + 4}" font-size="11">{escape(label[:28])}</text>')
        parts.append(f'<line x1="{LABEL_WIDTH}" x2="{LABEL_WIDTH + span}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        parts += [f'<circle cx="{LABEL_WIDTH + span * v / top:.1f}" cy="{y}" r="3" fill="#4a7bd0" fill-opacity=".6">'
                  f"<title>{v:.4g} {escape(unit)}</title></circle>" for v in values]
        x = LABEL_WIDTH + span * median / top
        parts += [f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y - 6}" y2="{y + 6}" stroke="#b00020" stroke-width="2"/>',
                  f'<text x="{LABEL_WIDTH + span + 4}" y="{y + 4}" font-size="11">{median:.3g} {escape(unit)} '
                  f"(n={len(values)})</text>"]
    return "".join(parts) + "</svg>"


def token_diff(failure: Failure) -> str:
    """Oracle and engine tokens aligned by step; the first real divergence highlighted, near ties marked."""
    ties = {t[0] for t in failure.near_ties}
    step, oracle, engine = failure.step, failure.oracle, failure.tokens

    def cell(i: int, token: int, mine: bool) -> str:
        off = mine and i < len(oracle) and oracle[i] != token
        css = "first" if i == step else "tie" if i in ties else "off" if off else ""
        return f'<td class="{css}">{token}</td>'

    head = "".join(f"<th>{i}</th>" for i in range(max(len(oracle), len(engine))))
    rows = (f"<tr><th>step</th>{head}</tr>"
            + "<tr><th>oracle</th>" + "".join(cell(i, t, False) for i, t in enumerate(oracle)) + "</tr>"
            + "<tr><th>engine</th>" + "".join(cell(i, t, True) for i, t in enumerate(engine)) + "</tr>")
    where = failure.where.describe()
    facts = [f"{escape(failure.prompt)} (length {failure.prompt_length}, ends ...{list(failure.prompt_tail)})"
             f"{', ' + escape(where) if where else ''}; {escape(failure.kind.value)}"]
    if step is not None and failure.gap is None:  # an engine oracle without score(): equality is the rule
        facts.append(f"first divergence at step {step}: oracle {oracle[step]}, engine {engine[step]}; the oracle has "
                     "no logits (no score()), so every token must be equal")
    elif step is not None:
        allowed = max(failure.allowed or 0.0, failure.tolerance or 0.0)
        facts.append(f"first divergence at step {step}: "
                     f"oracle {failure.expected if failure.expected is not None else oracle[step]}, "
                     f"engine {engine[step]}; logit gap {failure.gap:.4g} &gt; {allowed:.4g} allowed (tie tolerance "
                     f"{failure.tolerance:g})")
        facts.append("oracle top-3 there: " + ", ".join(f"{t} ({v:.4g})" for t, v in failure.top3))
    facts += [f"near tie at step {s}: {e} vs {g}, gap {gap:.3g}" for s, e, g, gap in failure.near_ties]
    facts.append(f"hint: {escape(failure.hint)}")
    return (f'<div class="token-diff"><table class="diff">{rows}</table><ul>'
            + "".join(f"<li>{fact}</li>" for fact in facts) + "</ul></div>")


def compile_timeline(model: str, timeline: list[TimelineCall]) -> str:
    """One box per phase/call of the recompile check: its compiles, each with frame and failed guards."""
    boxes = []
    for entry in timeline:
        phase = {"build": "build", "warmup": "warmup"}.get(entry.phase, "after")
        compiled = " compiled" if entry.compiles else ""
        inner = "".join(
            f"<details><summary>{'re' if c.recompile else ''}compile {escape(c.id)}: {escape(c.frame)}"
            "</summary>" + "".join(f"<pre>guard failed: {escape(g)}</pre>" for g in c.guards)
            + (f"<div>{c.graph_breaks} graph break(s)</div>" if c.graph_breaks else "") + "</details>"
            for c in entry.compiles)
        boxes.append(f'<div class="call {phase}{compiled}"><b>{escape(entry.phase)}: {len(entry.compiles)} '
                     f'compile(s)</b>{escape(entry.call)}{inner}</div>')
    return f'<h4>compile timeline: {escape(model)}</h4><div class="timeline">{"".join(boxes)}</div>'


def kv_layers(model: str, kv: KVBytes) -> str:
    """Expected bytes per layer (the declared layout) against the measured total."""
    measured = kv.measured
    rows = "".join(f"<tr><td>{t.layer}</td><td>{escape(t.kind)}</td><td>{t.positions}</td>"
                   f"<td>{escape(t.why)}</td><td>{t.bytes:,}</td></tr>" for t in kv.layers)
    expected = kv.expected
    verdict = ("matches" if expected == measured else
               f'<span class="bad">differs by {measured - expected:+,} B</span>') if expected is not None else ""
    return (f"<h4>KV bytes per layer: {escape(model)}, {escape(kv.layout)}, {escape(kv.call)}</h4>"
            "<table><tr><th>layer</th><th>kind</th><th>positions</th><th>why</th><th>expected bytes</th></tr>"
            f"{rows}<tr><th colspan=\"4\">expected total</th><th>{(expected or 0):,}</th></tr>"
            f"<tr><th colspan=\"4\">measured (reported, else held)</th><th>{measured:,} {verdict}</th></tr></table>")


def _failure(failure: FailureEntry) -> str:
    typed = failure.failure
    diff = token_diff(typed) if typed and typed.oracle else ""
    return (f'<details class="failure"{" open" if diff else ""}><summary class="bad">{escape(failure.test)} '
            f'({escape(failure.kind.value)})</summary>'
            f"{diff}<pre>{escape(failure.message)}</pre></details>")


def _engine_section(engine: str, rows: list[Row], all_rows: list[Row]) -> str:
    measured = [r for r in rows if r.latency]
    charts = ""
    if measured:
        charts = (bar_chart(f"{engine}: prefill median", [(r.model, r.latency.prefill.median) for r in measured], "ms")
                  + bar_chart(f"{engine}: decode median", [(r.model, r.latency.decode.median) for r in measured],
                              "ms/token"))
        repeated = [r for r in measured if len(r.latency.prefill_ms) > 1]
        if repeated:
            charts += (strip_chart(f"{engine}: prefill, every repeat", [(r.model, r.latency.prefill_ms)
                                                                         for r in repeated], "ms")
                       + strip_chart(f"{engine}: decode, every repeat",
                                     [(r.model, r.latency.decode_ms_per_token) for r in repeated], "ms/token"))
    found = sections(rows, label=lambda r: r.model)  # the engine's own section: its models name the lines
    timelines = "".join(compile_timeline(r.model, r.compiles.timeline) for r in rows
                        if r.compiles and r.compiles.timeline)
    layers = "".join(kv_layers(r.model, r.kv_bytes) for r in rows if r.kv_bytes and r.kv_bytes.layers)
    failures = [f for r in rows for f in r.failures]
    shown = (f'<h4>failures ({len(failures)})</h4>' + "".join(_failure(f) for f in failures)) if failures else ""
    return (f'<section class="engine" id="engine-{escape(engine)}"><h2>{escape(engine)}</h2>'
            + _table(rows, all_rows) + charts + shown + _list(found.recompiles, "bad") + timelines + layers
            + _list(found.fuzz) + _list(found.speculation) + _list(found.near_ties) + "</section>")


def baseline_table(changes: list[Change]) -> str:
    """Every compared number, old -> new: regressions first, then improvements, then the rest."""
    order = sorted(changes, key=lambda c: (not c.regressed, not c.improved, not c.checked, c.where, c.what))
    regressed = sum(c.regressed for c in changes)
    body = "".join(
        f'<tr class="{"bad" if c.regressed else "improved" if c.improved else ""}"><td>'
        f'{"REGRESSED" if c.regressed else "improved" if c.improved else "ok" if c.checked else "-"}</td>'
        f"<td>{escape(c.where)}</td><td>{escape(c.what)}</td><td>{c.old:.4g}</td><td>{c.new:.4g}</td>"
        f"<td>{escape(c.growth)}</td><td>{escape(c.allowed)}</td></tr>" for c in order)
    return (f'<section id="baseline"><h2>Baseline: {regressed} regression(s), {sum(c.improved for c in changes)} '
            f"improvement(s) in {sum(c.checked for c in changes)} compared number(s)</h2><table><tr><th></th>"
            "<th>engine / model / device / dtype</th><th>number</th><th>baseline</th><th>now</th><th>change</th>"
            f"<th>threshold</th></tr>{body}</table></section>")


def render(results: Results, changes: list[Change] | None = None) -> str:
    rows = results.rows
    engines = list(dict.fromkeys(r.engine for r in rows))
    runs = "".join(f"<li>{escape(', '.join(f'{k}: {v}' for k, v in run.facts()))}</li>" for run in results.runs)
    baseline = baseline_table(changes) if changes is not None else ""
    comparisons = ""
    for model in dict.fromkeys(r.model for r in rows):
        bars = [(f"{r.engine} ({r.device})", r.latency.decode.median) for r in rows
                if r.model == model and r.latency]
        if len(bars) > 1:
            comparisons += bar_chart(f"{model}: decode median by engine", bars, "ms/token")
    css = {"PASS": "v-PASS", "FAIL": "v-FAIL", "PASS with known findings": "v-known", "NOT CHECKED": "v-none"}
    summary = "".join(f'<li><span class="verdict {css[v]}">{escape(v)}</span> <a href="#engine-{escape(e)}">'
                      f"{escape(e)}</a>: {escape(c)}</li>" for e, v, c in verdicts(rows, results.problems))
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>pytest-kvcompile results</title>"
            f"<style>{STYLE}</style></head><body><h1>pytest-kvcompile results</h1>"
            + "".join(f'<p class="v-FAIL">{escape(line)}</p>' for line in status_lines(results))
            + f'<ul class="verdicts">{summary}</ul>'
            + "".join(f'<p class="v-FAIL">run rule ({escape(p.kind.value)}): {escape(p.line)}</p>'
                      for p in results.problems)
            + f'{baseline}<ul>{runs}</ul>'
            f"<h2>All engines</h2>{_table(rows, rows)}{comparisons}"
            + "".join(_engine_section(e, [r for r in rows if r.engine == e], rows) for e in engines)
            + "</body></html>\n")
