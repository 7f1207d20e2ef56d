"""The Studies page in headless Chromium: a study under the server's studies root is drawn,
nothing is clipped at a projector's 1024 x 768, and clicking a point opens that cell's setting in the
Explorer (the conftest points KVVIZ_STUDIES_DIR at a fresh folder before the server starts)."""

from __future__ import annotations

import re

import pytest

from conftest import idle
from tests.test_browser import address, assert_nothing_clipped, expect, metric, no_console_errors, shot

pytestmark = pytest.mark.browser


def test_a_study_is_drawn_unclipped_and_a_click_opens_its_cell_in_the_explorer(page, app_url, quarter_study):
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?study={quarter_study}")  # opened from the Explorer, by its sidebar link
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")  # the app has started (its page list is set)
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name="Studies").click()
    plot = page.locator(".js-plotly-plot").filter(has_text="quarter-cache").first
    e(plot).to_be_visible()
    e(page.get_by_text("36 cells, 36 done, 0 to run")).to_be_visible()
    idle(page)
    assert_nothing_clipped(page, "Studies")
    shot(page, "after-studies-1024x768")
    # the first line is H2O at 4 bits (series sorted by scorer, then bits); its first point is budget 0.1:
    # 54 of the 544 tokens the last query sees (4 sinks, 25 recent, 25 heavy)
    plot.locator(".scatterlayer .trace").nth(0).locator(".points path").first.click(force=True)
    e(page.get_by_role("heading", name=re.compile("KV-cache compression explorer"))).to_be_visible()
    e(metric(page, "Tokens kept")).to_have_text("54 / 544")
    page.wait_for_function("() => new URLSearchParams(location.search).get('source') === 'synthetic'")
    got = address(page)
    assert (got["source"], got["bits"], got.get("context", "512")) == ("synthetic", "4", "512"), got  # 512: default
    assert got.get("scorer", "h2o") == "h2o" and got["recent"] == got["heavy"] == "25", got
    no_console_errors(page)
