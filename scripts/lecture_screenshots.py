"""Screenshots of a lecture on one screen: the Explorer in Presentation mode and the
Trade-offs page at a projector's 1024x768, saved as docs/screenshots/lecture-<tag>-*.png.

Run: python scripts/lecture_screenshots.py before|after  (starts its own `streamlit run app.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import CHROMIUM, CHROMIUM_ARGS, PAGE_PROBE_JS, idle, serve_app  # noqa: E402


def main(tag: str) -> None:
    from playwright.sync_api import sync_playwright

    out = ROOT / "docs" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    with serve_app(ROOT / "test-artifacts" / "screenshots-server.log") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1024, "height": 768})
        context.add_init_script(PAGE_PROBE_JS)
        page = context.new_page()
        for name, path in (("explorer-present", "/?present=1"), ("tradeoffs", "/trade-offs")):
            page.goto(url + path)
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=120_000)
            idle(page)
            page.screenshot(path=str(out / f"lecture-{tag}-{name}-1024x768.png"))
            print(out / f"lecture-{tag}-{name}-1024x768.png")
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "after")
