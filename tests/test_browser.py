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
from kvviz.analysis.frames import token_frame
from kvviz.app.cards import card_values
from kvviz.app import livechart
from conftest import TIMEOUT, idle, runs, view
from kvviz.app.studies import studies_root

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


def expect():
    from playwright.sync_api import expect as _expect

    _expect.set_options(timeout=TIMEOUT)
    return _expect


def metric(page, label):
    return page.locator('[data-testid="stMetric"]').filter(has_text=label).locator('[data-testid="stMetricValue"]')


def slider_thumb(page, label):
    return page.locator('[data-testid="stSlider"]').filter(has_text=label).get_by_role("slider")


def shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def no_console_errors(page):
    assert page.errors == [], "browser console errors:\n" + "\n".join(page.errors)


FIRST_SEEN_JS = """
window.__firstSeen = {};
new MutationObserver(() => {
  const seen = window.__firstSeen, now = performance.now();
  const frames = Array.from(document.querySelectorAll('[PENDING]'));
  if (!seen.metric && document.querySelector('[data-testid="stMetricValue"]')) seen.metric = now;
  if (!seen.frames && frames.length) {
    seen.frames = now;
    seen.frameHeights = frames.map(f => Math.round(f.getBoundingClientRect().height));
  }
  if (!seen.chart && document.querySelector('.js-plotly-plot .main-svg')) seen.chart = now;
}).observe(document, {subtree: true, childList: true});
""".replace("PENDING", livechart.PENDING)


def test_shared_url_reproduces_state(page, app_url):
    params = "sink=2&recent=6&heavy=5&bits=4&scorer=tova"
    page.goto(f"{app_url}/?{params}")
    e = expect()
    expected = card_values(
        compare(
            handbook_trace(),
            Spec(sink=2, recent=6, heavy=5, scorer="tova", key_bits=4, value_bits=4, partial="quantize"),
            View(ensemble="seeds"),
        ).metrics
    )
    for label in ("Attention mass retained", "TV distance", "Output error", "Tokens kept", "KV memory"):
        e(metric(page, label)).to_have_text(expected[label])
    e(slider_thumb(page, "Sink tokens")).to_have_value("2")
    e(slider_thumb(page, "Recent window")).to_have_value("6")
    idle(page)
    query = parse_qs(urlparse(page.url).query)
    assert {k: v[0] for k, v in query.items()} == dict(p.split("=") for p in params.split("&"))
    no_console_errors(page)


def test_out_of_range_link_shows_notice(page, app_url):
    page.goto(f"{app_url}/?sink=500&bits=11")
    e = expect()
    e(page.get_by_text("Some settings were adjusted")).to_be_visible()
    e(slider_thumb(page, "Sink tokens")).to_have_value("64")
    no_console_errors(page)


# a page link clicked the moment the Explorer's first chart waits for plotly (kvviz.app.livechart)
CLICK_WHILE_PENDING_JS = """
new MutationObserver((_, watch) => {
  const link = Array.from(document.querySelectorAll('[data-testid="stSidebarNav"] a'))
    .find((a) => a.textContent.trim() === "Concentration");
  if (link && document.querySelector('[PENDING]')) {
    watch.disconnect();
    link.click();
  }
}).observe(document, {subtree: true, childList: true, attributes: true});
""".replace("PENDING", livechart.PENDING)


def test_a_page_link_clicked_while_the_charts_wait_for_plotly_is_followed(page, app_url):
    """A person can click a page link before the Explorer's charts are drawn (plotly is imported after the
    first paint): the link is followed, the charts left behind draw nothing and say nothing in the console,
    and the new page's chart is drawn."""
    page.add_init_script(CLICK_WHILE_PENDING_JS)
    page.set_viewport_size({"width": 1400, "height": 2000})
    page.goto(f"{app_url}/?sink=3")
    e = expect()
    e(page.get_by_role("heading", name=re.compile("Concentration")).first).to_be_visible()
    idle(page)
    assert urlparse(page.evaluate("location.href")).path == "/concentration"
    e(page.locator(".js-plotly-plot").filter(has_text="Top x% of tokens hold").first).to_be_visible()
    assert page.locator(f"[{livechart.PENDING}]").count() == 0
    assert query(page.evaluate("location.href")) == {"sink": "3"}
    no_console_errors(page)


# --- the address bar after every single interaction ---------------------------------------


def address(page) -> dict:
    """The query string of the real address bar (location.href, not Playwright's cached page.url)."""
    return {k: v[0] for k, v in parse_qs(urlparse(page.evaluate("location.href")).query).items()}


def wait_for_address(page, expected: dict) -> None:
    """Wait until the address bar holds exactly `expected`, then check it (one interaction = one update)."""
    page.wait_for_function(
        """(want) => { const got = Object.fromEntries(new URLSearchParams(location.search));
                      return JSON.stringify(Object.entries(got).sort())
                             === JSON.stringify(Object.entries(want).sort()); }""",
        arg=expected,
        timeout=TIMEOUT,
    )
    assert address(page) == expected


