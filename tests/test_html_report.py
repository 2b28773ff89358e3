"""The HTML report as a user sees it: a real run with a token mismatch, recompiles, KV layers, latency repeats and
baseline deltas, rendered in headless Chromium (Debian's `chromium`): it loads with no console errors, the key
elements are present, and a screenshot is saved (to $KVCOMPILE_ARTIFACTS when set, for CI to keep)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvcompile.reports import json_file
from pytest_kvcompile.verdicts.collect import Collector

WRONG = "kv_test_engines:WrongLateToken"
RECOMPILING = "kv_test_engines:RecompilingGreedy"
BYTES = "kv_test_engines_memory:DynamicBytes"
SLEEPY = "kv_test_engines_latency:Sleepy"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (Debian: apt-get install "
                                                             "chromium); CI installs it")


def _baseline(path: Path) -> None:
    """Sleepy was impossibly fast, DynamicBytes' cache tiny (regressions); RecompilingGreedy recompiled more
    (an improvement)."""
    found = Collector("cpu", "float32")
    found.add(SLEEPY, "llama", latency={"prompt_len": 32, "decode_tokens": 8, "timer": "perf_counter",
                                        "prefill_ms": [1e-6], "decode_ms_per_token": [1e-6]})
    found.add(BYTES, "llama", kv_bytes={"expected": None, "measured": 1})
    found.add(RECOMPILING, "llama", compiles={"warmup": 1, "after_warmup": 40, "reasons": []})
    path.write_text(json_file.dumps(found.results()))


@pytest.fixture(scope="module")
def report(tmp_path_factory, zoo_cache):
    """One run's HTML report (module-scoped: one suite run for every check here)."""
    pytester_dir = tmp_path_factory.mktemp("html-run")
    _baseline(pytester_dir / "baseline.json")
    env = {**os.environ, "KVCOMPILE_CACHE_DIR": str(zoo_cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}"}
    suites = Path(__file__).parents[1] / "suites"
    command = [sys.executable, "-m", "pytest", str(suites), "-p", "no:cacheprovider", "-p", "no:benchmark",
               "--rootdir", str(pytester_dir), "--kv-zoo=llama", "--kv-latency-repeats=3", "--kv-isolate=declared",
               *(f"--kv-engine={e}" for e in (WRONG, RECOMPILING, BYTES, SLEEPY)),
               "-k", "(test_token_identity and short7 and not batched and WrongLate) "
               "or (test_no_recompiles_after_warmup "
               "and Recompiling) or (test_memory_held and DynamicBytes) or (test_latency and not benchmark and Sleepy)",
               f"--kv-baseline={pytester_dir / 'baseline.json'}", "--kv-fail-on=latency:10%,memory:5%,recompiles:0",
               f"--kv-report-html={pytester_dir / 'report.html'}", f"--kv-report-md={pytester_dir / 'report.md'}"]
    done = subprocess.run(command, cwd=pytester_dir, env=env, capture_output=True, text=True, timeout=600)
    assert "2 failed, 2 passed" in done.stdout, done.stdout[-3000:]
    return pytester_dir / "report.html"


def test_html_report_shows_token_diff_timeline_layers_distributions_and_baseline(report):
    page = report.read_text()
    assert "<script" not in page and not re.search(r"(src|href)=\"https?:", page)  # self-contained, no network
    # baseline right after the verdicts, regressions first, then the improvement
    assert page.index('<ul class="verdicts">') < page.index('<section id="baseline">') < page.index("All engines")
    baseline = page.split('<section id="baseline">')[1].split("</section>")[0]
    statuses = re.findall(r"<tr class=\"[a-z]*\"><td>([A-Za-z-]+)</td>", baseline)
    assert statuses[:3] == ["REGRESSED"] * 3 and statuses[3] == "improved", statuses
    assert "40 -&gt;" not in baseline and "<td>40</td><td>" in baseline and "allowed +0" in baseline
    # the token diff: aligned, the first divergence highlighted at step 14, the gap against the tolerance
    wrong = page.split(f'id="engine-{WRONG}"')[1].split("</section>")[0]
    assert '<table class="diff">' in wrong and wrong.count('<td class="first">') == 2  # oracle and engine at step 14
    assert "first divergence at step 14" in wrong and "&gt; tie tolerance 0.001" in wrong and "oracle top-3" in wrong
    assert "hint: prefill was right" in wrong
    # the compile timeline: build, warmup calls, after-warmup calls that compiled, with their failed guards
    recompiling = page.split(f'id="engine-{RECOMPILING}"')[1].split("</section>")[0]
    assert "compile timeline: llama" in recompiling and '<div class="call after compiled">' in recompiling
    assert '<div class="call warmup' in recompiling and "guard failed:" in recompiling
    # KV bytes per layer, expected vs measured
    layers = page.split(f'id="engine-{BYTES}"')[1].split("</section>")[0]
    assert "KV bytes per layer: llama" in layers and layers.count("<td>full</td>") == 2 and "matches" in layers
    # latency distributions: every repeat, not just the median
    sleepy = page.split(f'id="engine-{SLEEPY}"')[1].split("</section>")[0]
    assert sleepy.count('class="distribution"') == 2 and "(n=3)" in sleepy
    md = report.with_suffix(".md").read_text()
    assert md.index("### Baseline: 3 regression(s), 1 improvement(s)") < md.index("| engine |")


def _chromium(page: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                           "--no-first-run", "--disable-extensions", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def console_errors(stderr: str) -> list[str]:
    """Chromium's console messages of the page (logged as CONSOLE lines) that are errors or uncaught exceptions."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line and re.search(r"error|uncaught", line, re.I)]


@needs_chromium
def test_console_error_check_catches_a_broken_page(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><script>throw new Error('kvcompile-boom')</script></body></html>")
    assert any("kvcompile-boom" in line for line in console_errors(_chromium(page, "--dump-dom").stderr))


@needs_chromium
def test_html_report_loads_in_headless_chromium(report, tmp_path):
    dom = _chromium(report, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_errors(dom.stderr) == []
    for element in ('<ul class="verdicts">', '<section id="baseline">', '<table class="diff">',
                    'class="timeline"', 'class="distribution"', "KV bytes per layer"):
        assert element in dom.stdout, element  # parsed into the DOM, not only present in the file
    out = Path(os.environ.get("KVCOMPILE_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "kv-report.png"
    taken = _chromium(report, f"--screenshot={shot}", "--window-size=1400,4000", "--hide-scrollbars")
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    assert console_errors(taken.stderr) == []
