"""The page's charts, and the content of a folded section until it is opened.

Every chart is drawn in place (kvviz.app.livechart): its run sends the figure, the component imports
plotly once the page is painted (so the sidebar, the title and the metric cards come first) and hands
each later figure to Plotly.react. Where this Streamlit has no plotly code to lend, a chart is
st.plotly_chart's.

A section that is folded (`folded`: Advanced, the solver, the lesson, the tables) draws its content only
once it is opened, on the first paint and on every slider move after it.
"""

from __future__ import annotations

import functools

import streamlit as st

from kvviz.app import livechart


def folded(label: str, key: str, icon: str | None = None, where=None):
    """An expander whose content is drawn only while it is open: Streamlit's state-tracking expander
    (opening or closing it reruns the page; `.open` says which). The section checks `.open` first and
    draws nothing when it is closed, so a folded section costs a slider move nothing: no widgets built,
    nothing computed, no messages sent (Advanced alone is 19 of a move's 132 messages, and sending a
    message costs the server's script thread and its event loop both). Settings whose widgets are
    folded away keep their values in the store (kvviz.app.store); what a section computes when open
    is cached, so the next move recomputes only what that move changed."""
    return (where or st).expander(label, key=key, icon=icon, on_change="rerun")


def chart(fig, key: str, where=None, config: dict | None = None, selectable: bool = False) -> list[dict]:
    """The figure in `where` (default: the page), drawn in place (kvviz.app.livechart), or st.plotly_chart's
    where this Streamlit has no plotly code to lend. Returns the points a click picked in the run the
    click started (selectable: a click on a point reruns the page), else []."""
    picked = livechart.chart(fig, key, where, config, selectable)
    if picked is not None:
        return picked
    where = where or st
    if not selectable:
        where.plotly_chart(fig, key=key, config=config)
        return []
    event = where.plotly_chart(fig, key=key, config=config, on_select="rerun", selection_mode="points")
    return list(event.selection.points) if event else []


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
