"""End-to-end in headless Chromium against a live `streamlit run app.py` (fixtures in conftest.py).

Loads every page, moves a slider with the keyboard and sees a metric change, opens a shared
URL and sees the same state, and fails on any browser console error. Screenshots of each
page go to test-artifacts/ (git-ignored); KVVIZ_UPDATE_SCREENSHOT=1 also refreshes the
README's docs/explorer.png.
"""

import os
import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from kvviz import Spec, View, compare
from kvviz.sources.handbook import handbook_trace
from kvviz.ui import card_values

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
TIMEOUT = 30_000


def expect():
    from playwright.sync_api import expect as _expect
    _expect.set_options(timeout=TIMEOUT)
    return _expect


def metric(page, label):
    return page.locator('[data-testid="stMetric"]').filter(has_text=label).locator('[data-testid="stMetricValue"]')


def slider_thumb(page, label):
    return page.locator('[data-testid="stSlider"]').filter(has_text=label).get_by_role("slider")


def settle(page):
    """Wait until the app has finished its rerun (no running indicator) and charts are drawn."""
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"] svg')"
                           " || document.querySelectorAll('.js-plotly-plot').length > 0", timeout=TIMEOUT)
    page.wait_for_timeout(500)


def shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def no_console_errors(page):
    assert page.errors == [], "browser console errors:\n" + "\n".join(page.errors)


def test_explorer_slider_moves_metric(page, app_url):
    page.set_viewport_size({"width": 1400, "height": 2200})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Attention mass retained")).to_have_text("62.9%")
    e(page.get_by_text("0-3, 15, 28, 56-63")).to_be_visible()
    e(page.locator(".js-plotly-plot")).to_have_count(2)
    settle(page)
    shot(page, "explorer")
    if os.environ.get("KVVIZ_UPDATE_SCREENSHOT") == "1":
        page.screenshot(path=str(ROOT / "docs" / "explorer.png"), clip={"x": 0, "y": 0, "width": 1400, "height": 1720})

    thumb = slider_thumb(page, "Heavy-hitter budget")
    e(thumb).to_have_value("2")
    thumb.focus()
    for heavy in (3, 4, 5):  # one key at a time: each press reruns the app and the card follows
        thumb.press("ArrowRight")
        e(thumb).to_have_value(str(heavy))
        e(metric(page, "Tokens kept")).to_have_text(f"{12 + heavy} / 64")
    expected = compare(handbook_trace(), Spec(sink=4, recent=8, heavy=5), View(ensemble="seeds", ensemble_size=8))
    e(metric(page, "Attention mass retained")).to_have_text(card_values(expected.metrics)["Attention mass retained"])
    e(page).to_have_url(re.compile(r"[?&]heavy=5"))
    no_console_errors(page)


def test_shared_url_reproduces_state(page, app_url):
    params = "sink=2&recent=6&heavy=5&bits=4&scorer=tova"
    page.goto(f"{app_url}/?{params}")
    e = expect()
    expected = card_values(compare(handbook_trace(), Spec(sink=2, recent=6, heavy=5, scorer="tova", key_bits=4,
                                                          value_bits=4), View(ensemble="seeds")).metrics)
    for label in ("Attention mass retained", "TV distance", "Output error", "Tokens kept", "KV memory"):
        e(metric(page, label)).to_have_text(expected[label])
    e(slider_thumb(page, "Sink tokens")).to_have_value("2")
    e(slider_thumb(page, "Recent window")).to_have_value("6")
    settle(page)
    query = parse_qs(urlparse(page.url).query)
    assert {k: v[0] for k, v in query.items()} == dict(p.split("=") for p in params.split("&"))
    no_console_errors(page)


def test_out_of_range_link_shows_notice(page, app_url):
    page.goto(f"{app_url}/?sink=500&bits=11")
    e = expect()
    e(page.get_by_text("Some settings were adjusted")).to_be_visible()
    e(slider_thumb(page, "Sink tokens")).to_have_value("64")
    no_console_errors(page)


@pytest.mark.parametrize("name, marker", [("Trade-offs", "Error vs memory for every policy"),
                                          ("Concentration", "Top x% of tokens hold"),
                                          ("Model lab", None),
                                          ("Decode timeline", "Regret per step")])
def test_every_page_loads(page, app_url, name, marker):
    page.set_viewport_size({"width": 1400, "height": 2000})
    page.goto(f"{app_url}/?sink=3")
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("13 / 64")
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=name).click()
    e(page.get_by_role("heading", name=re.compile(name)).first).to_be_visible()
    if marker:  # the Model lab waits for a click before it loads a model
        e(page.locator(".js-plotly-plot").first).to_be_visible()
        e(page.locator(".js-plotly-plot").first).to_contain_text(marker)
    e(page).to_have_url(re.compile(r"[?&]sink=3"))  # the settings travel with the page
    settle(page)
    shot(page, name.lower())
    no_console_errors(page)
