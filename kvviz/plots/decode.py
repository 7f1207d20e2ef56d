"""Plotly figures and HTML for the Model lab and the Decode timeline (data in, figure out).

Pure functions: no Streamlit. Every figure labels its axes with what was computed
(layer, KV head, policy, steps, positions), and the numbers behind each mark are the
ones in the Timeline / Quality objects passed in, which the tests check.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go

from kvviz.plots.style import METHOD_COLORS, METHOD_DASH, METHOD_SYMBOLS, REASON_COLORS, wrap
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


def timeline_map(
    tl: Timeline,
    policy: str,
    step: int | None = None,
    max_tokens: int = 1200,
    shift_step: int | None = None,
) -> go.Figure:
    """Steps x tokens map of what `policy` holds; the chosen step is outlined, a topic shift marked.

    Very long traces show their last `max_tokens` positions (the axis says which).
    """
    pt = tl.policies[policy]
    states = pt.states(tl.positions)  # (S, P)
    P = states.shape[1]
    lo = max(0, P - max_tokens)
    x = np.arange(lo, P)
    fig = go.Figure(
        go.Heatmap(
            z=states[:, lo:],
            x=x,
            y=np.arange(tl.n_steps),
            zmin=-0.5,
            zmax=3.5,
            colorscale=_discrete_scale(),
            showscale=False,
            customdata=np.broadcast_to(
                np.array([tl.tokens[i] for i in x], dtype=object), states[:, lo:].shape
            ),
            text=np.vectorize(STATE_NAMES.get)(states[:, lo:]),
            hovertemplate="step %{y}<br>token %{x} %{customdata}<br>%{text}<extra></extra>",
        )
    )
    for state in (KEPT, EVICTED, MISSED):  # legend entries for the discrete colours
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=STATE_NAMES[state],
                marker=dict(size=10, symbol="square", color=STATE_COLOURS[state]),
            )
        )
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
        fig.add_trace(
            go.Scatter(
                x=[None], y=[None], mode="lines", name=_recompress_label(tl), line=RECOMPRESS_LINE
            )
        )
    title = (
        f"{policy}: tokens held at each decode step (layer {tl.model_layer}, KV head {tl.kv_head}, "
        f"budget {tl.spec.budget})"
    )
    if lo:
        title += f" - positions {lo}-{P - 1}"
    fig.update_layout(
        title=title,
        xaxis_title="token position",
        yaxis_title="decode step",
        yaxis=dict(autorange="reversed"),
        height=320,
        margin=dict(l=50, r=10, t=50, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def regret_chart(tl: Timeline, step: int | None = None) -> go.Figure:
    """Per-step regret of every policy: full attention mass on tokens it had evicted."""
    fig = go.Figure()
    for name, pt in tl.policies.items():
        fig.add_trace(
            go.Scatter(
                x=np.arange(tl.n_steps),
                y=pt.regret,
                mode="lines+markers",
                name=name,
                line=dict(color=POLICY_COLOURS.get(name), dash=METHOD_DASH.get(name, "solid")),
                marker=dict(size=7, symbol=METHOD_SYMBOLS.get(name, "circle")),
                hovertemplate=f"{name}<br>step %{{x}}<br>regret %{{y:.4f}}<extra></extra>",
            )
        )
    if step is not None:
        fig.add_vline(x=step, line=dict(color="#000000", width=1, dash="dot"))
    fig.update_layout(
        title=f"Regret per step: attention the full model put on evicted tokens "
        f"(layer {tl.model_layer}, KV head {tl.kv_head})",
        xaxis_title="decode step",
        yaxis_title="attention mass on evicted tokens",
        yaxis=dict(rangemode="tozero"),
        height=340,
        margin=dict(l=50, r=10, t=50, b=40),
        legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0.0),
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
    fig = go.Figure(
        [
            go.Scatter(
                x=x,
                y=nll_full,
                name="full cache",
                mode="lines",
                line=dict(color="#000000"),
                customdata=labels,
                hovertemplate="%{customdata}<br>%{y:.3f} nats<extra>full</extra>",
            ),
            go.Scatter(
                x=x,
                y=nll,
                name="compressed",
                mode="lines",
                line=dict(color="#D55E00"),
                customdata=labels,
                hovertemplate="%{customdata}<br>%{y:.3f} nats<extra>compressed</extra>",
            ),
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
            style += (
                "background:#D55E00;color:white;"
                if i == first_divergence
                else "background:#fbe3d6;"
            )
        text = html.escape(t).replace("\n", "&#8629;<br>")
        title = f"token {i}" + (" - first divergence" if i == first_divergence else "")
        chips.append(f'<span style="{style}" title="{title}">{text}</span>')
    return (
        f'<div style="font-family:monospace;line-height:1.7;white-space:pre-wrap">'
        f"<b>{html.escape(label)}</b><br>{''.join(chips)}</div>"
    )


def timeline_animation(
    tl: Timeline,
    step: int = 0,
    max_tokens: int = 1200,
    shift_step: int | None = None,
    labels: dict | None = None,
    present: bool = False,
) -> go.Figure:
    """Every chart of the Decode timeline in one figure that plays in the browser.

    Row 1: the regret of every policy per step; then one steps x tokens map per policy.
    A dotted line marks the current step on every chart. The figure carries one frame
    per decode step (only the step lines and the title change), a Play / Pause button and
    a step slider, so playing needs no server round trip. `step` is the frame shown first.

    present: for a projector (Presentation mode): the maps alone (each step's regrets are in
    the title), text at 16 px or more, and Play / Pause and the step slider above the maps, so
    the lesson's move -- play, or drag the slider, and watch the maps -- fits one screen.
    """
    from plotly.subplots import make_subplots

    labels = labels or {}
    names = list(tl.policies)
    S = tl.n_steps
    step = min(max(int(step), 0), S - 1)
    first_map = 1 if present else 2  # the row of the first policy's map
    rows = first_map - 1 + len(names)
    if present:
        # the maps share one token axis (its ticks under the last); between two maps only a panel title
        gap, under, buttons, slider, legend, font = 40, 60, 0, 0, 45, 16
        panel = min(200, max(60, (480 - gap * (len(names) - 1)) // max(len(names), 1)))
        heights = [1 / max(len(names), 1)] * len(names)
        controls = (
            160  # above the maps: Play / Pause, then the step slider, then the first map's title
        )
        bottom = under + legend
        height = panel * len(names) + gap * (len(names) - 1) + bottom
    else:
        heights = [0.28] + [0.72 / max(len(names), 1)] * len(names)
        # Everything in pixels, then as fractions of the plot area: between two panels the upper one's tick
        # labels and axis title and the lower one's title; below the last, its axis, then Play / Pause on a
        # row of their own, the step slider (its "decode step" label above its rail, its ticks below) and the
        # legend.
        gap, under, buttons, slider, legend, font = 95, 55, 45, 85, 60, 14
        controls = 0
        height, bottom = 300 + (260 + gap) * len(names), under + buttons + slider + legend

    def axis(r: int) -> str:  # plotly's name of row r's axes: x, x2, x3, ...
        return "" if r == 1 else str(r)

    # wrapped to fit the chart at a projector's 1024 px (about 650 px wide)
    def title(s: int) -> str:
        regrets = ", ".join(f"{labels.get(n, n)} {tl.policies[n].regret[s]:.3f}" for n in names)
        if present:
            return f"Step {s}<br>" + wrap(f"regret: {regrets}", 52, sep=", ")
        return (
            wrap(
                f"Step {s}: query at position {int(tl.positions[s])} (layer {tl.model_layer}, KV head {tl.kv_head}, "
                f"budget {tl.spec.budget})",
                72,
            )
            + "<br>"
            + wrap(f"regret: {regrets}", 72, sep=", ")
        )

    # the title, then (presenting) the controls, then the first panel's title
    line = 24 if present else 19
    top = (
        (35 if present else 55)
        + line * max(title(s).count("<br>") + 1 for s in range(S))
        + controls
    )
    height += top
    area = height - top - bottom  # the plot area, which paper coordinates divide
    fig = make_subplots(
        rows=rows,
        cols=1,
        row_heights=heights,
        vertical_spacing=gap / area,
        shared_xaxes=present,
        subplot_titles=(
            [] if present else ["Regret per step: attention the full model put on evicted tokens"]
        )
        + [f"{labels.get(n, n)}: tokens held at each decode step" for n in names],
    )
    for name, pt in tl.policies.items() if not present else ():
        fig.add_trace(
            go.Scatter(
                x=np.arange(S),
                y=pt.regret,
                mode="lines+markers",
                name=labels.get(name, name),
                line=dict(color=POLICY_COLOURS.get(name), dash=METHOD_DASH.get(name, "solid")),
                marker=dict(size=7, symbol=METHOD_SYMBOLS.get(name, "circle")),
                legendgroup="regret",
                hovertemplate=f"{name}<br>step %{{x}}<br>regret %{{y:.4f}}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    P = len(tl.tokens) if tl.policies else 0
    for r, name in enumerate(names, start=first_map):
        states = tl.policies[name].states(tl.positions)
        P = states.shape[1]
        lo = max(0, P - max_tokens)
        x = np.arange(lo, P)
        fig.add_trace(
            go.Heatmap(
                z=states[:, lo:],
                x=x,
                y=np.arange(S),
                zmin=-0.5,
                zmax=3.5,
                colorscale=_discrete_scale(),
                showscale=False,
                customdata=np.broadcast_to(
                    np.array([tl.tokens[i] for i in x], dtype=object), states[:, lo:].shape
                ),
                text=np.vectorize(STATE_NAMES.get)(states[:, lo:]),
                hovertemplate=f"{name}<br>step %{{y}}<br>token %{{x}} %{{customdata}}<br>%{{text}}<extra></extra>",
            ),
            row=r,
            col=1,
        )
        fig.update_yaxes(autorange="reversed", title_text="step", row=r, col=1)
    for state in (KEPT, EVICTED, MISSED):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=STATE_NAMES[state],
                marker=dict(size=10, symbol="square", color=STATE_COLOURS[state]),
            ),
            row=first_map,
            col=1,
        )
    fixed = []
    # after these steps' queries the cache was scored again
    for r, name in enumerate(names, start=first_map):
        for s in tl.policies[name].compressed_after:
            fixed.append(
                dict(
                    type="line",
                    xref=f"x{axis(r)} domain",
                    x0=0,
                    x1=1,
                    yref=f"y{axis(r)}",
                    y0=s + 0.5,
                    y1=s + 0.5,
                    line=RECOMPRESS_LINE,
                )
            )
    if any(len(pt.compressed_after) for pt in tl.policies.values()):
        fig.add_trace(
            go.Scatter(
                x=[None], y=[None], mode="lines", name=_recompress_label(tl), line=RECOMPRESS_LINE
            ),
            row=2,
            col=1,
        )
    for r in range(first_map, rows + 1):
        if shift_step is not None and 0 <= shift_step < S:
            fixed.append(
                dict(
                    type="line",
                    xref=f"x{axis(r)} domain",
                    x0=0,
                    x1=1,
                    yref=f"y{axis(r)}",
                    y0=shift_step - 0.5,
                    y1=shift_step - 0.5,
                    line=dict(color="#000000", width=2, dash="dash"),
                )
            )
        if 0 <= tl.context_len - 0.5 <= P:
            fixed.append(
                dict(
                    type="line",
                    yref=f"y{axis(r)} domain",
                    y0=0,
                    y1=1,
                    xref=f"x{axis(r)}",
                    x0=tl.context_len - 0.5,
                    x1=tl.context_len - 0.5,
                    line=dict(color="#555555", width=1, dash="dash"),
                )
            )

    def shapes(s: int) -> list:
        out = [  # the regret chart's step line
            dict(
                type="line",
                xref="x",
                yref="y domain",
                x0=s,
                x1=s,
                y0=0,
                y1=1,
                line=dict(color="#000000", width=1, dash="dot"),
            )
        ][: first_map - 1]
        for r in range(first_map, rows + 1):
            out.append(
                dict(
                    type="line",
                    xref=f"x{axis(r)} domain",
                    yref=f"y{axis(r)}",
                    x0=0,
                    x1=1,
                    y0=s,
                    y1=s,
                    line=dict(color="#000000", width=1.5, dash="dot"),
                )
            )
        return fixed + out

    fig.frames = [
        go.Frame(name=str(s), layout=dict(shapes=shapes(s), title=dict(text=title(s))))
        for s in range(S)
    ]
    play = dict(
        frame=dict(duration=150, redraw=True),
        transition=dict(duration=0),
        fromcurrent=True,
        mode="immediate",
    )
    # the controls: below the last chart (Play / Pause, then the slider), or presenting, above the first
    buttons_y = (controls / area + 1) if present else -under / area
    slider_y = ((controls - 45) / area + 1) if present else -(under + buttons) / area
    fig.update_layout(
        title=dict(
            text=title(step),
            font=dict(size=18 if present else font),
            yref="container",
            y=1,
            yanchor="top",
            pad=dict(t=24 if present else 16),
        ),
        shapes=shapes(step),
        height=height,
        margin=dict(l=50, r=10, t=top, b=bottom),
        legend=dict(
            orientation="h",
            yanchor="top",
            y=-(under + buttons + slider) / area,
            xanchor="left",
            x=0.0,
            font=dict(size=font),
        ),
        updatemenus=[
            dict(
                type="buttons",
                direction="left",
                x=0.0,
                y=buttons_y,
                xanchor="left",
                yanchor="top",
                showactive=False,
                font=dict(size=font),
                pad=dict(t=0, r=10),
                buttons=[
                    dict(label="▶ Play", method="animate", args=[None, play]),
                    dict(
                        label="❚❚ Pause",
                        method="animate",
                        args=[[None], dict(frame=dict(duration=0, redraw=False), mode="immediate")],
                    ),
                ],
            )
        ],
        sliders=[
            dict(
                active=step,
                x=0.0,
                len=1.0,
                y=slider_y,
                yanchor="top",
                pad=dict(t=0),
                currentvalue=dict(prefix="decode step ", font=dict(size=font + 2)),
                font=dict(size=font),
                steps=[
                    dict(
                        label=str(s),
                        method="animate",
                        args=[
                            [str(s)],
                            dict(
                                frame=dict(duration=0, redraw=True),
                                mode="immediate",
                                transition=dict(duration=0),
                            ),
                        ],
                    )
                    for s in range(S)
                ],
            )
        ],
    )
    if not present:
        fig.update_xaxes(title_text="decode step", row=1, col=1)
        fig.update_yaxes(title_text="regret", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="token position", row=rows, col=1)
    # every axis's text set (Streamlit's chart theme sizes unset tick fonts at 13.5 px), the panels' titles too
    fig.update_xaxes(tickfont=dict(size=font), title_font=dict(size=font))
    fig.update_yaxes(tickfont=dict(size=font), title_font=dict(size=font))
    fig.update_annotations(font=dict(size=font + 2 if not present else font))
    return fig
