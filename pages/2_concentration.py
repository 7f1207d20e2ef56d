"""Concentration: how few tokens hold most of the attention, per layer and head."""

import streamlit as st

from kvviz.plots import grids, style, tradeoffs

from kvviz.app.charts import chart
from kvviz.app.cards import concentration_verdict, fmt_pct
from kvviz.app.compute import run_concentration
from kvviz.app.layout import page_setup
from kvviz.app.router import run_page
from kvviz.app.sidebar import sidebar
from kvviz.app.store import w_slider


def main() -> None:
    present = page_setup(
        "Concentration: how few tokens take the attention",
        "Eviction works because attention is concentrated. The curve shows what share of the mass the "
        "top x% of tokens hold; the heatmaps show sinks, locality and entropy per layer and head.",
    )
    settings = sidebar(compression=False, ensemble=False)
    if settings is None:
        return
    source, vs = settings.source, settings.view
    sink_k, window = controls(source.trace.n_positions)
    conc = run_concentration(source, vs.view.step, sink_k, window)
    # Presentation mode: the curve right under its two sliders (a projector's first screen), the cards after
    first, second = st.container(), st.container()
    cards(second if present else first, conc, sink_k, window)
    curve = tradeoffs.concentration_figure(conc.fractions, conc.curves)
    chart(
        style.projector(curve, height=440) if present else curve,
        key="concentration_chart",
        where=first if present else second,
    )
    if present:
        return
    st.markdown(concentration_verdict(conc.fractions, conc.curves))
    st.caption(
        f"What to look for: curves far above the dotted diagonal mean concentrated attention; the shaded "
        f"band is the handbook's rule of thumb (10–20% of tokens take 80–90% of the mass). Query at position "
        f"{conc.position}, {conc.position + 1} tokens."
    )
    if conc.sink_share.size == 1:  # one layer and one head (the handbook): numbers, not 1 x 1 maps
        one_head(conc)
    else:
        heatmaps(conc, sink_k, window, source.trace.layer_numbers)


def controls(n: int) -> tuple[int, int]:
    """How many first tokens count as sinks, and how many last ones as local."""
    c1, c2 = st.columns(2)
    # the same sink count as the Compression sliders (4 for the handbook example), so the share
    # shown is the share those sinks keep
    sink_k = w_slider(
        c1,
        "sink",
        "Sink share counts the first … tokens (the sink tokens)",
        0,
        min(64, n),
        help="The Compression section's Sink tokens: change it here or there.",
    )
    window = w_slider(c2, "window", "Locality: mass in the last … tokens (w)", 1, min(4096, n))
    return sink_k, window


def cards(where, conc, sink_k: int, window: int) -> None:
    """The top 10%'s mass, the sinks' share and the locality, each the mean over layers and heads."""
    m1, m2, m3 = where.columns(3)
    m1.metric(
        "Top 10% of tokens hold",
        fmt_pct(float(conc.top10.mean())),
        border=True,
        help="Mean over layers and heads of the attention mass on the 10% most attended tokens.",
    )
    m2.metric(f"Sink share (first {sink_k})", fmt_pct(float(conc.sink_share.mean())), border=True)
    m3.metric(f"Locality (last {window})", fmt_pct(float(conc.locality.mean())), border=True)


def one_head(conc) -> None:
    e1, e2 = st.columns(2)
    e1.metric(
        "Entropy",
        f"{float(conc.entropy[0, 0]):.2f} nats",
        border=True,
        help=f"Uniform attention over these tokens would be {conc.max_entropy:.2f} nats.",
    )
    e2.metric("Uniform attention would be", f"{conc.max_entropy:.2f} nats", border=True)
    st.caption(
        "This source has one layer and one head, so the per-layer × head maps are single numbers: "
        "they are the cards above."
    )


def heatmaps(conc, sink_k: int, window: int, numbers) -> None:
    """Sink share, locality and entropy per layer (the model's own numbers) and head."""
    maps = (
        ("sink_heatmap", conc.sink_share, f"Sink share (first {sink_k} tokens)", "mass", 1),
        ("locality_heatmap", conc.locality, f"Locality (last {window} tokens)", "mass", 1),
        ("entropy_heatmap", conc.entropy, "Entropy", "nats", conc.max_entropy),
    )
    for where, (key, values, title, unit, top) in zip(st.columns(3), maps):
        chart(grids.heatmap_figure(values, title, unit, 0, top, layers=numbers), key=key, where=where)
    st.caption(
        f"What to look for: sink heads put most mass on the first tokens (bright left map), local heads on "
        f"the last w tokens; low entropy means few tokens matter (uniform attention over these tokens would "
        f"be {conc.max_entropy:.2f} nats)."
    )


run_page(main)
