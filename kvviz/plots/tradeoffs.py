"""The Trade-offs and Concentration pages' figures: pure functions, data in -> go.Figure out."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kvviz.policies.registry import is_bound
from kvviz.plots.style import (
    LEGEND_BELOW,
    FORMAT_NAMES,
    METHOD_COLORS,
    METHOD_LABELS,
    OKABE_ITO,
    layout,
    METHOD_DASH,
    point_marker,
    width_legend,
)

# --- trade-offs -----------------------------------------------------------------------------

METRIC_LABELS = {
    "tv": "TV distance (0-1)",
    "kl_compressed_vs_original": "KL(compressed ‖ original), nats",
    "js": "Jensen–Shannon divergence, nats (≤ ln 2)",
    "output_error": "output relative error (‖ô−o‖/‖o‖)",
    "mass_retained": "attention mass retained (0-1)",
}


def tradeoff_figure(
    rows: Sequence[dict],
    metric: str = "tv",
    front: Sequence[int] = (),
    current: dict | None = None,
    log_x: bool = False,
) -> go.Figure:
    """Error against memory ratio: one colour, marker shape, line dash and legend entry per method; the
    bit width fills or opens and sizes the marker, explained once in a bit-width legend.

    `rows` are kvviz.analysis.sweep rows, `metric` the column on the y axis; `front` indexes the
    Pareto-optimal rows (the page leaves the oracle out: no real policy reaches it), drawn
    as a thick dashed line; the oracle itself is a thin dotted black line, the bound;
    `current` ({memory_ratio, <metric>, label}) is the Explorer's setting, a large star.
    Each point carries (method, budget, bits) so a click can open that setting.
    """
    frame = pd.DataFrame(list(rows))
    fig = go.Figure()
    label = METRIC_LABELS.get(metric, metric)
    if len(frame):
        frame = frame.dropna(subset=[metric])
        if "format" not in frame:
            frame["format"] = "int"
        frame["format"] = frame["format"].fillna("int")
        _method_lines(fig, frame, metric, label)
        widths = frame[["bits", "format"]].drop_duplicates()
        width_legend(fig, sorted(zip(widths["bits"], widths["format"]), key=lambda w: (w[1] != "int", -w[0], w[1])))
        if len(front):
            _frontier(fig, [list(rows)[i] for i in front], metric)
    if current is not None and current.get(metric) is not None:
        _star(fig, current, metric, label)
    better = "higher is better" if metric == "mass_retained" else "lower is better"
    fig = layout(
        fig,
        "Error vs memory for every policy",
        "memory ratio vs a 16-bit cache" + (" (log scale)" if log_x else ""),
        f"{label} — {better}",
        height=540,
    )
    fig.update_layout(legend=LEGEND_BELOW, margin=dict(b=130))
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def _method_lines(fig: go.Figure, frame: pd.DataFrame, metric: str, label: str) -> None:
    """A line per (method, bit width, format) over the budgets, one legend entry per method."""
    seen_methods = set()
    for (method, bits, fmt), g in frame.groupby(["method", "bits", "format"], sort=True):
        g = g.sort_values("memory_ratio")
        width = f"{int(bits)}-bit" if fmt == "int" else FORMAT_NAMES.get(fmt, fmt)
        # Quest: x = bytes read per step
        reads = "saves" in g and (g["saves"] == "memory read").all()
        fig.add_scatter(
            x=g["memory_read_ratio"] if reads else g["memory_ratio"],
            y=g[metric],
            mode="lines+markers",
            name=METHOD_LABELS.get(method, method)
            + (" — saves memory read (x: read per step; stores all)" if reads else ""),
            legendgroup=method,
            showlegend=method not in seen_methods,
            line=dict(
                color=METHOD_COLORS.get(method, OKABE_ITO["grey"]),
                width=1.5 if is_bound(method) else 2,  # the bound: thin
                dash=METHOD_DASH.get(method, "solid"),
            ),
            marker=point_marker(method, int(bits), fmt),
            customdata=np.stack([g["method"], g["budget"], g["bits"], g["format"]], axis=1),
            hovertemplate=(
                "<b>%{customdata[0]}</b> budget %{customdata[1]} tokens, "
                + width
                + "<br>memory %{x:.3f} of 16-bit<br>"
                + label
                + " %{y:.4f}"
                "<br>click to open in the Explorer<extra></extra>"
            ),
        )
        seen_methods.add(method)


def _frontier(fig: go.Figure, best: list[dict], metric: str) -> None:
    """The Pareto frontier of the real policies: a thick dashed line."""
    pts = pd.DataFrame(best).sort_values("memory_ratio")
    fig.add_scatter(
        x=pts["memory_ratio"],
        y=pts[metric],
        mode="lines",
        name="Pareto frontier (real policies)",
        line=dict(color=OKABE_ITO["black"], width=4, dash="dash"),
        opacity=0.55,
        hoverinfo="skip",
    )


def _star(fig: go.Figure, current: dict, metric: str, label: str) -> None:
    """The Explorer's current setting: a large star."""
    fig.add_scatter(
        x=[current["memory_ratio"]],
        y=[current[metric]],
        mode="markers",
        name=f"current: {current.get('label', 'explorer setting')}",
        marker=dict(symbol="star", size=20, color=OKABE_ITO["yellow"], line=dict(width=2, color=OKABE_ITO["black"])),
        hovertemplate="current setting<br>memory %{x:.3f}<br>" + label + " %{y:.4f}<extra></extra>",
    )