@pytest.mark.parametrize(
    "launcher, path",
    [(False, "trade-offs"), (True, "Trade-offs")],
    ids=["streamlit run app.py", "make run, an old address"],
)
def test_a_fresh_server_opens_a_page_link_as_that_page(page, launcher, path):
    """The first request of a freshly started server is a link to a page: it shows that page with the
    app's own navigation, no "Page not found" dialog, under the page's own address. Streamlit takes an
    app with a `pages/` folder for a legacy multipage app until st.navigation has run once; the server's
    start-up hook says it is not one, and a page file run on its own hands its run to app.py
    (kvviz/app/router.py). Both ways of starting the app: the plain `streamlit run app.py` and `make run`'s
    launcher (kvviz.app.serve), the second with an address from before the pages moved to pages/ (a
    page's title: router.page_for_address)."""
    from conftest import serve_app

    with serve_app(ARTIFACTS / f"streamlit-server-fresh-{int(launcher)}.log", launcher=launcher) as url:
        page.goto(f"{url}/{path}?sink=3")
        e = expect()
        e(page.get_by_role("heading", name=re.compile("Trade-offs"))).to_be_visible()
        idle(page)
        dialogs = page.locator('[role="dialog"]')
        assert dialogs.count() == 0, f"a dialog over the page: {dialogs.first.inner_text()}"
        nav = page.locator('[data-testid="stSidebarNav"]').inner_text().split()
        assert [w for w in nav if w] == [
            "Explorer",
            "Trade-offs",
            "Concentration",
            "Model",
            "lab",
            "Decode",
            "timeline",
            "Needle",
            "test",
            "Studies",
        ], nav
        assert urlparse(page.url).path == "/trade-offs"
        assert page.get_by_role("heading", name=re.compile("Trade-offs")).count() == 1  # drawn once
        assert query(page.url) == {"sink": "3"}


# --- a live link after every single interaction, on every page ---------------------------


class LiveLink:
    """Drives one page through single interactions, checking the address bar after each in the same page,
    and the last link in a fresh page once.

    After each move, once the app is idle: the page shows something new; the address bar holds exactly the
    link the move should leave (`link`: the parameters the move sets, and None for one it removes;
    every other parameter as it was); and it held that link by the time the page first showed the
    move's new results (a link written at the end of the run lags the screen). Reading the address bar
    costs nothing; opening a link costs a page load (a fresh session: Streamlit's frontend and plotly.js,
    2-5 CPU-s on a 2-core machine). So done() opens only the link the last move left, in a new page, which
    must show the same view (widget values, metrics, headings, charts) and keep the link as it is; that
    every parameter a link can carry restores its view is checked without a browser, page by page
    (tests/test_app_links.py)."""

    def __init__(self, page, url: str, extra: str | None = None):
        self.page, self.moves, self.folded = page, 0, []
        page.set_default_timeout(TIMEOUT)
        page.set_viewport_size({"width": 1400, "height": 1800})
        self.extra = extra
        page.goto(url)
        self.mark(page)
        idle(page)
        assert address(page) == query(url), "a link must open unchanged (defaults stay out of the URL)"
        self.shown, self.link = view(page), query(url)

    def mark(self, page) -> None:
        if self.extra:
            page.evaluate("(selector) => { window.__kvvizExtra = selector; }", self.extra)

    def act(self, what: str, interaction, link: dict, ready=None) -> None:
        """One interaction and the link it must leave (see the class); `ready(page)`: a locator that is
        visible once the view it leads to is drawn (a page switch: the new page's results), waited for
        before the app counts as idle."""
        page, before = self.page, runs(self.page)
        first_sample = page.evaluate("window.__kvviz.samples.length")
        headline_before = page.evaluate("window.__kvvizHeadline()")
        interaction(page)
        if ready is not None:
            expect()(ready(page)).to_be_visible()
        idle(page, after=before)
        self.moves += 1
        where = f"move {self.moves} ({what})"
        shown, url = view(page), page.url
        assert shown != self.shown, f"{where} changed nothing on the page"
        assert page.evaluate("location.href") == url
        got = query(url)
        want = {k: v for k, v in {**self.link, **link}.items() if v is not None}
        assert got == want, f"{where}: the address bar holds {got}, the move should leave {want}"
        headline, samples = page.evaluate("[window.__kvvizHeadline(), window.__kvviz.samples]")
        if headline != headline_before:  # the results changed: when did the address bar follow?
            seen = next(q for h, q, _ in samples[first_sample:] if h == headline)
            assert seen == "?" * bool(got) + urlparse(url).query, (
                f"{where}: the page showed the new results while the address bar still held '{seen}' "
                f"(it became '?{urlparse(url).query}' later)"
            )
        self.shown, self.link = shown, got

    def unfold(self, title: str) -> None:
        """Open a folded section (its content is drawn once it is open); done() opens it in the new page too:
        which sections a reader opened is not part of the link."""
        unfold(self.page, title, folded=True)
        self.folded.append(title)

    def done(self) -> None:
        """The last move's link, opened in a new page, shows the view the page shows (with the folded
        sections this page opened opened there too) and stays as it is."""
        page, link, shown = self.page, self.page.url, self.shown
        fresh = page.context.new_page()
        try:
            fresh.set_default_timeout(TIMEOUT)
            fresh.goto(link)
            self.mark(fresh)
            idle(fresh)
            for title in self.folded:  # still open here (a page switch folds them again)
                if is_open(page, title):
                    unfold(fresh, title, folded=True)
            again, reopened = view(fresh), fresh.url
            if again != shown:  # for the record: the page from the link (the page's view is in the message)
                shot(fresh, "link-after-the-last-move-from-link")
            diff = {
                k: (shown.get(k), again.get(k)) for k in sorted(set(shown) | set(again)) if shown.get(k) != again.get(k)
            }
            assert not diff, (
                f"after {self.moves} moves, the link {link} opens another view; (on the page, from the link): {diff}"
            )
            assert query(reopened) == query(link), f"opening {link} rewrote it to {reopened}"
        finally:
            fresh.close()
            page.bring_to_front()


def query(url: str) -> dict:
    return {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}


def labelled(page, testid: str, label: str):
    """The widget of this kind whose label is exactly `label`."""
    return page.locator(f'[data-testid="{testid}"]').filter(
        has=page.locator('[data-testid="stWidgetLabel"]', has_text=re.compile(f"^{re.escape(label)}$"))
    )


