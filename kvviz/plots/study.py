"""A study's frontier: the mean over seeds / texts / prompts of each (method, bits, budget), with
95% t-interval error bars, one line per method and bit width, the Pareto frontier dashed."""

from __future__ import annotations

import plotly.graph_objects as go

from kvviz.analysis.study.frontier import METHOD_COLUMN, Frontier
from kvviz.policies.registry import is_bound
from kvviz.plots.style import (
    LEGEND_BELOW,
    METHOD_COLORS,
    METHOD_LABELS,
    OKABE_ITO,
    layout,
    METHOD_DASH,
    point_marker,
    width_legend,
    width_name,
)

X_TITLES = {
    "memory_ratio": "memory ratio (compressed / 16-bit cache bytes)",
    "budget": "cache budget (share of the prompt's tokens)",
}
# eval-sweep's quantizers by their published names; the rest as the Trade-offs chart names them
LABELS = {
    **METHOD_LABELS,
    "kivi-2bit": "KIVI 2-bit",
    "kivi-2bit-rotated": "KIVI 2-bit, rotated keys",
    "kv-4bit": "K/V 4-bit",
    "kv-8bit": "K/V 8-bit",
    "fp16": "fp16 (full cache)",
    "nvfp4": "NVFP4",
    "mxfp4": "MXFP4",
    "hf-qc-4bit": "HF QuantizedCache 4-bit",
    "hf-qc-2bit": "HF QuantizedCache 2-bit",
}
CLICK = {"synthetic": "click to open in the Explorer", "model": "click to open in the Model lab", "needle": ""}


def _study_lines(fig: go.Figure, fr: Frontier) -> None:
    """A line per (model,) method and width over the budgets, its means with their 95% error bars; a point's
    customdata (cell, budget, N, half-width) says which cell a click opens."""
    pts, method_col = fr.points, METHOD_COLUMN[fr.kind]
    models = sorted(pts["model"].unique()) if "model" in pts else [None]
    seen = set()
    fmt_of = (lambda g: g["format"].iloc[0]) if "format" in pts else (lambda g: "int")
    series = [c for c in ("model", method_col, "bits", "format") if c in pts]
    for _, g in pts.groupby(series, sort=True):
        g = g.sort_values("x")
        method, bits, fmt = g[method_col].iloc[0], int(g["bits"].iloc[0]), fmt_of(g)
        model = g["model"].iloc[0] if "model" in g else None
        name = LABELS.get(method, method) + (f" · {model}" if model is not None and len(models) > 1 else "")
        fig.add_scatter(
            x=g["x"],
            y=g["mean"],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            showlegend=name not in seen,
            error_y=dict(type="data", array=g["half"], visible=True, thickness=1.2, width=4),
            line=dict(
                color=METHOD_COLORS.get(method, OKABE_ITO["grey"]),
                width=1.5 if is_bound(method) else 2,  # the bound: thin
                dash=METHOD_DASH.get(method, "solid"),
            ),
            marker=point_marker(method, bits, fmt),
            customdata=g[["cell", "budget", "n", "half"]].to_numpy(),
            hovertemplate=(
                f"<b>{name}</b>, {width_name(bits, fmt)}<br>budget %{{customdata[1]:.3g}}<br>x %{{x:.3f}}<br>"
                f"{fr.label} %{{y:.4f}} ± %{{customdata[3]:.4f}} (95% t, N = %{{customdata[2]}} "
                f"{fr.replicates})" + (f"<br>{CLICK[fr.kind]}" if CLICK[fr.kind] else "") + "<extra></extra>"
            ),
        )
        seen.add(name)


def frontier_figure(
    fr: Frontier, x_column: str = "memory_ratio", log_x: bool = False, title: str = "Study frontier"
) -> go.Figure:
    """One line per (model,) method and width over the budgets; each point carries its cell id
    (customdata[0]) so a click can open a cell with that setting."""
    fig = go.Figure()
    pts = fr.points
    if len(pts):
        _study_lines(fig, fr)
        widths = pts[[c for c in ("bits", "format") if c in pts]].drop_duplicates()
        width_legend(fig, [(w["bits"], w.get("format", "int")) for _, w in widths.iterrows()])
        if fr.front:
            best = pts.loc[fr.front].sort_values("x")
            fig.add_scatter(
                x=best["x"],
                y=best["mean"],
                mode="lines",
                name="Pareto frontier (real policies, means)",
                line=dict(color=OKABE_ITO["black"], width=4, dash="dash"),
                opacity=0.5,
                hoverinfo="skip",
            )
    better = "higher is better" if fr.higher_is_better else "lower is better"
    n = int(pts["n"].max()) if len(pts) else 0
    fig = layout(
        fig,
        title,
        X_TITLES.get(x_column, x_column) + (", log scale" if log_x else ""),
        f"{fr.label} — {better}",
        height=540,
        subtitle=f"mean over {n} {fr.replicates}; error bars: 95% t-interval for the mean",
    )
    fig.update_layout(legend=LEGEND_BELOW, margin=dict(b=130))
    if log_x:
        fig.update_xaxes(type="log")
    return fig
