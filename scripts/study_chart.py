"""A study's frontier chart as a PNG, drawn by the app's own figure builder (kvviz.plots.study).

    python scripts/study_chart.py runs/smollm2-quarter docs/study.png [--metric perplexity_ratio]

plotly's static export needs kaleido (not installed here); this renders the figure's standalone
HTML in Debian's headless Chromium through Playwright (executable_path, never `playwright install`)
and screenshots the chart.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvviz.analysis.study import StudyDir  # noqa: E402
from kvviz.analysis.study.frontier import X_COLUMN, frontier  # noqa: E402
from kvviz.plots.study import frontier_figure  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("png")
    ap.add_argument("--metric", default=None)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--width", type=int, default=1000)
    a = ap.parse_args()
    folder = StudyDir(a.dir)
    meta = folder.meta()
    fr = frontier(folder.rows(), meta["kind"], a.metric)
    fig = frontier_figure(fr, X_COLUMN[meta["kind"]], title=f"{meta['name']}: {fr.label}")
    fig.update_layout(width=a.width)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "chart.html"
        html.write_text(fig.to_html(include_plotlyjs=True, full_html=True), encoding="utf-8")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=a.chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": a.width + 40, "height": 800})
            page.goto(html.as_uri())
            page.wait_for_selector(".js-plotly-plot .scatterlayer")
            page.locator(".js-plotly-plot").first.screenshot(path=a.png)
            browser.close()
    print(f"wrote {a.png} ({meta['name']}, {fr.label}, {len(fr.points)} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