def key(label: str, *keys: str):
    """Keyboard moves of a slider. A slider drawn again by the run before (a preset sets it) can drop the
    keys sent while it re-mounts: when its value has not moved within 2 s, the keys are sent once more
    (what a person does; the claim under test is the link after the move, not the key delivery)."""

    def press(page):
        slider = labelled(page, "stSlider", label)
        thumb = slider.get_by_role("slider")
        # the thumbs' values only: a slider drawn again can change its text (tick labels) without moving,
        # which once passed for a move while the keys had been dropped
        value = "(w) => Array.from(w.querySelectorAll('input[type=range]')).map(e => e.value).join(',')"
        before = slider.evaluate(value)
        for attempt in range(3):
            thumb.focus()
            for k in keys:
                thumb.press(k)
            try:
                page.wait_for_function(
                    f"([w, v]) => ({value})(w) !== v", arg=[slider.element_handle(), before], timeout=2000, polling=100
                )
                # a re-mount can also come just after the keys moved the thumb and put the old value back
                # (seen once in CI after a preset): moved means still moved a moment later
                page.wait_for_timeout(300)
                if slider.evaluate(value) != before:
                    return
            except Exception:  # noqa: BLE001 - playwright's TimeoutError: not moved yet
                pass
        raise AssertionError(f"the slider {label!r} did not move on {', '.join(keys)}")

    return press


def chart_step(chart_key: str, step: int, steps: int) -> callable:
    """A click on a plotly animation's step slider (the chart keyed `chart_key`), on step `step` of
    `steps` (at its tick: plotly insets the steps from the rail's ends): the chart moves there in the
    browser, and the page hears of it once the slider rests."""

    def click(page):
        rail = page.locator(f".st-key-{chart_key} .slider-rail-touch-rect").first
        rail.scroll_into_view_if_needed()
        standing_still(rail)
        ticks = page.locator(f".st-key-{chart_key} .slider-tick-rect")
        assert ticks.count() == steps, ticks.count()
        box, tick = rail.bounding_box(), ticks.nth(step).bounding_box()
        page.mouse.click(tick["x"] + tick["width"] / 2, box["y"] + box["height"] / 2)

    return click


def number(label: str, value) -> callable:
    def type_in(page):
        box = labelled(page, "stNumberInput", label).locator("input")
        box.fill(str(value))
        box.press("Enter")

    return type_in


def text(label: str, value: str) -> callable:
    def type_in(page):
        box = labelled(page, "stTextInput", label).locator("input")
        box.fill(value)
        box.press("Enter")

    return type_in


def select(label: str, option: str):
    """Choose `option` in a select box as a person does: click the box, click the option.

    Streamlit's select box is a react-aria ComboBox whose list closes when anything around the box
    scrolls (react-aria's close-on-scroll: one pixel of the sidebar is enough). On a busy machine the
    sidebar can still be settling after the previous run or an unfolded expander, so the list
    sometimes closes before the option is clicked (CI, once: three opens, no option). Each try waits
    for the box to stand still first; a list that closes anyway is opened again; after four tries the
    option is chosen with the keyboard (arrow keys to it, Enter), which needs no open list to stay
    put under a pointer. The claim under test is the link after the choice, not the pointer."""

    def pick(page):
        from playwright.sync_api import Error as PlaywrightError

        box = labelled(page, "stSelectbox", label).locator("input")
        wanted = page.get_by_role("option", name=option, exact=True)
        chosen = "([e, v]) => e.value === v"
        page.evaluate(SCROLL_COUNTER_JS)
        for _ in range(4):
            box.evaluate("e => e.scrollIntoView({block: 'center'})")  # mid-viewport: its list fits below it
            standing_still(box)
            box.click()
            if box.get_attribute("aria-expanded") != "true":
                box.press("ArrowDown")
            try:
                wanted.click(timeout=3000)
                page.wait_for_function(chosen, arg=[box.element_handle(), option], timeout=5000)
                return
            except PlaywrightError:  # the list closed under the pointer (or never opened): once more
                if box.get_attribute("aria-expanded") == "true":
                    box.press("Escape")
        for _ in range(2):  # the keyboard: open, arrow keys to the option (no wrapping), Enter
            box.focus()
            if box.get_attribute("aria-expanded") != "true":
                box.press("ArrowDown")
            options, active = page.evaluate(LIST_JS, box.element_handle())
            if option in options and active in options:
                step = options.index(option) - options.index(active)
                for _ in range(abs(step)):
                    box.press("ArrowDown" if step > 0 else "ArrowUp")
                if page.evaluate(LIST_JS, box.element_handle())[1] == option:
                    box.press("Enter")
                    try:
                        page.wait_for_function(chosen, arg=[box.element_handle(), option], timeout=5000)
                        return
                    except PlaywrightError:
                        pass
            box.press("Escape")
        scrolls = page.evaluate("window.__kvvizScrolls")
        shot(page, f"select-{label}")
        raise AssertionError(
            f"could not choose {option!r} in the select box {label!r}: it shows {box.input_value()!r}, its list "
            f"is {'open' if box.get_attribute('aria-expanded') == 'true' else 'closed'}; scroll events around it "
            f"while trying: {scrolls}"
        )

    return pick


# Counts scroll events by where they happened (a select box's list closes on any of them; for the
# failure message of select()).
SCROLL_COUNTER_JS = """() => {
  window.__kvvizScrolls = {};
  if (window.__kvvizScrollsOn) return;
  window.__kvvizScrollsOn = true;
  document.addEventListener('scroll', (e) => {
    const t = e.target, name = t === document ? 'document' : (t.dataset?.testid || t.tagName);
    window.__kvvizScrolls[name] = (window.__kvvizScrolls[name] || 0) + 1;
  }, true);
}"""


