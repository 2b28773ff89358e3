"""The committed conformance matrix as a reader gets it: regenerated from the kept result files (docs/results) by the
documented command it equals docs/conformance-matrix.md, and on the docs site its summary table fits a 1400-pixel
window in headless Chromium (a screenshot is kept in $KVCOMPILE_ARTIFACTS when set); a table that does not fit is
caught (the twin)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvcompile.reports import json_file, matrix
from test_html_report import CHROMIUM, console_errors, needs_chromium

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/conformance-matrix.md"
WIDTH = 1400
#: Appended to a built page: the summary table's right edge and whether its scroll wrapper overflows, in the title.
#: The theme's table scrolls itself (and may sit in a scroll wrapper): either scrolling sideways is overflow.
MEASURE = ("<script>const t=document.querySelector('.md-typeset table');const over=[t,t.parentElement,"
           "t.closest('.md-typeset__scrollwrap')].some(e=>e&&e.scrollWidth>e.clientWidth+1);document.title="
           "'measured '+Math.ceil(t.getBoundingClientRect().right)+' '+(over?'overflows':'fits')</script>")


def test_the_committed_matrix_is_its_kept_files_regenerated(monkeypatch):
    monkeypatch.chdir(ROOT)
    page = matrix.page(["docs/results"], Path(PAGE), Path("docs/engines"))
    assert "Regenerate: `kvcompile matrix docs/results -o docs/conformance-matrix.md`" in page.text
    assert page.text == (ROOT / PAGE).read_text(), (
        "docs/conformance-matrix.md is not its kept files regenerated: run `kvcompile matrix docs/results -o "
        "docs/conformance-matrix.md` (the files: `kvcompile check-engine --all --out docs/results`)")


def test_every_kept_file_says_what_made_it():
    for path in sorted((ROOT / "docs/results").glob("*.json")):
        results = json_file.load(path)
        for run in results.runs:
            assert run.command.startswith("kvcompile check-engine --all --only "), (path.name, run.command)
            assert run.suites and run.checks and run.torch and run.transformers, path.name
        assert results.status is None and all(f.failure is None for r in results.rows for f in r.failures), path.name


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    return out


def _measure(page: Path, extra_css: str = "") -> tuple[int, str]:
    measured = page.with_name("measured.html")
    measured.write_text(page.read_text().replace("</body>", f"<style>{extra_css}</style>{MEASURE}</body>"))
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--hide-scrollbars", f"--window-size={WIDTH},1000", "--virtual-time-budget=3000",
                           "--dump-dom", measured.as_uri()], capture_output=True, text=True, timeout=120)
    # the theme's search index does not load over file:// (a console error of the theme's, not of this page)
    assert done.returncode == 0 and [e for e in console_errors(done.stderr) if "search" not in e] == [], done.stderr
    found = re.search(r"<title>measured (\d+) (\w+)</title>", done.stdout)
    assert found, done.stdout[:2000]
    return int(found.group(1)), found.group(2)


@needs_chromium
def test_the_summary_fits_a_1400_pixel_window(site, tmp_path):
    page = site / "conformance-matrix" / "index.html"
    right, overflow = _measure(page)
    assert (right <= WIDTH, overflow) == (True, "fits"), f"summary table's right edge at {right} px ({overflow})"
    out = Path(os.environ.get("KVCOMPILE_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "conformance-matrix.png"
    taken = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size={WIDTH},1100", f"--screenshot={shot}", page.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]


@needs_chromium
def test_a_summary_too_wide_is_caught(site):
    """The twin: the same page with cells as wide as the old one's 37 columns made them does not fit."""
    right, overflow = _measure(site / "conformance-matrix" / "index.html", ".md-typeset td{min-width:260px}")
    assert overflow == "overflows" or right > WIDTH, (right, overflow)
