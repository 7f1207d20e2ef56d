"""The Needle test page in headless Chromium: it opens on both compression points' grids from
the shipped file — query-agnostic (kvpress's pipeline default) above query-aware — each labelled, without
a live run; a click on a square of the second grid opens that grid's cell."""

from __future__ import annotations

import re

import pytest

from conftest import idle
from tests.test_browser import address, expect, metric, no_console_errors, shot

pytestmark = pytest.mark.browser


def test_needle_page_shows_both_protocols_grids_without_a_live_run(page, app_url):
    from kvviz.analysis import needle

    grids = needle.load_grids()
    if len(grids) < 2:
        pytest.skip("the shipped needle file holds one grid (scripts/needle_default.py writes both)")
    page.set_viewport_size({"width": 1400, "height": 1900})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")  # the app has started
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name="Needle test").click()
    e(page.get_by_role("heading", name=re.compile("Needle test"))).to_be_visible()
    plot = page.locator(".js-plotly-plot").filter(has_text="needle depth").first
    for where in ("agnostic", "aware"):  # each grid labelled with its point
        e(plot.get_by_text(needle.PROTOCOL_TITLES[where])).to_be_visible()
    e(page.get_by_text("the shipped precomputed grids, one per compression point")).to_be_visible()
    assert page.get_by_text("Running the needle grid").count() == 0  # nothing ran live
    # every cell of both grids is a square on screen: one point per cell
    squares = plot.locator(".scatterlayer .trace .points path")
    assert squares.count() == sum(len(g.cells) for g in grids)
    idle(page)
    shot(page, "needle-both-protocols")
    # the TOVA column: query-aware finds the key at 640 tokens, depth 0%, query-agnostic does not
    agnostic, aware = grids
    assert not agnostic.cell("tova", 640, 0.0).correct and aware.cell("tova", 640, 0.0).correct
    # a square of the second (query-aware) grid: its traces come after the first grid's
    n_traces = plot.locator(".scatterlayer .trace").count()
    second = plot.locator(".scatterlayer .trace").nth(n_traces // 2)  # the full cache's right squares, row 2
    second.locator(".points path").first.click(force=True)
    page.wait_for_function(
        "() => (new URLSearchParams(location.search).get('nd_cell') || '').endsWith(':aware')", timeout=30_000
    )
    assert address(page)["nd_cell"].startswith("full:"), address(page)
    e(page.get_by_role("heading", name=re.compile(r"^Full cache · "))).to_be_visible()
    no_console_errors(page)