# An open select box's options in order, and the one the keyboard is on (react-aria's virtual focus:
# aria-activedescendant on the input).
LIST_JS = """(box) => [
  Array.from(document.querySelectorAll('[role=listbox] [role=option]')).map((o) => o.textContent),
  document.getElementById(box.getAttribute('aria-activedescendant'))?.textContent ?? null]"""


def standing_still(locator, frames: int = 5) -> None:
    """Wait until the element has kept its place on screen for `frames` animation frames, with no
    animation running around it and nothing around it scrolled (a sidebar settling after a run; an
    expander opening: Streamlit animates its height with overflow hidden, and a box focused meanwhile
    scrolls the expander, whose scrolling back closes the box's list)."""
    locator.evaluate(
        """(e, frames) => new Promise((done) => {
      let last = '', same = 0, left = 1200;
      const look = () => {
        const r = e.getBoundingClientRect(), now = `${r.x},${r.y},${r.width},${r.height}`;
        const details = [];
        for (let a = e.parentElement; a; a = a.parentElement) {
          if (a.tagName === 'DETAILS') details.push(a);
        }
        const moving = details.some((d) => d.scrollTop !== 0 || d.getAnimations({subtree: false}).length > 0);
        same = now === last && !moving ? same + 1 : 0; last = now;
        if (same >= frames || --left <= 0) done(); else requestAnimationFrame(look);
      };
      requestAnimationFrame(look);
    })""",
        frames,
    )


def radio(label: str, option: str):
    return lambda page: labelled(page, "stRadio", label).get_by_text(option, exact=True).click()


def tick(label: str):
    return lambda page: labelled(page, "stCheckbox", label).locator("label").first.click()


def press(name: str):
    return lambda page: page.get_by_role("button", name=name, exact=True).click()


def pill(group: str, option: str):
    return lambda page: (
        page.locator('[data-testid="stButtonGroup"]')
        .filter(has_text=group)
        .get_by_role("button", name=option, exact=True)
        .click()
    )


def expander(page, title: str):
    return page.locator('[data-testid="stExpander"]').filter(has=page.locator("summary", has_text=title)).first


def is_open(page, title: str) -> bool:
    section = expander(page, title)
    return section.count() > 0 and section.locator("details").first.evaluate("(d) => d.open")


def unfold(page, title: str, folded: bool = False) -> None:
    """Open an expander and wait until it has finished opening: Streamlit animates its height, and a
    widget touched meanwhile can be scrolled inside it (see standing_still). A plain expander's click is
    no interaction with the app's state; a folded section's (kvviz.app.charts.folded: Advanced, the
    solver) reruns the page, which draws its content: `folded` waits for that run."""
    section = expander(page, title)
    before = runs(page)
    section.locator("summary").first.click()
    if folded:
        idle(page, after=before)
    page.wait_for_function(
        "(d) => d.open && d.getAnimations({subtree: true}).length === 0",
        arg=section.locator("details").first.element_handle(),
        polling="raf",
    )
    standing_still(section.locator("details > :last-child").first)


def test_explorer_link_follows_every_single_interaction(page, app_url):
    live = LiveLink(page, app_url)
    live.act("bits slider, keyboard (the first move)", key("Quantization bits", "ArrowLeft"), {"bits": "8"})
    live.act("heavy-hitter number box", number("Heavy-hitter budget (tokens)", 5), {"heavy": "5"})
    live.act("error bars radio", radio("Error bars show", "95% CI of the mean"), {"bars": "ci95"})
    live.act("error bars select box", select("Error bars over", "none (one row)"), {"ensemble": "none"})
    live.act("y-axis lock toggle", tick("Lock the charts' y-axes"), {"ylock": "0.1", "alock": "0.2"})
    live.act(
        "preset button", press("StreamingLLM"), {"recent": "10", "heavy": "0", "bits": None, "scorer": "streaming"}
    )
    live.act("sink slider, keyboard", key("Sink tokens", "ArrowRight", "ArrowRight"), {"sink": "6"})
    live.act("pin button", press("Pin this setting as A"), {"pin": "sink:6,recent:10,heavy:0,scorer:streaming"})
    live.unfold("Find the smallest cache for a target")
    live.act("Find and apply", press("Find and apply"), {"recent": "55", "sink": None})
    live.unfold("Advanced")
    live.act("checkbox", tick("Separate key and value bits"), {"split": "1"})
    live.act("scorer select box", select("Heavy-hitter scorer", "TOVA (last query)"), {"scorer": "tova"})
    live.act("source radio", radio("Attention source", "Synthetic pattern"), {"source": "synthetic"})
    live.act("layer number box", number("Layer", 1), {"layer": "1"})
    live.done()
    no_console_errors(page)


def test_tradeoffs_link_follows_every_single_interaction(page, app_url):
    live = LiveLink(page, f"{app_url}/trade-offs")
    live.act("measure radio (the first move)", radio("Measure", "Jensen–Shannon"), {"metric": "js"})
    live.act("log axis checkbox", tick("Log memory axis"), {"logx": "0"})
    live.act("bit-width pills", pill("Bit widths", "8"), {"sweep_bits": "16,4,2,8"})
    live.act("sink slider, keyboard", key("Sink tokens", "ArrowRight"), {"sink": "5"})
    live.act("recent number box", number("Recent window (tokens)", 6), {"recent": "6"})
    live.unfold("Advanced")
    live.act(
        "allocation select box", select("Budget allocation", "PyramidKV (per layer, linear)"), {"allocation": "pyramid"}
    )
    plot = page.locator(".js-plotly-plot").filter(has_text="Error vs memory").first
    live.act(
        "chart click: open a point in the Explorer",
        lambda page: plot.locator(".scatterlayer .trace").nth(0).locator(".points path").first.click(force=True),
        {"sink": "0", "recent": "0", "heavy": "0", "bits": "2"},
        ready=lambda page: metric(page, "Tokens kept"),
    )
    expect()(page.get_by_role("heading", name=re.compile("KV-cache compression explorer"))).to_be_visible()
    live.done()
    no_console_errors(page)


