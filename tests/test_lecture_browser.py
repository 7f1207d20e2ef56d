"""A lecture on one screen, in headless Chromium against the live app (fixtures in conftest.py).

At a projector's 1024 x 768 with `?present=1`: the four headline sliders and the original-vs-compressed
attention chart are inside the first screen without scrolling; each slider, moved by keyboard, changes
that chart's data, while the locked y-axis stays put; every text of the chart is at least 18 px.
"""

import re

import pytest

from conftest import TIMEOUT, idle

pytestmark = pytest.mark.browser

SLIDERS = (
    ("Sink tokens", "ArrowRight"),
    ("Recent window", "ArrowRight"),
    ("Heavy hitters", "ArrowRight"),
    ("Quantization bits", "ArrowLeft"),
)
ATTENTION = "Attention per token"

# the attention chart's data (every trace's y values) and its y-axis range, as plotly drew them
CHART_JS = """(title) => {
  const plot = Array.from(document.querySelectorAll('.js-plotly-plot'))
    .find(p => (p.querySelector('.gtitle')?.textContent || '').startsWith(title));
  if (!plot || !plot._fullLayout) return null;
  return {data: JSON.stringify((plot._fullData || []).map(t => [t.name, Array.from(t.y || [])])),
          range: plot._fullLayout.yaxis.range.map(x => +x.toFixed(9)),
          fonts: Array.from(plot.querySelectorAll('.main-svg text'))
                   .filter(t => t.textContent.trim() && t.getBoundingClientRect().width > 0)
                   .map(t => [t.textContent.trim().slice(0, 30), parseFloat(getComputedStyle(t).fontSize)])};
}"""


def main_slider(page, label):
    return page.locator('[data-testid="stMain"] [data-testid="stSlider"]').filter(
        has=page.locator('[data-testid="stWidgetLabel"]', has_text=re.compile(f"^{re.escape(label)}$"))
    )


def test_presentation_mode_is_one_lecture_screen(page, app_url):
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?present=1")
    chart = page.locator(".js-plotly-plot").filter(has_text=ATTENTION).first
    expect(chart).to_be_visible(timeout=TIMEOUT)
    idle(page)
    scrolled = page.evaluate(
        "() => [window.scrollY, document.querySelector('[data-testid=\"stMain\"]')?.scrollTop || 0]"
    )
    assert scrolled == [0, 0], scrolled
    for label, _ in SLIDERS:  # in the main area, inside the first screen
        box = main_slider(page, label).bounding_box()
        assert box is not None and 0 <= box["y"] and box["y"] + box["height"] <= 768, (label, box)
    box = chart.bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= 768, f"the attention chart is not in the first screen: {box}"
    lock = page.locator('[data-testid="stMain"] label').filter(has_text="Lock the charts' y-axes").locator("input")
    assert lock.is_checked(), "the y-axes are locked by default in Presentation mode"

    before = page.evaluate(CHART_JS, ATTENTION)
    small = [t for t in before["fonts"] if t[1] < 18]
    assert not small, f"chart text under 18 px: {small}"
    for label, key in SLIDERS:
        thumb = main_slider(page, label).get_by_role("slider")
        was = thumb.evaluate("e => e.value")
        thumb.focus()
        thumb.press(key)
        page.wait_for_function(
            "([title, data]) => { const p = (" + CHART_JS + ")(title); return p && p.data !== data; }",
            arg=[ATTENTION, before["data"]],
            timeout=TIMEOUT,
            polling=100,
        )
        idle(page)
        assert thumb.evaluate("e => e.value") != was, f"{label} did not move"
        now = page.evaluate(CHART_JS, ATTENTION)
        assert now["data"] != before["data"], f"moving {label} did not change the attention chart's data"
        assert now["range"] == before["range"], (
            f"the locked y-axis moved with {label}: {before['range']} -> {now['range']}"
        )
        before = now
    assert page.errors == [], page.errors
