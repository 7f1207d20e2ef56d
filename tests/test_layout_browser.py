"""No clipped or overlapping text on any page at a projector's 1024 x 768 and a laptop's 1440 x 900.

One server, one browser page: each page (and the Explorer in Presentation mode) is visited at the projector's
size, then widened to the laptop's, left to settle each time, and measured in one
`page.evaluate` (LAYOUT_JS): the bounding boxes of the page's headings, metric cards and tables, and inside
every plotly chart its title, axis titles, panel titles (annotations), legend texts, colour-bar ticks and
its play buttons and step slider. The test fails on
  - two of those texts overlapping each other (any pair on the page),
  - a chart's text reaching outside its chart (plotly clips it at the SVG's edge) or any text past the
    viewport's right edge,
  - a card's or heading's text cut inside its box (scrollWidth past clientWidth) or a word broken across
    two lines ("Perplexity (compress / ed)"),
  - a table whose columns scroll sideways inside the page (its right columns cut),
  - a multi-choice's chip cut short ("Str…").
The Model lab shows the default settings' result precomputed on this machine (`make venv`), copied into the
tests' own lab folder; without it only the page before a run is measured. The Studies page opens a small
study run into the tests' studies folder (as tests/test_study_browser.py does). No model runs here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import TIMEOUT, idle

pytestmark = pytest.mark.browser
SIZES = ((1024, 768), (1440, 900))
# the sidebar's link, and a text that is on the page once it has drawn (None: the page's heading is enough)
PAGES = (
    ("Explorer", "Per-token error"),
    ("Trade-offs", "Error vs memory"),
    ("Concentration", "Top x% of tokens"),
    ("Model lab", None),
    ("Decode timeline", "Regret per step"),
    ("Needle test", "needle depth"),
    ("Studies", "quarter-cache"),
    ("Presentation mode", "Attention per token"),
    ("Trade-offs, presenting", "Error vs memory"),
    ("Needle test, presenting", "needle depth"),
    ("Concentration, presenting", "Top x% of tokens"),
    ("Model lab, presenting", "Per-token KL"),
    ("Studies, presenting", "quarter-cache"),
    ("Decode timeline, presenting", "tokens held at each decode step"),
)
# presenting, at a projector's 1024 x 768: the page's main chart starts on the first screen, at least half of it
PRESENTED = {
    "Presentation mode": "Attention per token",
    "Trade-offs, presenting": "Error vs memory",
    "Needle test, presenting": "needle depth",
    "Concentration, presenting": "Top x% of tokens",
    "Model lab, presenting": "Per-token KL",
    "Studies, presenting": "quarter-cache",
    "Decode timeline, presenting": "tokens held at each decode step",
}

LAYOUT_JS = r"""() => {
  const problems = [], items = [];
  const vw = document.documentElement.clientWidth;
  const shown = (el) => { const r = el.getBoundingClientRect();
                          return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== 'hidden'
                                 && el.closest('details:not([open]) > :not(summary)') === null; };
  const name = (el) => (el.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 50) || el.tagName;
  const add = (el, kind, bounds) => { if (shown(el)) items.push({el, kind, r: el.getBoundingClientRect(), bounds}); };
  const main = document.querySelector('[data-testid="stMain"]') || document.body;
  // the page's own texts: headings and metric cards (cut inside their box, words broken across lines)
  for (const el of main.querySelectorAll('h1, h2, h3, [data-testid="stMetricLabel"], '
                                         + '[data-testid="stMetricValue"], [data-testid="stMetricDelta"]')) {
    if (!shown(el)) continue;
    add(el, 'text', null);
    if (el.scrollWidth > el.clientWidth + 1)
      problems.push(`cut inside its box: "${name(el)}" (${el.scrollWidth} > ${el.clientWidth} px)`);
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.textContent.matchAll(/[^\s\-–—\/]+/g)) {
        const range = document.createRange();
        range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
        const tops = new Set(Array.from(range.getClientRects()).filter(x => x.width > 0).map(x => Math.round(x.top)));
        if (tops.size > 1) problems.push(`a word broken across lines: "${m[0]}" in "${name(el)}"`);
      }
    }
  }
  // a multi-choice's chips: each chosen name whole (a narrow column cut them to "Str…")
  for (const tags of main.querySelectorAll('[data-testid="stMultiSelectTagsContainer"]')) {
    if (shown(tags) && tags.scrollWidth > tags.clientWidth + 1)
      problems.push(`chips cut: "${name(tags)}" (${tags.scrollWidth} > ${tags.clientWidth} px)`);
  }
  // tables: the columns fit the table's box (no sideways scrolling), the box fits the viewport
  for (const t of main.querySelectorAll('[data-testid="stDataFrame"], [data-testid="stTable"]')) {
    if (!shown(t)) continue;
    const scroller = t.querySelector('.dvn-scroller') || t.querySelector('table')?.parentElement || t;
    if (scroller.scrollWidth > scroller.clientWidth + 1)
      problems.push(`a table's columns cut on the right (${scroller.scrollWidth} > ${scroller.clientWidth} px): ` +
                    (Array.from(t.closest('[class*="st-key-"]')?.classList || [])
                       .find(c => c.startsWith('st-key-')) || name(t)));
    add(t, 'table', null);
  }
  // inside every plotly chart: the texts a reader reads, bounded by the chart's SVG
  const PLOT_TEXT = ['.gtitle', '.g-gtitle text', 'text[class$="title"]', '.annotation-text', '.legendtext',
                     '.legendtitletext', '.colorbar .cbaxis text', '.colorbar text.cbtitle', '.updatemenu-button',
                     '.slider-group'];
  for (const plot of document.querySelectorAll('.js-plotly-plot')) {
    const svg = plot.querySelector('.main-svg');
    if (!svg || !shown(svg)) continue;
    const seen = new Set();
    for (const el of plot.querySelectorAll(PLOT_TEXT.join(','))) {
      if (seen.has(el) || !(el.textContent || '').trim() && !el.matches('.slider-group')) continue;
      seen.add(el);
      add(el, 'chart', svg.getBoundingClientRect());
    }
  }
  for (const it of items) {
    const r = it.r, b = it.bounds;
    if (b && (r.left < b.left - 1 || r.right > b.right + 1 || r.top < b.top - 1 || r.bottom > b.bottom + 1))
      problems.push(`outside its chart: "${name(it.el)}" [${[r.left, r.top, r.right, r.bottom].map(Math.round)}]` +
                    ` in [${[b.left, b.top, b.right, b.bottom].map(Math.round)}]`);
    if (r.right > vw + 1 || r.left < -1)
      problems.push(`past the viewport's edge: "${name(it.el)}" `
                    + `(${Math.round(r.left)}..${Math.round(r.right)} of ${vw} px)`);
  }
  const slack = 2;    // px: a glyph box's ascent / descent may touch its neighbour's
  for (let i = 0; i < items.length; i++) {
    for (let j = i + 1; j < items.length; j++) {
      const a = items[i], b = items[j];
      if (a.el.contains(b.el) || b.el.contains(a.el)) continue;
      if (a.kind === 'table' && b.kind === 'table') continue;
      const w = Math.min(a.r.right, b.r.right) - Math.max(a.r.left, b.r.left);
      const h = Math.min(a.r.bottom, b.r.bottom) - Math.max(a.r.top, b.r.top);
      if (w > slack && h > slack)
        problems.push(`overlap: "${name(a.el)}" and "${name(b.el)}" (${Math.round(w)} x ${Math.round(h)} px)`);
    }
  }
  return {problems: Array.from(new Set(problems)), measured: items.length};
}"""


@pytest.fixture(scope="module")
def lab_result() -> bool:
    """The Model lab's default result as precomputed on this machine, copied into the tests' lab folder
    (conftest points KVVIZ_LAB_DIR at a fresh one); False where there is none."""
    from kvviz.decode import labsettings, labstore

    name = labstore.result_path(labsettings.default_settings()).name
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvviz" / "lab" / name
    if not home.is_file():
        return False
    labstore.lab_cache_dir().mkdir(parents=True, exist_ok=True)
    shutil.copy(home, labstore.lab_cache_dir() / name)
    return True


def measure(page) -> dict:
    return page.evaluate(LAYOUT_JS)


# the texts of the chart that holds `marker` (ticks, axis and panel titles, legend) set under `least` px
SMALL_TEXT_JS = r"""([marker, least]) => {
  const chart = Array.from(document.querySelectorAll('.js-plotly-plot')).find(p => p.textContent.includes(marker));
  if (!chart) return ['no chart'];
  const texts = chart.querySelectorAll('.xtick text, .ytick text, .g-xtitle text, .g-ytitle text, .legendtext, '
                                       + '.annotation-text, .gtitle, .slider-label, .updatemenu-item-text');
  return Array.from(texts).filter(t => t.textContent.trim() && parseFloat(getComputedStyle(t).fontSize) < least)
              .map(t => `"${t.textContent.trim().slice(0, 30)}" ${getComputedStyle(t).fontSize}`);
}"""


def check_page(page, name: str, width: int, height: int, found: dict) -> None:
    """The page as it is on screen at width x height: the Explorer's first chart on a laptop's first screen,
    no error box, a presented chart on a projector's first screen in a projector's text sizes, and nothing
    cut or overlapping (LAYOUT_JS); what is wrong goes into `found`."""
    where = f"{name} at {width}x{height}"
    if (name, width) == ("Explorer", 1440):  # a laptop screen: the first chart starts on it
        box = page.locator(".js-plotly-plot").first.bounding_box()
        assert box["y"] + box["height"] / 3 < height, f"the Explorer's first chart starts at y={box['y']:.0f}"
    errors = page.locator('[data-testid="stAlertContentError"], [data-testid="stException"]')
    if errors.count():  # every page at its defaults runs without an error
        found[where] = [f"an error box: {errors.first.inner_text()[:200]}"]
    if name in PRESENTED and width == 1024:
        box = page.locator(".js-plotly-plot").filter(has_text=PRESENTED[name]).first.bounding_box()
        assert 0 <= box["y"] and box["y"] + box["height"] / 2 <= height, f"{name}: the chart is at {box}"
        small = page.evaluate(SMALL_TEXT_JS, [PRESENTED[name], 15.5])  # a projector's chart text
        if small:
            found[f"{name}: chart text under 16 px"] = small
    got = measure(page)
    assert got["measured"] > 0, f"{where}: nothing measured"
    if got["problems"]:
        found[where] = got["problems"]


def test_no_text_overlaps_or_is_cut_on_any_page(page, app_url, quarter_study, lab_result):
    """Each page opened at a projector's size and measured; then, but for the presenting pages (a projector's
    only), the window widened to a laptop's and the page measured again, as a reader who resizes the window
    (or plugs a laptop into a projector mid-lecture) sees it: the charts follow the new width without a
    legend left where the old width's margins put it."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT)
    found: dict[str, list[str]] = {}
    (width, height), laptop = SIZES
    page.set_viewport_size({"width": width, "height": height})
    page.goto(f"{app_url}/?study={quarter_study}")
    for name, marker in PAGES:
        if name == "Model lab, presenting" and not lab_result:  # its result first: nothing to draw without one
            continue
        if name == "Presentation mode":  # the Explorer as a lecture shows it
            page.goto(f"{app_url}/?present=1&study={quarter_study}")
        elif name.endswith(", presenting"):  # presentation mode is kept across pages
            page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=name.split(",")[0]).click()
        elif name != "Explorer":
            page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=name).click()
        if marker:
            expect(page.locator(".js-plotly-plot").filter(has_text=marker).first).to_be_visible()
        elif name == "Model lab":
            expect(
                page.get_by_role("button", name="Run again (live)" if lab_result else "Run the model")
            ).to_be_visible()
            if lab_result:
                expect(page.locator(".js-plotly-plot").first).to_be_visible()
        idle(page)
        check_page(page, name, width, height, found)
        if not name.endswith(", presenting"):
            for size in (laptop, (width, height)):  # widened, measured, and back for the next page
                page.set_viewport_size({"width": size[0], "height": size[1]})
                page.wait_for_timeout(300)  # the charts' resize handlers run after the window's event
                idle(page)
                if size == laptop:
                    check_page(page, name, *laptop, found)
    assert not found, "text overlaps or is cut:\n" + "\n".join(
        f"{where}:\n  " + "\n  ".join(p) for where, p in found.items()
    )
    assert page.errors == [], page.errors