def test_concentration_link_follows_every_single_interaction(page, app_url):
    live = LiveLink(page, f"{app_url}/concentration")
    live.act(
        "locality slider, keyboard (the first move)",
        key("Locality: mass in the last … tokens (w)", "ArrowRight"),
        {"window": "17"},
    )
    live.act(
        "sink slider, keyboard",
        key("Sink share counts the first … tokens (the sink tokens)", "ArrowLeft"),
        {"sink": "3"},
    )
    live.act("source radio", radio("Attention source", "Synthetic pattern"), {"source": "synthetic"})
    live.act("context number box", number("Context tokens", 256), {"context": "256"})
    live.act("query step number box", number("Query step", 3), {"step": "3"})
    live.act("pattern preset button", press("Topic shift"), {"steps": "48", "topic_shift": "12"})
    unfold(page, "Pattern knobs")
    live.act("head dim select box", select("Head dim", "32"), {"head_dim": "32"})
    live.act("presentation mode checkbox", tick("Presentation mode"), {"present": "1"})
    live.done()
    no_console_errors(page)


def test_decode_timeline_link_follows_every_single_interaction(page, app_url):
    live = LiveLink(page, f"{app_url}/decode-timeline")
    # one step control, the chart's own slider: the per-step table and the link follow it
    live.act("chart's step slider (the first move)", chart_step("tl_animation", 1, 48), {"tl_step": "1"})
    live.act("layer number box", number("Layer", 1), {"tl_layer": "1"})
    live.act("policies pills", pill("Policies", "TOVA"), {"tl_policies": "h2o,streaming,oracle"})
    live.act("allocation radio", radio("Budget allocation", "AdaKV (per layer, across heads)"), {"allocation": "adakv"})
    live.act("recent slider, keyboard", key("Recent window", "ArrowRight"), {"recent": "9"})
    live.act("need number box", number("Needed at ≥ (attention share)", 0.05), {"tl_need": "0.05"})
    live.act("chart's step slider again", chart_step("tl_animation", 30, 48), {"tl_step": "30"})
    live.act("presentation mode checkbox", tick("Presentation mode"), {"present": "1"})
    live.done()
    no_console_errors(page)


def test_model_lab_link_follows_every_single_interaction(page, app_url):
    live = LiveLink(page, f"{app_url}/model-lab", extra='[data-testid="stMarkdownContainer"] p:has(strong)')
    live.act("text radio (the first move)", radio("Text", "Bakery story (built-in)"), {"lab_text": "bakery"})
    live.act("prompt number box", number("Prompt tokens (compression point)", 128), {"lab_prompt": "128"})
    live.act(
        "re-rotate checkbox",
        tick("Re-rotate kept keys to their cache slots (StreamingLLM's original)"),
        {"lab_rerotate": "1"},
    )
    live.act(
        "question box",
        text("Question after the prompt (optional)", "Who runs the bakery?"),
        {"lab_question": "Who runs the bakery?"},
    )
    live.act(
        "compression point radio",
        radio("Compress the cache", "After the question (query-aware: the scorer sees it)"),
        {"lab_point": "after-question"},
    )
    live.act("preset button", press("StreamingLLM"), {"scorer": "streaming", "heavy": "0", "recent": "22"})
    live.act("heavy slider, keyboard", key("Heavy-hitter budget", "ArrowRight"), {"heavy": "1"})
    live.act("bits slider, keyboard", key("Quantization bits", "ArrowLeft", "ArrowLeft"), {"bits": "7"})
    live.unfold("Advanced")
    live.act("scorer select box", select("Heavy-hitter scorer", "TOVA (last query)"), {"scorer": "tova"})
    live.done()
    no_console_errors(page)


def test_needle_link_follows_every_single_interaction(page, app_url):
    from kvviz.analysis import needle

    if needle.load_default() is None:
        pytest.skip("no shipped needle grid (scripts/needle_default.py writes it)")
    live = LiveLink(page, f"{app_url}/needle-test")
    cells = page.locator(".js-plotly-plot").filter(has_text="needle depth").first.locator(".scatterlayer .trace")
    live.act(
        "chart click (the first move)",
        lambda page: cells.nth(0).locator(".points path").first.click(force=True),
        {"nd_cell": "full:320:0:agnostic"},
    )
    live.act("layer number box", number("Layer", 3), {"nd_layer": "3"})
    live.act("KV head number box", number("KV head", 1), {"nd_head": "1"})
    live.act(
        "classic failure button",
        press("Show the classic failure"),
        {"nd_head": None, "nd_layer": None, "nd_cell": None},
    )
    live.act(
        "chart click on another cell",
        lambda page: cells.nth(1).locator(".points path").nth(1).click(force=True),
        {"nd_cell": "streaming:640:1:agnostic"},
    )
    live.act("presentation mode checkbox", tick("Presentation mode"), {"present": "1"})
    live.done()
    no_console_errors(page)


def test_studies_link_follows_every_single_interaction(page, app_url):
    """The studies root is the tests' own temporary folder (conftest: KVVIZ_STUDIES_DIR); the first move
    runs the shipped synthetic example into it and opens it."""
    import shutil

    shutil.rmtree(studies_root() / "quarter-cache", ignore_errors=True)  # another test may have run it
    picker = f"Study (folders under {studies_root()})"
    drawn = lambda page: page.locator(".js-plotly-plot").filter(has_text="quarter-cache").first  # noqa: E731
    live = LiveLink(page, f"{app_url}/studies")
    live.act(
        "run the shipped example (the first move)",
        press("Run quarter-cache here (seconds)"),
        {"st_metric": "tv", "study": "quarter-cache"},
        ready=drawn,
    )
    live.act("measure radio", radio("Measure", "Jensen–Shannon (≤ ln 2)"), {"st_metric": "js"})
    live.act("measure radio again", radio("Measure", "attention mass retained (0-1)"), {"st_metric": "mass_retained"})
    live.act("study select box: none", select(picker, "— choose a study —"), {"study": None})
    live.act("study select box: the example", select(picker, "quarter-cache"), {"study": "quarter-cache"}, ready=drawn)
    live.act("presentation mode checkbox", tick("Presentation mode"), {"present": "1"})
    live.done()
    no_console_errors(page)


