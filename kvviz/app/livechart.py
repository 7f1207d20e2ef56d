"""A plotly chart that a slider move updates in place.

Streamlit's st.plotly_chart keys its chart by an id hashed from the figure, so each move mounts the chart
afresh: plotly builds it from nothing (`Plotly.newPlot`) and lays it out twice. And its chart reads the
figure once, when it mounts, so a stable id would leave the old figure on screen. This component keeps
one plotly chart per key for the life of the page and hands each new figure to `Plotly.react`, which
redraws only what changed (the bars' heights, the title) in the same SVG.

It draws with the plotly code Streamlit itself ships (its PlotlyChart chunk sets `window.Plotly` when it
is evaluated: kvviz.app.internals.plotly_chunk), imported once a page, after the browser has painted the
page for the first time: the 4.7 MB script takes ~0.8 s of the page's one thread, and the sidebar, the
cards and the text come first. Until then the chart is an empty frame of its height that says it is
being drawn, so nothing below it jumps. Where that chunk is gone (another Streamlit), `chart` returns
None and the caller draws st.plotly_chart.

What plotly draws is the figure as kvviz.plots built it, animation frames included (its template gives
it the page's font and colours), not restyled by Streamlit's chart theme. A click on a point of a chart
drawn `selectable` reruns the page with the points picked.
"""

from __future__ import annotations

import functools
import json

import streamlit as st

from kvviz.app import internals
from kvviz.plots.export import figure_json

CLASS = "kvviz-chart"  # the chart's element (plotly adds js-plotly-plot to it once it draws)
PENDING = "data-kvviz-pending"  # on that element until its first figure is drawn
DRAWING = "data-kvviz-drawing"  # on it while a newer figure is being drawn

# One component instance per key: its element (parentElement) stays while the page shows the chart, and
# Streamlit calls this function again with each run's data. A draw already running picks up the newest
# figure when it ends, so a fast run of moves draws the last one, not each in turn.
CHART_JS = (
    """
const paintedThenPlotly = (chunk) => {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window.__kvvizPlotly) {
    const main = document.querySelector('script[type="module"][src*="/static/js/"]');
    const frame = () => new Promise((done) => requestAnimationFrame(done));
    const painted = frame().then(frame);   // two frames: the first paint is on screen
    window.__kvvizPlotly = painted.then(() => import(new URL(chunk, main.src).href)).then(() => window.Plotly);
  }
  return window.__kvvizPlotly;
};

async function draw(chart, Plotly) {
  if (chart.busy || chart.gone) return;   // gone: the page moved on while plotly loaded
  chart.busy = true;
  const plot = chart.plot;
  try {
    while (chart.want !== chart.shown && !chart.gone) {
      const want = chart.want;
      const { figure: { data, layout, frames }, config } = want;
      plot.setAttribute("DRAWING", "");
      const shown = { ...layout, autosize: true };
      delete shown.width;   // the page's column decides
      await Plotly.react(plot, { data, layout: shown, frames: frames || [], config });
      chart.shown = want;
    }
  } finally {
    chart.busy = false;
    plot.removeAttribute("DRAWING");
  }
  if (plot.hasAttribute("PENDING")) {
    plot.removeAttribute("PENDING");
    chart.note.hidden = true;
    // the sidebar opened or closed, the window resized: plotly follows. Not while the chart is hidden or
    // on its way out (plotly refuses a chart that is not displayed: "Resize must be passed a displayed
    // plot div element", CI, once, as a click on the Trade-offs chart left the page).
    let width = plot.clientWidth;
    chart.resized = new ResizeObserver(() => {
      if (chart.gone || !plot.isConnected || plot.offsetParent === null || plot.clientWidth === 0) return;
      if (plot.clientWidth !== width) {
        width = plot.clientWidth;
        Plotly.Plots.resize(plot).catch(() => {});   // hidden between this check and plotly's own
      }
    });
    chart.resized.observe(plot);
    // on a chart whose points can be picked, a click reports them (the run it starts reads them once)
    plot.on("plotly_click", (event) => chart.want.select && chart.report("select", event.points.map((p) => ({
      curve_number: p.curveNumber, point_number: p.pointNumber, point_index: p.pointIndex,
      x: p.x, y: p.y, customdata: p.customdata ?? null,
    }))));
  }
}

export default function ({ data, parentElement, setTriggerValue }) {
  let chart = parentElement.__kvvizChart;
  if (!chart) {
    const note = Object.assign(document.createElement("p"), { textContent: "Drawing the chart…" });
    note.style.cssText = "margin: 0.5rem; opacity: 0.6; font-size: 0.875rem; position: absolute;";
    const plot = Object.assign(document.createElement("div"), { className: "CLASS" });
    plot.setAttribute("PENDING", "");
    parentElement.style.position = "relative";
    parentElement.append(note, plot);
    chart = { plot, note, text: null, want: null, shown: null, busy: false, resized: null };
    parentElement.__kvvizChart = chart;
  }
  chart.report = setTriggerValue;
  const text = new TextDecoder().decode(data);   // a run that changed nothing draws nothing
  if (text !== chart.text) Object.assign(chart, { text, want: JSON.parse(text) });
  chart.plot.style.height = `${chart.want.height}px`;
  paintedThenPlotly(chart.want.chunk).then((Plotly) => draw(chart, Plotly)).catch((error) => {
    Object.assign(chart.note, { textContent: `The chart could not be drawn: ${error}`, hidden: false });
    console.error(error);   // the browser tests fail on any console error
  });
  // Unmounted (another page, a section closed): no Plotly.purge. A draw or an automargin redraw may still
  // be under way, and plotly's next step then read the purged chart's layout and threw (CI, once); the
  // detached chart is collected with its listeners.
  return () => {
    chart.gone = true;
    if (chart.resized) chart.resized.disconnect();
    delete parentElement.__kvvizChart;
  };
}
""".replace("CLASS", CLASS)
    .replace("PENDING", PENDING)
    .replace("DRAWING", DRAWING)
)

NAME = "kvviz_chart"  # the component's name
DEFAULT_HEIGHT = 450  # st.plotly_chart's height for a figure that sets none


@functools.cache
def _component():
    # isolate_styles=False: plotly puts its style sheet (the toolbar, the hover labels) in the document's
    # head, which a shadow root would keep out
    return st.components.v2.component(NAME, js=CHART_JS, isolate_styles=False)


def chart(fig, key: str, where=None, config: dict | None = None, selectable: bool = False) -> list[dict] | None:
    """Draw `fig` (its animation frames too) in place under `key` in `where` (default: the page). Where
    `selectable`, returns the points a click on the chart picked, in the run the click started (else
    []): each with its curve_number, point_number, point_index, x, y and customdata, as st.plotly_chart's
    selection has them. None where this Streamlit has no plotly chunk to draw with (nothing drawn: the
    caller draws st.plotly_chart)."""
    chunk = internals.plotly_chunk()
    if chunk is None:
        return None
    height = int(fig.layout.height or DEFAULT_HEIGHT)
    # bytes: the figure's JSON as plotly wrote it, not escaped again as a string inside Streamlit's JSON
    head = json.dumps({"height": height, "chunk": chunk, "config": config or {}, "select": selectable})
    data = f'{head[:-1]}, "figure": {figure_json(fig)}}}'.encode()
    mount = functools.partial(_component(), key=key, data=data, height=height, on_select_change=lambda: None)
    if where is None:
        result = mount()
    else:
        with where:
            result = mount()
    return list(getattr(result, "select", None) or [])
