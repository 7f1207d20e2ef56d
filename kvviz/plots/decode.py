"""Plotly figures and HTML for the Model lab and the Decode timeline (data in, figure out).

Pure functions: no Streamlit. Every figure labels its axes with what was computed
(layer, KV head, policy, steps, positions), and the numbers behind each mark are the
ones in the Timeline / Quality objects passed in, which the tests check.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go

from kvviz.plots.style import LEGEND_BELOW, METHOD_COLORS, METHOD_DASH, METHOD_SYMBOLS, REASON_COLORS
from kvviz.analysis.timeline import EVICTED, FUTURE, KEPT, MISSED, STATE_NAMES, Timeline

# Colours mean what they mean on the Explorer (kvviz.plots.figures): kept = sky blue ("kept"),
# evicted = light grey, evicted but needed = vermillion (the evicted colour), not arrived = near white.
STATE_COLOURS = {
    FUTURE: "#f7f7f7",
    EVICTED: "#c8c8c8",
    KEPT: REASON_COLORS["kept (no eviction)"],
    MISSED: REASON_COLORS["evicted"],
}
POLICY_COLOURS = METHOD_COLORS
# compressed again (Spec.compress_every): between two steps
RECOMPRESS_LINE = dict(color="#AA3377", width=2)


def _recompress_label(tl: Timeline) -> str:
    return f"compressed again (every {tl.compress_every} steps)"


def _discrete_scale() -> list:
    n = len(STATE_COLOURS)
    scale = []
    for i, state in enumerate(sorted(STATE_COLOURS)):
        scale += [[i / n, STATE_COLOURS[state]], [(i + 1) / n, STATE_COLOURS[state]]]
    return scale


def state_heatmap(tl: Timeline, policy: str, max_tokens: int = 1200, hover: str = "") -> go.Heatmap:
    """What `policy` holds at each decode step (steps x the last `max_tokens` positions), one colour a
    state (kept, evicted, evicted and needed, not yet seen); `hover` opens each cell's hover text."""
    states = tl.policies[policy].states(tl.positions)  # (S, P)
    lo = max(0, states.shape[1] - max_tokens)
    x = np.arange(lo, states.shape[1])
    return go.Heatmap(
        z=states[:, lo:],
        x=x,
        y=np.arange(tl.n_steps),
        zmin=-0.5,
        zmax=3.5,
        colorscale=_discrete_scale(),
        showscale=False,
        customdata=np.broadcast_to(np.array([tl.tokens[i] for i in x], dtype=object), states[:, lo:].shape),
        text=np.vectorize(STATE_NAMES.get)(states[:, lo:]),
        hovertemplate=hover + "step %{y}<br>token %{x} %{customdata}<br>%{text}<extra></extra>",
    )


def state_legend() -> list[go.Scatter]:
    """Legend entries for the maps' discrete colours (kept, evicted, needed but evicted)."""
    return [
        go.Scatter(
            x=[None],
            y=[None],
            mode="markers",
            name=STATE_NAMES[state],
            marker=dict(size=10, symbol="square", color=STATE_COLOURS[state]),
        )
        for state in (KEPT, EVICTED, MISSED)
    ]


def timeline_map(
    tl: Timeline, policy: str, step: int | None = None, max_tokens: int = 1200, shift_step: int | None = None
) -> go.Figure:
    """Steps x tokens map of what `policy` holds; the chosen step is outlined, a topic shift marked.

    Very long traces show their last `max_tokens` positions (the axis says which).
    """
    pt = tl.policies[policy]
    heat = state_heatmap(tl, policy, max_tokens)
    lo, P = int(heat.x[0]), int(heat.x[-1]) + 1  # the positions shown, and all of them
    fig = go.Figure([heat, *state_legend()])
    if step is not None and 0 <= step < tl.n_steps:
        fig.add_hline(y=step, line=dict(color="#000000", width=1, dash="dot"))
    if shift_step is not None and 0 <= shift_step < tl.n_steps:
        fig.add_hline(
            y=shift_step - 0.5,
            line=dict(color="#000000", width=2, dash="dash"),
            annotation_text="topic shift",
            annotation_position="bottom left",
            annotation=dict(font=dict(size=13, color="#000000"), bgcolor="rgba(255,255,255,0.85)"),
        )
    if lo <= tl.context_len - 0.5 <= P:
        fig.add_vline(
            x=tl.context_len - 0.5,
            line=dict(color="#555555", width=1, dash="dash"),
            annotation_text="compression point",
            annotation_position="top",
        )
    for s in pt.compressed_after:  # the cache was scored again after this step's query
        fig.add_hline(y=s + 0.5, line=RECOMPRESS_LINE)
    if len(pt.compressed_after):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=_recompress_label(tl), line=RECOMPRESS_LINE))
    title = (
        f"{policy}: tokens held at each decode step (layer {tl.model_layer}, KV head {tl.kv_head}, "
        f"budget {tl.spec.budget})"
    )
    if lo:
        title += f" - positions {lo}-{P - 1}"
    return _timeline_layout(fig, title, "token position", "decode step", dict(autorange="reversed"), 320)


