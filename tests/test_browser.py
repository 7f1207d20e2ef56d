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
from kvviz.app.cards import card_values

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
TIMEOUT = int(os.environ.get("KVVIZ_BROWSER_TIMEOUT_MS", "60000"))   # a busy 2-core machine needs it


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
    e(page.locator(".js-plotly-plot:visible")).to_have_count(2)   # the expanders' charts stay folded
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


# --- the address bar after every single interaction (issue 9) ---------------------------------------

def address(page) -> dict:
    """The query string of the real address bar (location.href, not Playwright's cached page.url)."""
    return {k: v[0] for k, v in parse_qs(urlparse(page.evaluate("location.href")).query).items()}


def wait_for_address(page, expected: dict) -> None:
    """Wait until the address bar holds exactly `expected`, then check it (one interaction = one update)."""
    page.wait_for_function(
        """(want) => { const got = Object.fromEntries(new URLSearchParams(location.search));
                      return JSON.stringify(Object.entries(got).sort()) === JSON.stringify(Object.entries(want).sort()); }""",
        arg=expected, timeout=TIMEOUT)
    assert address(page) == expected


def test_address_bar_follows_each_single_interaction_on_the_explorer(page, app_url):
    """A copied link must reproduce the view on screen after every move, not the previous one."""
    page.set_viewport_size({"width": 1400, "height": 1600})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")
    expected = {}
    moves = [("Heavy-hitter budget", "ArrowRight", "heavy", "3"), ("Quantization bits", "ArrowLeft", "bits", "8"),
             ("Sink tokens", "ArrowRight", "sink", "5"), ("Recent window", "ArrowLeft", "recent", "7")]
    for label, key, name, value in moves:
        thumb = slider_thumb(page, label)
        thumb.focus()
        thumb.press(key)
        expected[name] = value
        wait_for_address(page, expected)
        shown = compare(handbook_trace(), Spec(sink=int(expected.get("sink", 4)), recent=int(expected.get("recent", 8)),
                                               heavy=int(expected.get("heavy", 2)), key_bits=int(expected.get("bits", 16)),
                                               value_bits=int(expected.get("bits", 16))),
                        View(ensemble="seeds", ensemble_size=8))
        e(metric(page, "Tokens kept")).to_have_text(card_values(shown.metrics)["Tokens kept"])
        e(metric(page, "TV distance")).to_have_text(card_values(shown.metrics)["TV distance"])
    # switching the source writes the source, never a stray step=0 (one rule for defaults)
    page.locator('[data-testid="stSidebar"]').get_by_text("Synthetic pattern", exact=True).click()
    wait_for_address(page, {**expected, "source": "synthetic"})
    no_console_errors(page)


@pytest.mark.parametrize("name, start, act, expected", [
    ("Trade-offs", "Error vs memory for every policy",
     lambda page: page.get_by_text("Jensen–Shannon", exact=True).click(), {"metric": "js"}),
    ("Concentration", "Top x% of tokens hold",
     lambda page: (slider_thumb(page, "Locality").focus(), slider_thumb(page, "Locality").press("ArrowRight")),
     {"window": "17"}),
    ("Decode timeline", "Regret per step",
     lambda page: (slider_thumb(page, "Decode step").focus(), slider_thumb(page, "Decode step").press("ArrowRight")),
     {"tl_step": "1"}),
    ("Model lab", None,
     lambda page: page.get_by_text("Bakery story (built-in)", exact=True).click(), {"lab_text": "bakery"}),
])
def test_address_bar_follows_a_single_interaction_on_every_page(page, app_url, name, start, act, expected):
    page.set_viewport_size({"width": 1400, "height": 1600})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=name).click()
    if start:
        e(page.locator(".js-plotly-plot").first).to_contain_text(start)
    else:
        e(page.get_by_role("button", name="Run the model")).to_be_visible()
    settle(page)
    assert address(page) == {}
    act(page)
    wait_for_address(page, expected)
    no_console_errors(page)


