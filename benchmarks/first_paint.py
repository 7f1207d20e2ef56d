"""The Explorer's first paint in a real browser, with and without the chart-code preload, in one run.

Two servers start as `make run` starts one (`python -m kvviz.app.serve`, the bundled model's background
load off): one as shipped, one with KVVIZ_PRELOAD=0 (kvviz.app.layout.chart_script_preload off). A fresh
browser context (an empty cache, as a lecturer's first visit) opens each in turn, alternating which goes
first, and records when the first metric card and the first drawn chart appear (ms from navigation
start, read in the page by a MutationObserver). Alternating pairs in one run: the machine is shared.

    python benchmarks/first_paint.py [PAIRS]      (default 6)

Prints the medians per server and `first metric card: median S s with the preload (target <= 2 s)`;
exits 1 when the median misses the target (issue #21).
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
try:   # the browser tests' server and Chromium settings (tests/conftest.py needs pytest: requirements-dev.txt)
    from conftest import CHROMIUM, CHROMIUM_ARGS, serve_app  # noqa: E402
    import playwright.sync_api  # noqa: E402, F401
except ImportError as missing:
    CHROMIUM = None
    MISSING = f"{missing} (pip install -r requirements-dev.txt)"

TARGET_S = 2.0
OPENED_AFTER = 5.0   # s after the servers are up, as in benchmarks/browser.py
FIRST_SEEN_JS = """window.__first = {};
const WANTED = {metric: '[data-testid="stMetricValue"]', chart: '.js-plotly-plot .main-svg'};
new MutationObserver(() => {
  for (const [name, selector] of Object.entries(WANTED))
    if (!(name in window.__first) && document.querySelector(selector)) window.__first[name] = performance.now();
}).observe(document, {subtree: true, childList: true, attributes: true});"""


def first_seen(browser, url: str) -> dict:
    """{"metric": ms, "chart": ms} of one visit in a fresh context (no cache)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1600})
    context.add_init_script(FIRST_SEEN_JS)
    page = context.new_page()
    page.goto(url)
    page.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=120_000)
    seen = page.evaluate("window.__first")
    context.close()
    return seen


def main() -> int:
    if CHROMIUM is None or not Path(CHROMIUM).is_file():
        print(f"first-paint benchmark not run: {MISSING if CHROMIUM is None else f'no Chromium at {CHROMIUM}'}")
        return 0
    from playwright.sync_api import sync_playwright

    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    seen: dict[str, list[dict]] = {"preload": [], "no preload": []}
    logs = ROOT / "test-artifacts"
    with sync_playwright() as p, ExitStack() as servers:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        urls = {"preload": servers.enter_context(serve_app(logs / "benchmark-paint-preload.log", launcher=True,
                                                           env={"KVVIZ_WARMUP": "0"})),
                "no preload": servers.enter_context(serve_app(logs / "benchmark-paint-plain.log", launcher=True,
                                                              env={"KVVIZ_WARMUP": "0", "KVVIZ_PRELOAD": "0"}))}
        time.sleep(OPENED_AFTER)
        for i in range(pairs):
            for name in (("preload", "no preload") if i % 2 == 0 else ("no preload", "preload")):
                seen[name].append(first_seen(browser, urls[name] + "/"))
        browser.close()
    medians = {name: {what: statistics.median(s[what] for s in visits) / 1000 for what in ("metric", "chart")}
               for name, visits in seen.items()}
    for name, m in medians.items():
        print(f"{name}: first metric card {m['metric']:.2f} s, first chart {m['chart']:.2f} s "
              f"(medians of {pairs} fresh visits)")
    got = medians["preload"]["metric"]
    print(f"first metric card: median {got:.2f} s with the preload, {medians['no preload']['metric']:.2f} s without "
          f"(target <= {TARGET_S:g} s)" + ("" if got <= TARGET_S else "  MISSES the target"))
    return 0 if got <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