def regret_lines(tl: Timeline, labels: dict | None = None, **more) -> list[go.Scatter]:
    """Every policy's regret per decode step, a line each (named by `labels`; `more`: the lines' other
    settings)."""
    labels = labels or {}
    return [
        go.Scatter(
            x=np.arange(tl.n_steps),
            y=pt.regret,
            mode="lines+markers",
            name=labels.get(name, name),
            line=dict(color=POLICY_COLOURS.get(name), dash=METHOD_DASH.get(name, "solid")),
            marker=dict(size=7, symbol=METHOD_SYMBOLS.get(name, "circle")),
            **more,
            hovertemplate=f"{name}<br>step %{{x}}<br>regret %{{y:.4f}}<extra></extra>",
        )
        for name, pt in tl.policies.items()
    ]


def regret_chart(tl: Timeline, step: int | None = None) -> go.Figure:
    """Per-step regret of every policy: full attention mass on tokens it had evicted."""
    fig = go.Figure(regret_lines(tl))
    if step is not None:
        fig.add_vline(x=step, line=dict(color="#000000", width=1, dash="dot"))
    title = (
        "Regret per step: attention the full model put on evicted tokens "
        f"(layer {tl.model_layer}, KV head {tl.kv_head})"
    )
    y_title = "attention mass on evicted tokens"
    return _timeline_layout(fig, title, "decode step", y_title, dict(rangemode="tozero"), 340)


def _timeline_layout(fig: go.Figure, title: str, x_title: str, y_title: str, yaxis: dict, height: int) -> go.Figure:
    """The decode timeline's step charts (tokens held, regret): narrow margins, the legend below."""
    fig.update_layout(
        title=title,
        xaxis_title=x_title,
        yaxis_title=y_title,
        yaxis=yaxis,
        height=height,
        margin=dict(l=50, r=10, t=50, b=40),
        legend=LEGEND_BELOW,
    )
    return fig


def kl_strip(tokens, kl: np.ndarray, first_is_prefill: bool = True) -> go.Figure:
    """Per-token KL(full || compressed) over the continuation, one cell per token."""
    kl = np.asarray(kl, dtype=float)
    labels = [t.replace("\n", "\\n") for t in tokens]
    fig = go.Figure(
        go.Heatmap(
            z=kl[None, :],
            x=np.arange(len(kl)),
            y=["KL"],
            colorscale="Oranges",
            zmin=0,
            customdata=np.array(labels, dtype=object)[None, :],
            hovertemplate="token %{x}: %{customdata}<br>KL %{z:.4f} nats<extra></extra>",
            # the bar as tall as the strip (its title beside it, not above) and 3 ticks: the strip is ~100 px tall
            colorbar=dict(title=dict(text="nats", side="right"), thickness=10, nticks=3),
        )
    )
    title = "Per-token KL(full || compressed) of the next-token distribution"
    # a second line: one line would run past the chart at a projector's 1024 px
    if first_is_prefill:
        title += "<br><sup>token 0 comes from the prefill, before compression</sup>"
    fig.update_layout(
        title=title,
        xaxis_title="continuation token",
        height=210,
        margin=dict(l=40, r=10, t=70 if first_is_prefill else 45, b=40),
    )
    return fig


def nll_chart(tokens, nll: np.ndarray, nll_full: np.ndarray) -> go.Figure:
    """Per-token negative log-likelihood with the full and the compressed cache."""
    x = np.arange(len(nll))
    labels = [t.replace("\n", "\\n") for t in tokens]
    # (values, legend name, hover tag, colour): the full cache first, so the compressed line draws on top
    lines = ((nll_full, "full cache", "full", "#000000"), (nll, "compressed", "compressed", "#D55E00"))
    fig = go.Figure(
        [
            go.Scatter(
                x=x,
                y=y,
                name=name,
                mode="lines",
                line=dict(color=colour),
                customdata=labels,
                hovertemplate=f"%{{customdata}}<br>%{{y:.3f}} nats<extra>{tag}</extra>",
            )
            for y, name, tag, colour in lines
        ]
    )
    fig.update_layout(
        title="Surprise of each true continuation token (-log p)",
        xaxis_title="continuation token",
        yaxis_title="nats",
        height=260,
        margin=dict(l=50, r=10, t=40, b=40),
    )
    return fig


def continuation_html(tokens, first_divergence: int | None, label: str) -> str:
    """A greedy continuation as HTML chips; tokens from the first divergence on are marked."""
    chips = []
    for i, t in enumerate(tokens):
        style = "padding:1px 2px;border-radius:3px;"
        if first_divergence is not None and i >= first_divergence:
            style += "background:#D55E00;color:white;" if i == first_divergence else "background:#fbe3d6;"
        text = html.escape(t).replace("\n", "&#8629;<br>")
        title = f"token {i}" + (" - first divergence" if i == first_divergence else "")
        chips.append(f'<span style="{style}" title="{title}">{text}</span>')
    return (
        f'<div style="font-family:monospace;line-height:1.7;white-space:pre-wrap">'
        f"<b>{html.escape(label)}</b><br>{''.join(chips)}</div>"
    )
