"""The budget ledger's chart (kvviz.analysis.ledger): declared vs kept tokens, and bytes stored vs read, per layer."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.analysis.ledger import Ledger
from kvviz.plots.style import LEGEND_BELOW

# Okabe-Ito colours (colour-blind safe), as the other figures use
SINK, RECENT, HEAVY, DECLARED = "#0072B2", "#56B4E9", "#009E73", "#000000"
PAYLOAD, OVERHEAD, FULLPREC, PAGES, READ = "#E69F00", "#D55E00", "#CC79A7", "#999999", "#000000"


def ledger_figure(ledger: Ledger) -> go.Figure:
    """Top: tokens kept per layer (summed over its KV heads) split into sinks / recent / heavy, with the
    declared budget as a marker. Bottom: bytes stored per layer (payload, scale / zero-point overhead,
    16-bit residual and partial groups, Quest's page min / max) with the bytes one step reads."""
    layers = sorted(set(ledger.column("layer").tolist()))
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        subplot_titles=(
            "Tokens per layer (all KV heads): kept vs declared",
            "Bytes per layer: stored (bars) vs read per step (diamonds)",
        ),
    )
    for name, col, colour in (
        ("sinks", "sink", SINK),
        ("recent window", "recent", RECENT),
        ("heavy hitters / all", "heavy", HEAVY),
    ):
        fig.add_bar(
            x=layers, y=ledger.per_layer(col), name=name, marker_color=colour, row=1, col=1, legendgroup="tokens"
        )
    fig.add_scatter(
        x=layers,
        y=ledger.per_layer("declared_tokens"),
        name="declared budget",
        mode="markers",
        marker=dict(symbol="line-ew-open", size=18, color=DECLARED, line=dict(width=3)),
        row=1,
        col=1,
    )
    residual = ledger.per_layer("residual_bytes") + ledger.per_layer("partial_bytes")
    for name, y, colour in (
        ("quantized payload", ledger.per_layer("payload_bytes"), PAYLOAD),
        ("scale / zero-point overhead", ledger.per_layer("overhead_bytes"), OVERHEAD),
        ("16-bit (residual, partial groups, unquantized)", residual, FULLPREC),
        ("page min / max keys (Quest)", ledger.per_layer("page_meta_bytes"), PAGES),
    ):
        if y.sum() > 0:
            fig.add_bar(x=layers, y=y, name=name, marker_color=colour, row=2, col=1)
    fig.add_scatter(
        x=layers,
        y=ledger.per_layer("read_bytes"),
        name="read per step",
        mode="markers",
        marker=dict(symbol="diamond-open", size=9, color=READ),
        row=2,
        col=1,
    )
    fig.add_scatter(
        x=layers,
        y=ledger.per_layer("full_bytes"),
        name="full 16-bit cache",
        mode="lines",
        line=dict(color="#666666", dash="dot"),
        row=2,
        col=1,
    )
    fig.update_layout(barmode="stack", height=560, margin=dict(t=40, b=40, l=60, r=20), legend=LEGEND_BELOW)
    fig.update_xaxes(title_text="layer", row=2, col=1)
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text="bytes", row=2, col=1)
    return fig
