"""What waits: the plotly charts for the browser's first paint of a session, and the content of a folded
section until it is opened.

A browser draws a chart only after it has fetched and run the plotly code (a 4.7 MB script: ~0.8 s of
the page's one thread on a two-core machine) and plotly has laid the chart out. When a session's first
run sent its charts with the rest, the sidebar, the title and the metric cards waited for all of that and
appeared with the charts, ~3 s after the page was opened.

Most charts are drawn in place (kvviz.app.livechart): their first run sends the figure, and the component
imports plotly itself once the page is painted. A chart Streamlit must draw -- one whose points can be
selected, or an animation -- instead waits for a report: until the browser says it has painted the page
once, `chart` draws an empty frame of the chart's height, and `report_first_paint` (the end of every run)
adds a small component that reports when the page is on screen. Its report reruns the page, which draws
the charts into their frames. From then on everything is drawn at once.

A section that is folded (`folded`: Advanced, the solver, the lesson, the tables) draws its content only
once it is opened, on the first paint and on every slider move after it.

Streamlit has no "the page is painted" event, so the probe is a few lines of our own JavaScript, run by
Streamlit's own mechanism for that (st.components.v2: no iframe, no unsafe HTML). Tests under AppTest,
which has no browser, set PAINTED themselves (tests/apptest_util.run_app).
"""

from __future__ import annotations

import functools

import streamlit as st

from kvviz.app import internals, livechart

# session: a run has finished, so the next one comes after the browser drew it
PAINTED = "_kvviz_painted"
WAITING = "kvviz_chart_wait"  # the frames' key prefix (their class: st-key-kvviz_chart_wait_N)
_WAITING_RUN = "_kvviz_waiting"  # session: this run left something for the run after the paint
PROBE_KEY = "_kvviz_first_paint"  # the probe's key (its class: st-key-_kvviz_first_paint)

# After the component is mounted: two animation frames (the first paint is on screen), then report,
# once; a tab in the background paints no frames, so the timer reports then anyway. (Starting the
# plotly code's import here as well made the charts later, not sooner: its 0.8 s then ran while the
# charts' run arrived. Measured with benchmarks/browser.py's fresh visits.)
#
# A person's input before the report (a page link, a widget) starts a run of its own, and that run
# draws the charts too (any second run does). The report must not follow it: Streamlit sends a
# trigger's rerun for the page the browser still shows, and the newer request's page wins on the
# server, so a page link clicked in the first frames sent the reader back to this page (CI, once).
# So input puts the report off; if a run starts meanwhile the report is dropped (that run's end
# unmounts this probe); an input that started no run (a click on empty space) is reported after.
# (Not the browser's sticky user activation for input before this code ran: headless Chromium reports
# it on every load, which put every first report off by 2 s.) A run is seen in stApp's
# data-test-script-state, the attribute Streamlit sets for its own tests; without it, the report
# comes 2 s after the input. The host element says `data-kvviz-listening` once the probe
# listens (the browser test clicks a link then).
#
# With its report the probe asks the browser to fetch and compile Streamlit's plotly chunk
# (`<link rel="modulepreload">`: no evaluation, so nothing waits on the page's one thread) while the
# server runs the charts' run; the browser otherwise starts that 4.7 MB fetch only once the first chart
# arrives. Charts drawn 3.75 -> 3.48 s after the page opens (1024x768, a fresh server each visit, median
# of four each, interleaved). Preloading at the probe's mount competed with the first paint (no gain);
# importing the chunk at the report (evaluating it) was no faster either.
PROBE_JS = """
export default function (component) {
  let sent = false, input = false;
  const host = component.parentElement.host || component.parentElement;
  const preload = () => {   // the chunk sits beside Streamlit's own main script
    const chunk = component.data && component.data.plotly, main = document.querySelector(
      'script[type="module"][src*="/static/js/"]');
    if (!chunk || !main || document.querySelector("link[data-kvviz-plotly]")) return;
    const link = Object.assign(document.createElement("link"),
                               {rel: "modulepreload", href: new URL(chunk, main.src).href});
    link.dataset.kvvizPlotly = "";
    document.head.appendChild(link);
  };
  const report = () => { if (!sent) { sent = true; preload(); component.setTriggerValue("painted", true); } };
  let timer = setTimeout(report, 2000);
  const app = document.querySelector('[data-testid="stApp"]');
  const runs = new MutationObserver(() => {
    if (input && app.dataset.testScriptState === "running") sent = true;   // that run draws the charts
  });
  if (app) runs.observe(app, {attributes: true, attributeFilter: ["data-test-script-state"]});
  const putOff = () => {
    input = true;
    clearTimeout(timer);
    timer = setTimeout(report, 2000);
  };
  const inputs = ["pointerdown", "keydown", "click"];
  inputs.forEach((name) => document.addEventListener(name, putOff, true));
  host.setAttribute("data-kvviz-listening", "");
  requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(() => { if (!input) report(); }, 0)));
  return () => {
    sent = true;
    clearTimeout(timer);
    runs.disconnect();
    inputs.forEach((name) => document.removeEventListener(name, putOff, true));
  };
}
"""


