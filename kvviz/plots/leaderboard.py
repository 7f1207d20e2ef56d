"""The leaderboard chart: score against compression ratio, one line per method, one panel per question protocol
(kvpress's leaderboard plot), the full cache's score as a dashed line across each panel."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.plots.style import FONT, LEGEND_BELOW, METHOD_COLORS, METHOD_DASH, METHOD_LABELS, METHOD_SYMBOLS

# a wrapper over a scorer in a method's name (adakv-snapkv): what the legend adds, and the line's dash
WRAPPERS = {"adakv": ("AdaKV", "dot"), "pyramid": ("PyramidKV", "dash"), "merge": ("merged", "dashdot")}


def method_look(method: str) -> tuple[str, str, str, str]:
    """(label, colour, symbol, dash) of a leaderboard method: a scorer's own look, or a wrapper over one
    (adakv-snapkv, merge-snapkv: SnapKV's colour, open markers and the wrapper's dash)."""
    wrapper, _, scorer = method.partition("-") if method.split("-")[0] in WRAPPERS else ("", "", method)
    label = METHOD_LABELS[scorer] if scorer in METHOD_LABELS else scorer
    if wrapper:
        name, dash = WRAPPERS[wrapper]
        return f"{label} ({name})", METHOD_COLORS[scorer], f"{METHOD_SYMBOLS[scorer]}-open", dash
    return label, METHOD_COLORS[scorer], METHOD_SYMBOLS[scorer], METHOD_DASH[scorer]


def leaderboard_figure(board, height: int = 460) -> go.Figure:
    """Score (% right) against the ratio each method reached, per protocol; hover names the nominal ratio."""
    protocols = board.request.protocols
    fig = make_subplots(
        rows=1, cols=len(protocols), shared_yaxes=True, subplot_titles=protocols, horizontal_spacing=0.06
    )
    scores = board.scores()
    for col, protocol in enumerate(protocols, start=1):
        mine = [s for s in scores if s["protocol"] == protocol]
        full = next((s for s in mine if s["method"] == "full"), None)
        if full is not None:
            fig.add_hline(
                y=100 * full["score"],
                line=dict(color="#555555", dash="dash", width=1),
                annotation_text="full cache" if col == 1 else None,
                row=1,
                col=col,
            )
        for method in board.request.methods:
            rows = sorted((s for s in mine if s["method"] == method), key=lambda s: s["ratio"])
            if not rows:
                continue
            label, colour, symbol, dash = method_look(method)
            fig.add_trace(
                go.Scatter(
                    x=[s["ratio_reached"] for s in rows],
                    y=[100 * s["score"] for s in rows],
                    customdata=[[s["ratio"], s["cells"]] for s in rows],
                    mode="lines+markers",
                    name=label,
                    legendgroup=method,
                    showlegend=col == 1,
                    line=dict(color=colour, dash=dash, width=2),
                    marker=dict(symbol=symbol, size=9, color=colour),
                    hovertemplate=f"{label}<br>ratio %{{x:.2f}} (asked %{{customdata[0]:g}})<br>"
                    "score %{y:.0f}% of %{customdata[1]} prompts<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="compression ratio", range=[0, 1], row=1, col=col)
    fig.update_yaxes(title_text="score (% right)", range=[-5, 105], row=1, col=1)
    fig.update_layout(
        title=dict(
            text=f"Leaderboard: {board.model}, {len(board.request.tasks)} tasks<br><sup>score (% right) against "
            "the compression ratio (the share of the prompt's cache removed), per question protocol</sup>",
            x=0.01,
        ),
        height=height,
        font=FONT,
        margin=dict(l=60, r=20, t=90, b=50),
        legend=LEGEND_BELOW,
        template="kvviz",
    )
    return fig