# --- concentration ----------------------------------------------------------------------------


def _rule_of_thumb(fig: go.Figure, band: tuple) -> None:
    """The handbook's band (a share of the tokens holding a share of the mass), shaded, and its label: low on
    the right, under every curve (which rise above 80% long before x = 55%) and right of the uniform
    diagonal, with an arrow to the band."""
    (x0, x1), (y0, y1) = band
    fig.add_shape(
        type="rect",
        x0=100 * x0,
        x1=100 * x1,
        y0=100 * y0,
        y1=100 * y1,
        fillcolor=OKABE_ITO["yellow"],
        opacity=0.45,
        line=dict(color=OKABE_ITO["black"], width=1, dash="dot"),
        layer="below",
    )
    fig.add_annotation(
        x=100 * (x0 + x1) / 2,
        y=100 * y0,
        ax=62,
        ay=22,
        axref="x",
        ayref="y",
        text="handbook: 10-20% of tokens<br>take 80-90% of the mass",
        showarrow=True,
        arrowhead=2,
        xanchor="left",
        yanchor="middle",
        align="left",
        font=dict(size=12),
        bgcolor="rgba(255,255,255,0.9)",
    )


def concentration_figure(
    fractions: np.ndarray,
    curves: np.ndarray,
    band: tuple = ((0.10, 0.20), (0.80, 0.90)),
    labels: Sequence[str] | None = None,
) -> go.Figure:
    """Share of attention held by the top x% of tokens: one faint line per layer, the mean bold.

    `curves` is (layers, heads, F); the shaded band is the handbook's rule of thumb
    (10-20% of tokens take 80-90% of the mass).
    """
    x = 100 * np.asarray(fractions)
    fig = go.Figure()
    _rule_of_thumb(fig, band)
    per_layer = curves.mean(axis=1)
    for layer, c in enumerate(per_layer):
        fig.add_scatter(
            x=x,
            y=100 * c,
            mode="lines",
            line=dict(width=1, color=OKABE_ITO["sky_blue"]),
            name=labels[layer] if labels else f"layer {layer}",
            opacity=0.6,
            showlegend=len(per_layer) <= 8,
            hovertemplate=f"layer {layer}<br>top %{{x:.0f}}% of tokens hold %{{y:.1f}}%<extra></extra>",
        )
    fig.add_scatter(
        x=x,
        y=100 * curves.mean(axis=(0, 1)),
        mode="lines",
        name="mean over layers and heads",
        line=dict(width=4, color=OKABE_ITO["blue"]),
        hovertemplate="mean<br>top %{x:.0f}% of tokens hold %{y:.1f}%<extra></extra>",
    )
    fig.add_scatter(
        x=x,
        y=x,
        mode="lines",
        name="uniform attention",
        line=dict(dash="dot", color=OKABE_ITO["grey"]),
        hoverinfo="skip",
    )
    fig = layout(
        fig,
        "How concentrated is attention?",
        "top tokens (% of tokens the query sees)",
        "attention mass held (%)",
        height=460,
        subtitle="Top x% of tokens hold y% of the mass",
    )
    fig.update_yaxes(range=[0, 101])
    fig.update_xaxes(range=[0, 100])
    return fig
