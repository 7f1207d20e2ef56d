"""Figure builders for the cache formats: one head's keys as a channel x token heatmap, before and
after the Hadamard rotation (pure functions: data in, go.Figure out)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.plots.style import layout


def key_rotation_figure(
    k: np.ndarray,
    k_rotated: np.ndarray,
    tokens: Sequence[str] | None = None,
    title: str = "One head's keys, channel × token",
    first_position: int = 0,
) -> go.Figure:
    """Two heatmaps (channels down, tokens across) on one symmetric colour scale: the keys as
    cached, where outlier channels are bright stripes, and the same keys rotated, where their
    energy is spread over every channel. Token i of the arrays sits at position first_position + i."""
    k, kr = np.asarray(k, dtype=np.float64), np.asarray(k_rotated, dtype=np.float64)
    n, d = k.shape
    lim = float(max(np.abs(k).max(initial=0.0), np.abs(kr).max(initial=0.0))) or 1.0
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.04,
        subplot_titles=("as cached (post-RoPE)", "after the Hadamard rotation"),
    )
    labels = list(tokens[:n]) if tokens is not None else [str(i) for i in range(n)]
    for col, (x, name) in enumerate(((k, "before"), (kr, "after")), start=1):
        fig.add_heatmap(
            z=x.T,
            x=first_position + np.arange(n),
            y=np.arange(d),
            zmin=-lim,
            zmax=lim,
            zmid=0,
            colorscale="RdBu_r",
            showscale=col == 2,
            colorbar=dict(title="key value"),
            name=name,
            customdata=np.broadcast_to(np.array(labels, dtype=object)[None, :], (d, n)),
            hovertemplate="channel %{y}<br>token %{x} (%{customdata})<br>%{z:.3f}<extra>" + name + "</extra>",
            row=1,
            col=col,
        )
    fig = layout(fig, title, "token position", "channel", height=420)
    fig.update_xaxes(title_text="token position", row=1, col=2)
    fig.update_yaxes(title_text=None, row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    return fig