# --- the Model lab's Cancel ----------------------------------------------------------------


@pytest.mark.model
def test_model_lab_cancel_stops_the_run_and_keeps_the_previous_results(page, app_url):
    import time

    import kvviz.models

    if kvviz.models.bundled_model_file() is None:
        pytest.skip("the bundled model is not installed")
    page.set_default_timeout(TIMEOUT)
    page.set_viewport_size({"width": 1400, "height": 1600})
    # a text scored step by step (H2O decides at every step), with greedy tokens side by side: long enough
    # (~7 s on a shared 2-core machine, ~0.1 s a token; Cancel acts in under 1 s there) that a run cut short
    # is told apart from one that finished, and short enough that the test's two runs stay a small part of
    # the suite. (How fast Cancel acts depends on the machine's load: a speed figure, not a pass mark; the
    # full run, timed in the same session under the same load, is the yardstick.)
    page.goto(f"{app_url}/model-lab?lab_prompt=64&lab_cont=48&lab_greedy=16&sink=4&recent=16&heavy=8")
    idle(page)
    e = expect()
    e(page.get_by_role("button", name="Run the model")).to_be_visible()
    page.get_by_role("button", name="Run the model").click()
    perplexity = metric(page, "Perplexity (compressed)")
    e(perplexity).to_be_visible(timeout=max(TIMEOUT, 300_000))  # the first run also loads the model
    idle(page)
    before = perplexity.inner_text()
    finished = page.locator('[data-testid="stExpander"] summary').filter(has_text=re.compile(r"Finished in"))
    e(finished).to_have_count(1)
    full_run = float(re.search(r"Finished in ([0-9.]+) s", finished.inner_text()).group(1))
    page.get_by_role("button", name=re.compile(r"^(Run the model|Run again \(live\))$")).first.click()  # run again
    streamed = page.locator('[data-testid="stStatusWidget"], [data-testid="stExpander"]').filter(
        has_text="Running the model"
    )
    e(page.get_by_role("button", name="Cancel")).to_be_visible()
    e(streamed.first).to_be_visible()  # mid-run
    clicked = time.monotonic()
    page.get_by_role("button", name="Cancel").click()
    e(page.get_by_text("Run cancelled")).to_be_visible()
    stopped = time.monotonic() - clicked
    # the run was cut short: it stopped in well under the time the same run took to the end a moment ago
    assert stopped < full_run / 2, f"Cancel took {stopped:.1f} s; the whole run took {full_run:.1f} s"
    idle(page)
    assert page.locator('[data-testid="stException"]').count() == 0
    e(perplexity).to_have_text(before)  # the previous results are still shown
    e(page.get_by_role("button", name="Run again (live)")).to_be_enabled()  # the stored result is known
    e(page.get_by_role("button", name="Cancel")).to_have_count(0)
    no_console_errors(page)


# --- a projector's 1024 x 768: nothing clipped, legends below, the main chart first ----------

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
    for selector in (
        '[data-testid="stMetricLabel"]',
        '[data-testid="stMetricValue"]',
        '[data-testid="stWidgetLabel"]',
        '[data-testid="stButtonGroup"] button',
        '[data-testid="stMultiSelect"] span',
    ):
        clipped = page.evaluate(CLIPPED_JS, selector)
        assert clipped == [], f"{where}: clipped {selector}: {clipped}"
    for legend in page.evaluate(LEGEND_JS):
        assert legend["below"] and not legend["overTitle"], f"{where}: a legend covers its chart: {legend}"


# the attention chart's compressed bars as plotly drew them: [token position, attention] pairs
COMPRESSED_BARS_JS = """() => document.querySelector('.st-key-attention_chart .js-plotly-plot')._fullData
  .filter((t) => t.name.startsWith('compressed:')).flatMap((t) => Array.from(t.x, (x, i) => [x, t.y[i]]))"""


