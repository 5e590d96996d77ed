"""The HTML report in a real browser: a small real `duipai all` (torch only: the reference, a
1-ULP and a float64 envelope run, a dp=2 candidate; 30 steps) writes report/index.html, which
headless Chromium (driven by Selenium) opens over file://. It must load with no SEVERE console
entry, show the verdict table with one row per compared candidate and every embedded figure
decoded; a full-page screenshot and the console log are saved with the test artefacts, in
report-browser/ under $DUIPAI_TEST_ARTIFACTS (else $DUIPAI_ARTIFACTS, as .ci/run sets it, else
<repo>/test-artifacts/, which is git-ignored).

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package (the `test` extra);
without them the test is skipped, saying how to install them. DUIPAI_CHROMIUM and
DUIPAI_CHROMEDRIVER override where the browser and the driver are looked for.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from .conftest import ROOT, need

INSTALL = ("install them with `sudo apt-get install -y chromium chromium-driver` (Debian/Ubuntu) and "
           "`.venv/bin/pip install selenium` (or `pip install -e '.[test]'`); CI (.ci/run) installs them")
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-dev-shm-usage", "--window-size=1400,1000"]
MATRIX = """name = "browser"
description = "test_report_browser: torch reference, a 1-ULP envelope run, a dp=2 candidate"
models = ["cnn2d_2conv_2fc"]
backends = ["torch"]
devices = [1, 2]
steps = 30
batch_size = 64
envelope_k = 1
envelope_fp64 = false
"""


def _skip_loudly(why: str) -> None:
    msg = f"HTML report browser test NOT RUN: {why}; {INSTALL}"
    warnings.warn(msg, stacklevel=2)      # shows in pytest's warnings summary even without -rs
    pytest.skip(msg)


def _find(env: str, candidates: list[str]) -> str | None:
    if os.environ.get(env):
        p = os.environ[env]
        return p if os.access(p, os.X_OK) else None
    for c in candidates:
        p = c if os.path.isabs(c) else shutil.which(c)
        if p and os.access(p, os.X_OK):
            return p
    return None


def _artifacts() -> Path:
    base = os.environ.get("DUIPAI_TEST_ARTIFACTS") or os.environ.get("DUIPAI_ARTIFACTS") or ROOT / "test-artifacts"
    d = Path(base) / "report-browser"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _expected(folder: Path) -> tuple[list[str], int, set[str]]:
    """From the files, independently of report.py's code: the figures it embeds (per comparison:
    the curves always; the differences when comparison-steps.csv sits next to comparison.json; the
    step times when a run has steps.csv with step_time_s and a manifest), the number of verdict rows
    (pairs with the reference) and the verdicts."""
    figures, rows, verdicts = [], 0, set()
    comps = sorted(p for p in folder.rglob("comparison.json")
                   if not {"runs", "report"} & set(p.relative_to(folder).parts[:-1]))
    assert comps, f"no comparison.json under {folder}"
    for c in comps:
        comp = json.loads(c.read_text())
        figures.append("curves")
        if (c.parent / "comparison-steps.csv").exists():
            figures.append("differences")
        if any((Path(r["path"]) / "manifest.json").exists() and (Path(r["path"]) / "steps.csv").exists()
               and "step_time_s" in (Path(r["path"]) / "steps.csv").open().readline().split(",")
               for r in comp["runs"]):
            figures.append("step time")
        pairs = [p for p in comp["pairs"] if p.get("with_reference")]
        rows += len(pairs)
        verdicts |= {p["verdict"] for p in pairs}
    return figures, rows, verdicts


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A real `duipai all` on a tiny torch-only matrix; its results folder."""
    need("torch")
    tmp = tmp_path_factory.mktemp("report-browser")
    (tmp / "browser.toml").write_text(MATRIX)
    r = subprocess.run([sys.executable, "-c", "import sys; from harness.cli import entry; sys.exit(entry())",
                        "all", "--matrix", str(tmp / "browser.toml"), "--out", str(tmp / "results"), "-j", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode in (0, 1), f"duipai all failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    folder = tmp / "results" / "browser"
    assert (folder / "report" / "index.html").exists(), r.stdout + r.stderr
    return folder


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _skip_loudly("the Python package selenium is not installed")
    chromium = _find("DUIPAI_CHROMIUM", ["/usr/lib/chromium/chromium", "chromium", "chromium-browser",
                                         "google-chrome"])
    driver_path = _find("DUIPAI_CHROMEDRIVER", ["chromedriver", "/usr/lib/chromium/chromedriver"])
    if not chromium or not driver_path:
        _skip_loudly(f"{'chromium' if not chromium else 'chromedriver'} not found")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in CHROMIUM_FLAGS:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver path: Selenium Manager (which would download one) is never asked
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    try:
        yield drv
    finally:
        drv.quit()


def test_report_opens_in_headless_chromium(browser, report, capsys):   # browser first: a skip costs no run
    figures, rows, verdicts = _expected(report)
    index = report / "report" / "index.html"
    out = _artifacts()
    browser.get(index.resolve().as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    browser.execute_script("window.scrollTo(0, document.body.scrollHeight); window.scrollTo(0, 0);")

    # every figure embedded, decoded and shown
    imgs = browser.execute_script(
        "return [...document.images].map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth,"
        " h: i.naturalHeight, shown: i.offsetWidth > 0 && i.offsetHeight > 0,"
        " embedded: i.src.startsWith('data:image/png;base64,')}))")
    assert [i["alt"] for i in imgs] == figures, imgs
    broken = [i for i in imgs if not (i["complete"] and i["w"] > 0 and i["h"] > 0 and i["shown"] and i["embedded"])]
    assert not broken, f"figures not shown: {broken}"

    # the verdict table: one row per candidate compared with the reference, the verdicts of comparison.json
    table = browser.execute_script(
        "return [...document.querySelectorAll('table')].filter(t => [...t.rows[0].cells]"
        ".some(c => c.textContent.trim() === 'verdict')).map(t => [...t.rows].slice(1)"
        ".map(r => r.cells[1].textContent.trim()))")
    assert len(table) >= 1, "no verdict table in the report"
    shown = [v for t in table for v in t]
    assert len(shown) == rows > 0 and set(shown) == verdicts, (shown, rows, verdicts)

    # full-page screenshot (Chromium's DevTools protocol: beyond the viewport)
    size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = browser.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True, "fromSurface": True,
        "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
    png = base64.b64decode(shot["data"])
    (out / "report.png").write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    # the console: nothing SEVERE (errors, failed loads, uncaught exceptions); then a check that the
    # log is really collected (an error written on purpose must come back)
    logs = browser.get_log("browser")
    (out / "console.json").write_text(json.dumps(logs, indent=1))
    shutil.copyfile(index, out / "index.html")
    severe = [e for e in logs if e["level"] == "SEVERE"]
    assert not severe, f"console errors in {index}: {severe}"
    browser.execute_script("console.error('duipai-log-probe')")
    assert any("duipai-log-probe" in e["message"] for e in browser.get_log("browser")), \
        "the browser console log is not collected (goog:loggingPrefs): the check above proves nothing"
    with capsys.disabled():   # shown in every run, not only on failure
        print(f"\nreport-browser artefacts: {out} (report.png {len(png) // 1024} KiB, "
              f"{len(imgs)} figures, {rows} verdict row(s), {len(logs)} console entries)")