# --- a projector's 1024 x 768 (issue 11): nothing clipped, legends below, the main chart first ----------

CLIPPED_JS = """(selector) => Array.from(document.querySelectorAll(selector))
    .filter(el => el.offsetParent !== null && el.scrollWidth > el.clientWidth + 1)
    .map(el => el.innerText.slice(0, 60))"""
LEGEND_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(plot => {
    const legend = plot.querySelector('.legend'), title = plot.querySelector('.gtitle'),
          area = plot.querySelector('.draglayer .nsewdrag');
    if (!legend || !area) return null;
    const l = legend.getBoundingClientRect(), a = area.getBoundingClientRect(),
          t = title ? title.getBoundingClientRect() : null;
    return {below: l.top >= a.bottom - 1, overTitle: t ? (l.bottom > t.top && l.top < t.bottom) : false,
            plotWidth: a.width};
}).filter(x => x)"""


def assert_nothing_clipped(page, where: str) -> None:
    for selector in ('[data-testid="stMetricLabel"]', '[data-testid="stMetricValue"]',
                     '[data-testid="stWidgetLabel"]', '[data-testid="stButtonGroup"] button',
                     '[data-testid="stMultiSelect"] span'):
        clipped = page.evaluate(CLIPPED_JS, selector)
        assert clipped == [], f"{where}: clipped {selector}: {clipped}"
    for legend in page.evaluate(LEGEND_JS):
        assert legend["below"] and not legend["overTitle"], f"{where}: a legend covers its chart: {legend}"


@pytest.mark.parametrize("name, marker", [("Explorer", "Per-token error"), ("Trade-offs", "Error vs memory"),
                                          ("Concentration", "Top x% of tokens hold"),
                                          ("Decode timeline", "Regret per step"),
                                          ("Needle test", "needle depth")])
def test_projector_1024x768_clips_nothing(page, app_url, name, marker):
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")
    if name != "Explorer":
        page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=name).click()
    e(page.locator(".js-plotly-plot").filter(has_text=marker).first).to_be_visible()
    settle(page)
    assert_nothing_clipped(page, name)
    if name == "Trade-offs":   # the plot keeps its width (it was ~200 px beside a scrolling legend)
        widths = [x["plotWidth"] for x in page.evaluate(LEGEND_JS)]
        assert widths and min(widths) >= 450, widths
    shot(page, f"after-{name.lower().replace(' ', '-')}-1024x768")
    no_console_errors(page)


def test_presentation_mode_puts_the_lesson_above_the_fold(page, app_url):
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?present=1&bits=3&partial=quantize")
    e = expect()
    chart = page.locator(".js-plotly-plot").filter(has_text="Per-token error").first
    e(chart).to_be_visible()
    settle(page)
    box = chart.bounding_box()
    assert box["y"] < 768 - 150, f"the main chart starts at y = {box['y']:.0f}, below the fold"
    assert_nothing_clipped(page, "presentation mode")
    shot(page, "after-presentation-1024x768")
    no_console_errors(page)


def test_clicking_a_trade_off_point_opens_it_in_the_explorer(page, app_url):
    page.set_viewport_size({"width": 1400, "height": 1400})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name="Trade-offs").click()
    plot = page.locator(".js-plotly-plot").filter(has_text="Error vs memory").first
    e(plot).to_be_visible()
    settle(page)
    # the H2O trace's points (the first legend entry's line); click its smallest-budget point
    points = plot.locator(".scatterlayer .trace").nth(0).locator(".points path")
    e(points.first).to_be_visible()
    points.first.click(force=True)
    e(page.get_by_role("heading", name=re.compile("KV-cache compression explorer"))).to_be_visible()
    e(metric(page, "Tokens kept")).not_to_have_text("14 / 64")
    kept = metric(page, "Tokens kept").inner_text()
    wait_for_address(page, {**address(page)})
    assert "scorer" in address(page) or "heavy" in address(page) or "recent" in address(page), address(page)
    assert kept.endswith("/ 64")
    no_console_errors(page)


def test_needle_page_opens_on_the_shipped_grid_and_a_click_opens_a_cell(page, app_url):
    from kvviz.analysis import needle

    grid = needle.load_default()
    if grid is None:
        pytest.skip("no shipped needle grid (scripts/needle_default.py writes it)")
    page.set_viewport_size({"width": 1400, "height": 1900})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("14 / 64")
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name="Needle test").click()
    e(page.get_by_role("heading", name=re.compile("Needle test"))).to_be_visible()
    classic = needle.classic_failure(grid)
    plot = page.locator(".js-plotly-plot").filter(has_text="needle depth").first
    e(plot).to_be_visible()
    if classic is not None:
        e(page.get_by_role("heading", name=re.compile(f"StreamingLLM · {classic[1]} tokens"))).to_be_visible()
    settle(page)
    if os.environ.get("KVVIZ_UPDATE_SCREENSHOT") == "1":
        page.screenshot(path=str(ROOT / "docs" / "needle.png"), full_page=False)
    # the full cache's panel comes first: click its first square
    plot.locator(".scatterlayer .trace").nth(0).locator(".points path").first.click(force=True)
    e(page.get_by_role("heading", name=re.compile(r"^Full cache · "))).to_be_visible()
    e(page.locator(".kvviz-needle-grid")).to_be_visible()
    page.wait_for_function("() => new URLSearchParams(location.search).get('nd_cell') !== null", timeout=TIMEOUT)
    assert address(page)["nd_cell"].startswith("full:"), address(page)      # the open cell is in the link
    shot(page, "needle")
    no_console_errors(page)


# --- a hostile link (issue 26): the work budget's notice on every page, the server's memory bounded -------

HUGE_LINK = "source=synthetic&context=1000000000&steps=1000000000&layers=100000&q_heads=100000&kv_heads=100000"


def server_pid(url: str) -> int:
    """The process of the server the app_url fixture started: the one whose command line serves its port."""
    port = urlparse(url).port
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"--server.port" in args and args[args.index(b"--server.port") + 1] == \
                str(port).encode() and any(a.endswith(b"app.py") for a in args):
            return int(proc.name)
    raise AssertionError(f"no streamlit process serves port {port}")


def server_rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.mark.parametrize("path, name, marker", [
    ("", "compression explorer", "Tokens kept"), ("trade-offs", "Trade-offs", None),
    ("concentration", "Concentration", None), ("model-lab", "Model lab", None),
    ("decode-timeline", "Decode timeline", None), ("needle-test", "Needle test", None),
])
def test_the_huge_link_gives_a_notice_on_every_page_and_the_server_stays_small(page, app_url, path, name, marker):
    page.set_viewport_size({"width": 1400, "height": 1600})
    missing = []
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    page.goto(f"{app_url}/{path}?{HUGE_LINK}")
    e = expect()
    e(page.get_by_role("heading", name=re.compile(name)).first).to_be_visible()
    if path in ("", "trade-offs", "concentration", "decode-timeline"):
        notice = page.locator('[data-testid="stAlert"]').filter(has_text="Too big for this server")
        e(notice).to_be_visible()
        e(notice).to_contain_text("the limit is 1.5 GB")
        e(notice).to_contain_text("Showing the default setting instead")
    if marker:
        e(metric(page, marker)).to_have_text(re.compile(r"/ 544$"))   # the default pattern, usable
    settle(page)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert server_rss_mb(server_pid(app_url)) < 2048
    # Streamlit's frontend, opened on a page's own path, first looks for the server under that path
    # (/<page>/_stcore/health, /host-config) and then at the root: those two 404s are expected.
    probes = [u for u in missing if re.search(rf"/{path}/_stcore/(health|host-config)$", u)] if path else []
    assert len(missing) == len(probes), missing
    page.errors[:] = [x for x in page.errors if "status of 404" not in x] if probes else page.errors
    no_console_errors(page)