def test_the_explorer_paints_fits_a_projector_and_follows_each_slider_move(page, app_url):
    """One page load of the Explorer carries its first-paint, projector and slider checks.

    The first paint: a fresh session's page is painted before its charts (kvviz.app.livechart): the metric
    cards come with a frame in each chart's place and no chart; plotly draws into the frames once the page is
    on screen, each chart as tall as its frame, so nothing below them jumps. At a projector's 1024 x 768 nothing is
    clipped. Then each single slider move (one key press) updates the cards to what kvviz.compare computes
    and the address bar to the new link, not the previous one; switching the source writes the source, never
    a stray step=0 (one rule for defaults)."""
    page.add_init_script(FIRST_SEEN_JS)
    page.set_viewport_size({"width": 1400, "height": 2200})
    page.goto(app_url)
    e = expect()
    e(metric(page, "Attention mass retained")).to_have_text("62.9%")
    e(page.get_by_text("0-3, 15, 28, 56-63")).to_be_visible()
    e(page.locator(".js-plotly-plot:visible")).to_have_count(2)  # the expanders' charts stay folded
    idle(page)
    seen = page.evaluate("window.__firstSeen")
    assert max(seen["frames"], seen["metric"]) < seen["chart"], seen
    assert page.locator(f".{livechart.CLASS}:visible").count() == 2
    assert page.locator(f"[{livechart.PENDING}]").count() == 0
    heights = [
        round(page.locator(f".{livechart.CLASS}:visible").nth(i).locator(".main-svg").first.bounding_box()["height"])
        for i in range(2)
    ]
    assert all(abs(h - f) <= 0.05 * f for h, f in zip(heights, seen["frameHeights"])), (heights, seen)
    shot(page, "explorer")
    if os.environ.get("KVVIZ_UPDATE_SCREENSHOT") == "1":
        page.screenshot(path=str(ROOT / "docs" / "explorer.png"), clip={"x": 0, "y": 0, "width": 1400, "height": 1720})

    page.set_viewport_size({"width": 1024, "height": 768})
    e(page.locator(".js-plotly-plot").filter(has_text="Per-token error").first).to_be_visible()
    idle(page)
    assert_nothing_clipped(page, "Explorer")
    shot(page, "after-explorer-1024x768")

    page.set_viewport_size({"width": 1400, "height": 1600})
    e(slider_thumb(page, "Heavy-hitter budget")).to_have_value("2")
    page.evaluate(f"window.__firstSvg = document.querySelector('.st-key-attention_chart .{livechart.CLASS} .main-svg')")
    expected = {}
    moves = [
        ("Heavy-hitter budget", "ArrowRight", "heavy", "3"),
        ("Heavy-hitter budget", "ArrowRight", "heavy", "4"),
        ("Heavy-hitter budget", "ArrowRight", "heavy", "5"),
        ("Quantization bits", "ArrowLeft", "bits", "8"),
        ("Sink tokens", "ArrowRight", "sink", "5"),
        ("Recent window", "ArrowLeft", "recent", "7"),
    ]
    for label, key, name, value in moves:  # one key at a time: each press reruns the app and the cards follow
        thumb = slider_thumb(page, label)
        thumb.focus()
        thumb.press(key)
        e(thumb).to_have_attribute("aria-valuetext", value)
        expected[name] = value
        wait_for_address(page, expected)
        bits = int(expected.get("bits", 16))
        comp = compare(
            handbook_trace(),
            Spec(
                sink=int(expected.get("sink", 4)),
                recent=int(expected.get("recent", 8)),
                heavy=int(expected["heavy"]),
                key_bits=bits,
                value_bits=bits,
                partial="quantize",
            ),
            View(ensemble="seeds", ensemble_size=8),
        )
        shown = card_values(comp.metrics)
        for card in ("Tokens kept", "TV distance", "Attention mass retained"):
            e(metric(page, card)).to_have_text(shown[card])
    # six moves redrew the attention chart in place (the SVG of its first paint), with the core's numbers
    idle(page)
    assert page.evaluate(
        f"window.__firstSvg === document.querySelector('.st-key-attention_chart .{livechart.CLASS} .main-svg')"
    )
    frame = token_frame(comp)
    kept = frame[frame["kept"]]
    assert dict(page.evaluate(COMPRESSED_BARS_JS)) == pytest.approx(dict(zip(kept["position"], kept["compressed"])))
    page.locator('[data-testid="stSidebar"]').get_by_text("Synthetic pattern", exact=True).click()
    wait_for_address(page, {**expected, "source": "synthetic"})
    no_console_errors(page)


def needle_full_cache_cell(page):
    """The full cache's panel comes first: click its first square."""
    plot = page.locator(".js-plotly-plot").filter(has_text="needle depth").first
    plot.locator(".scatterlayer .trace").nth(0).locator(".points path").first.click(force=True)


@pytest.mark.parametrize(
    "name, marker, act, moved",
    [
        (
            "Trade-offs",
            "Error vs memory for every policy",
            lambda page: page.get_by_text("Jensen–Shannon", exact=True).click(),
            {"metric": "js"},
        ),
        (
            "Concentration",
            "Top x% of tokens hold",
            key("Locality: mass in the last … tokens (w)", "ArrowRight"),
            {"window": "17"},
        ),
        (
            "Model lab",
            None,
            lambda page: page.get_by_text("Bakery story (built-in)", exact=True).click(),
            {"lab_text": "bakery"},
        ),
        ("Decode timeline", "Regret per step", chart_step("tl_animation", 1, 48), {"tl_step": "1"}),
        ("Needle test", "needle depth", needle_full_cache_cell, {"nd_cell": "full:320:0:agnostic"}),
    ],
)
def test_every_page_opens_from_the_explorer_fits_a_projector_and_links_its_first_move(
    page, app_url, name, marker, act, moved
):
    """One page load a page: it opens from the Explorer's navigation with the settings the Explorer had
    (they travel with the page), clips nothing at a projector's 1024 x 768 (legends below their charts), and
    its first move is in the address bar at once."""
    grid = None
    if name == "Needle test":
        from kvviz.analysis import needle

        grid = needle.load_default()
        if grid is None:
            pytest.skip("no shipped needle grid (scripts/needle_default.py writes it)")
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?sink=3")
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("13 / 64")
    # the Explorer drawn (its charts too) before the click: a click before the first-paint probe listens
    # is test_a_page_link_clicked_before_the_first_paint_report_is_followed's
    idle(page)
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=name).click()
    e(page.get_by_role("heading", name=re.compile(name)).first).to_be_visible()
    if marker:
        e(page.locator(".js-plotly-plot").filter(has_text=marker).first).to_be_visible()
    else:  # the Model lab waits for a click before it loads a model
        e(page.get_by_role("button", name="Run the model")).to_be_visible()
    if grid is not None and (classic := needle.classic_failure(grid)) is not None:
        e(page.get_by_role("heading", name=re.compile(f"StreamingLLM · {classic[1]} tokens"))).to_be_visible()
    idle(page)
    assert address(page) == {"sink": "3"}  # the settings travel with the page
    assert_nothing_clipped(page, name)
    if name == "Trade-offs":  # the plot keeps its width (it was ~200 px beside a scrolling legend)
        widths = [x["plotWidth"] for x in page.evaluate(LEGEND_JS)]
        assert widths and min(widths) >= 450, widths
    shot(page, f"after-{name.lower().replace(' ', '-')}-1024x768")
    page.set_viewport_size({"width": 1400, "height": 1900})
    shot(page, name.lower())
    if grid is not None and os.environ.get("KVVIZ_UPDATE_SCREENSHOT") == "1":
        page.screenshot(path=str(ROOT / "docs" / "needle.png"), full_page=False)
    act(page)
    wait_for_address(page, {"sink": "3", **moved})
    if grid is not None:
        e(page.get_by_role("heading", name=re.compile(r"^Full cache · "))).to_be_visible()
        e(page.locator(".kvviz-needle-grid")).to_be_visible()
        shot(page, "needle")
    no_console_errors(page)