def folded(label: str, key: str, icon: str | None = None, where=None):
    """An expander whose content is drawn only while it is open: Streamlit's state-tracking expander
    (opening or closing it reruns the page; `.open` says which). The section checks `.open` first and
    draws nothing when it is closed, so a folded section costs a slider move nothing: no widgets built,
    nothing computed, no messages sent (Advanced alone is 19 of a move's 132 messages, and sending a
    message costs the server's script thread and its event loop both). Settings whose widgets are
    folded away keep their values in the store (kvviz.app.store); what a section computes when open
    is cached, so the next move recomputes only what that move changed."""
    return (where or st).expander(label, key=key, icon=icon, on_change="rerun")


def painted() -> bool:
    """Has the browser painted this session's page once? Known once a second run starts: every rerun
    after a finished first run comes from the browser (the probe's report, a widget, a page link),
    which has drawn that run by then -- so a report that never arrives costs the charts only until the
    next click, never for good."""
    return bool(st.session_state.get(PAINTED))


def deferred() -> bool:
    """True until the browser has painted this session's page: the caller draws a stand-in and the run
    after the paint draws the real thing."""
    if painted():
        return False
    st.session_state[_WAITING_RUN] = True
    return True


def chart(fig, key: str, where=None, **kwargs):
    """The figure in `where` (default: the page). A chart with neither selection events nor animation
    frames is drawn in place (kvviz.app.livechart: it waits for the first paint by itself). Any other is
    st.plotly_chart(fig, key=key, **kwargs), or, before the first paint, an empty frame of the chart's
    height that the next run fills. Returns the chart's event (its selection) or None."""
    if "on_select" not in kwargs and not fig.frames and livechart.chart(fig, key, where, kwargs.get("config")):
        return None
    where = where or st
    if not deferred():
        return where.plotly_chart(fig, key=key, **kwargs)
    height = int(fig.layout.height or livechart.DEFAULT_HEIGHT)
    where.container(height=height, border=True, key=f"{WAITING}_{key}").caption("Drawing the chart…")
    return None


@functools.cache
def _probe():
    return st.components.v2.component("kvviz_first_paint", js=PROBE_JS)


def report_first_paint() -> None:
    """The end of every run: if this run left a chart as a frame, ask the browser to say when it has
    painted the page; its report reruns the page, which draws the charts. The report carries nothing
    to keep: that rerun is the news (PAINTED is set here, as the run ends)."""
    # set only by deferred(), so only before the paint
    if st.session_state.pop(_WAITING_RUN, False):
        _probe()(key=PROBE_KEY, data={"plotly": internals.plotly_chunk()}, on_painted_change=lambda: None)
    st.session_state[PAINTED] = True


# A plotly animation's own step slider and Play run in the browser, with no rerun; this reports the
# step it rests on back to the app (after the slider has been still for a moment, so a Play reports
# where it paused, not every frame), so one control -- the chart's -- drives the chart, the page's
# per-step table and the link. It finds the chart by its key's class (st-key-<key>, Streamlit's class
# for a keyed element) and follows it when a rerun draws it anew.
STEP_JS = """
export default function (component) {
  const { setStateValue, data } = component;
  let chart = null, timer = null, last = data.step;
  const report = () => {
    const slider = chart && chart._fullLayout && (chart._fullLayout.sliders || [])[0];
    if (slider && slider.active !== last) { last = slider.active; setStateValue("step", last); }
  };
  const moved = () => { clearTimeout(timer); timer = setTimeout(report, data.still_ms); };
  const follow = () => {
    const found = document.querySelector(`.st-key-${data.chart} .js-plotly-plot`);
    if (found && found !== chart && typeof found.on === "function") {
      chart = found;
      chart.on("plotly_sliderchange", moved);
      chart.on("plotly_animated", moved);
    }
  };
  follow();
  const poll = setInterval(follow, 300);
  return () => { clearInterval(poll); clearTimeout(timer); };
}
"""


@functools.cache
def _step_reporter():
    return st.components.v2.component("kvviz_chart_step", js=STEP_JS)


def chart_step(chart_key: str, step: int, key: str, on_change) -> None:
    """Report where the chart `chart_key`'s animation slider comes to rest: `on_change` runs (before the
    rerun, as a widget's callback) with the step in st.session_state[key]. `step` is the step the page
    shows now (the browser reports only another one)."""
    _step_reporter()(key=key, data={"chart": chart_key, "step": int(step), "still_ms": 600}, on_step_change=on_change)
