"""The charts' token range on a projector's 1024 x 768: the range boxes and buttons are on
screen at a usable size with their labels whole, and typing a range redraws the charts on those tokens."""

from __future__ import annotations

import pytest

from conftest import idle, runs
from test_layout_browser import LAYOUT_JS

pytestmark = pytest.mark.browser
LONG = "source=synthetic&context=1024&steps=0&layers=1&q_heads=2&kv_heads=1"

BOXES_JS = r"""() => {
  const vw = document.documentElement.clientWidth;
  const box = (el) => {
    const r = el.getBoundingClientRect();
    return {w: r.width, h: r.height, left: r.left, right: r.right};
  };
  const out = {};
  for (const w of document.querySelectorAll('[data-testid="stNumberInput"]')) {
    const label = w.querySelector('[data-testid="stWidgetLabel"]');
    const text = label ? label.textContent.trim() : '';
    if (!['Charts from token', 'to token'].includes(text)) continue;
    const p = label.querySelector('p') || label;
    if (!w.getBoundingClientRect().width) continue;      // not on screen (a previous run's element)
    out[text] = {...box(w.querySelector('input')), cut: p.scrollWidth > p.clientWidth + 1, vw};
  }
  for (const b of document.querySelectorAll('[data-testid="stMain"] button')) {
    const text = b.textContent.trim();
    if (!['◀', '▶', 'Whole row'].includes(text)) continue;
    const p = b.querySelector('p') || b;
    if (!b.getBoundingClientRect().width) continue;
    out[text] = {...box(b), cut: p.scrollWidth > p.clientWidth + 1 || b.scrollWidth > b.clientWidth + 1, vw};
  }
  return out;
}"""


def chart_x(page, i: int) -> list[int]:
    return page.evaluate(
        """(i) => Array.from(new Set(document.querySelectorAll('.js-plotly-plot')[i]._fullData
        .flatMap(t => Array.from(t.x || [])))).map(Math.round).sort((a, b) => a - b)""",
        i,
    )


def test_the_range_controls_fit_a_1024_screen_and_zoom_the_charts(page, app_url):
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?{LONG}")
    idle(page)
    found = page.evaluate(BOXES_JS)
    assert set(found) == {"Charts from token", "to token", "◀", "▶", "Whole row"}, found
    for name, b in found.items():
        assert not b["cut"], f"{name}: its label is cut"
        assert b["right"] <= b["vw"] + 1 and b["left"] >= 0, f"{name} is past the screen's edge: {b}"
        assert b["h"] >= 28, f"{name} is too small to click: {b}"
    assert found["Charts from token"]["w"] >= 90 and found["to token"]["w"] >= 90  # '32767' fits
    assert found["Whole row"]["w"] >= 60
    problems = page.evaluate(LAYOUT_JS)["problems"]  # the binned charts' titles and axes fit too
    assert not problems, problems
    for label, value in (("Charts from token", "500"), ("to token", "520")):
        box = (
            page.locator('[data-testid="stNumberInput"]')
            .filter(has=page.locator('[data-testid="stWidgetLabel"]', has_text=label))
            .locator("input")
        )
        before = runs(page)
        box.fill(value)
        box.press("Enter")
        idle(page, after=before)
    assert chart_x(page, 0) == list(range(500, 521)) and chart_x(page, 1) == list(range(500, 521))
    before = runs(page)
    page.get_by_role("button", name="▶").click()
    idle(page, after=before)
    assert chart_x(page, 0) == list(range(521, 542))
    assert "zoom_from=521" in page.url and "zoom_to=541" in page.url
    problems = page.evaluate(LAYOUT_JS)["problems"]  # and the per-token charts of the range
    assert not problems, problems
    assert page.errors == [], page.errors