def test_a_locked_axis_shows_every_bar_on_screen(page, app_url):
    """Axes locked at the default view's scale (0.1 error, 0.2 attention), then sink 1, recent 0, heavy 0: the
    kept token's attention 1.0 and its error ~0.9 are drawn whole inside each chart's plot area (the lock
    widens to them and the title says so), in the browser as the class sees it."""
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?ylock=0.1&alock=0.2&sink=1&recent=0&heavy=0&ensemble=none")
    e = expect()
    e(metric(page, "Tokens kept")).to_have_text("1 / 64")
    idle(page)
    for marker in ("Attention per token", "Per-token error"):
        chart = page.locator(".js-plotly-plot").filter(has_text=marker).first
        reach = chart.evaluate("""(p) => {
          const area = p.querySelector('.bglayer rect, .plot .bg') || p.querySelector('.draglayer .nsewdrag');
          const a = area.getBoundingClientRect();
          const bars = Array.from(p.querySelectorAll('.barlayer .point path')).map(b => b.getBoundingClientRect())
                            .filter(r => r.height > 0);
          return {top: a.top, bottom: a.bottom, highest: Math.min(...bars.map(r => r.top)),
                  lowest: Math.max(...bars.map(r => r.bottom)), title: p.querySelector('.gtitle').textContent};
        }""")
        assert reach["top"] - 1 <= reach["highest"] and reach["lowest"] <= reach["bottom"] + 1, (marker, reach)
        assert "widened" in reach["title"], (marker, reach["title"])
    no_console_errors(page)


def test_presentation_mode_puts_the_lesson_above_the_fold(page, app_url):
    page.set_viewport_size({"width": 1024, "height": 768})
    page.goto(f"{app_url}/?present=1&bits=3")
    e = expect()
    chart = page.locator(".js-plotly-plot").filter(has_text="Attention per token").first
    e(chart).to_be_visible()
    idle(page)
    box = chart.bounding_box()
    assert box["y"] < 768 - 150, f"the main chart starts at y = {box['y']:.0f}, below the fold"
    # the four headline sliders side by side in one line: no label wraps and pushes its slider down
    rails = [
        round(b["y"])
        for b in (
            s.bounding_box()
            for s in page.locator('[data-testid="stMain"] [data-testid="stSlider"] input[type="range"]').all()
        )
    ]
    assert len(rails) == 4 and max(rails) - min(rails) <= 2, rails
    assert_nothing_clipped(page, "presentation mode")
    shot(page, "after-presentation-1024x768")
    no_console_errors(page)


# --- a hostile link: the work budget's notice on every page, the server's memory bounded -------

HUGE_LINK = "source=synthetic&context=1000000000&steps=1000000000&layers=100000&q_heads=100000&kv_heads=100000"


def server_pid(url: str) -> int:
    """The process of the server the app_url fixture started: the one whose command line serves its port."""
    port = urlparse(url).port
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            proc.name.isdigit()
            and b"--server.port" in args
            and args[args.index(b"--server.port") + 1] == str(port).encode()
            and any(a.endswith(b"app.py") for a in args)
        ):
            return int(proc.name)
    raise AssertionError(f"no streamlit process serves port {port}")


def server_rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


# The notice itself, on each of the six pages, is tests/test_app_guard.py's (AppTest: the same page runs, no
# page load); here the browser sees it on the Explorer (the root path) and on a page of its own path (whose
# address the frontend first takes for the server's), and the server's memory after both.
@pytest.mark.parametrize(
    "path, name, marker", [("", "compression explorer", "Tokens kept"), ("decode-timeline", "Decode timeline", None)]
)
def test_the_huge_link_gives_a_notice_and_the_server_stays_small(page, app_url, path, name, marker):
    page.set_viewport_size({"width": 1400, "height": 1600})
    missing = []
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    page.goto(f"{app_url}/{path}?{HUGE_LINK}")
    e = expect()
    e(page.get_by_role("heading", name=re.compile(name)).first).to_be_visible()
    notice = page.locator('[data-testid="stAlert"]').filter(has_text="Too big for this server")
    e(notice).to_be_visible()
    e(notice).to_contain_text("the limit is 1.5 GB")
    e(notice).to_contain_text("Showing the default setting instead")
    if marker:
        e(metric(page, marker)).to_have_text(re.compile(r"/ 544$"))  # the default pattern, usable
    idle(page)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert server_rss_mb(server_pid(app_url)) < 2048
    # Streamlit's frontend, opened on a page's own path, first looks for the server under that path
    # (/<page>/_stcore/health, /host-config) and then at the root: those two 404s are expected.
    probes = [u for u in missing if re.search(rf"/{path}/_stcore/(health|host-config)$", u)] if path else []
    assert len(missing) == len(probes), missing
    page.errors[:] = [x for x in page.errors if "status of 404" not in x] if probes else page.errors
    no_console_errors(page)
