"""The Decode timeline as one figure that plays in the browser: every policy's regret per step, then one
steps x tokens map per policy, a frame per decode step, ▶ Play / ❚❚ Pause and a step slider."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.analysis.timeline import Timeline
from kvviz.plots.decode import RECOMPRESS_LINE, _recompress_label, regret_lines, state_heatmap, state_legend
from kvviz.plots.style import wrap

PLAY = dict(frame=dict(duration=150, redraw=True), transition=dict(duration=0), fromcurrent=True, mode="immediate")
PAUSE = dict(frame=dict(duration=0, redraw=False), mode="immediate")
JUMP = dict(frame=dict(duration=0, redraw=True), mode="immediate", transition=dict(duration=0))


@dataclass(frozen=True)
class Sizes:
    """The figure's layout in pixels (plotly wants fractions of the plot area: `fraction`). Between two
    panels: the upper one's tick labels and axis title and the lower one's title; below the last: its
    axis (`under`), then (not presenting) Play / Pause, the step slider and the legend."""

    present: bool
    gap: int
    under: int
    buttons: int
    slider: int
    legend: int
    font: int
    controls: int  # presenting: above the maps, Play / Pause, then the step slider
    heights: tuple  # the rows' shares of the plot area
    plot_and_bottom: int  # the plot area and the margin below it (the top comes with the title)

    @property
    def bottom(self) -> int:
        return self.under + self.buttons + self.slider + self.legend

    @classmethod
    def of(cls, maps: int, present: bool) -> Sizes:
        n = max(maps, 1)
        if present:  # the maps share one token axis (ticks under the last): between two maps a title only
            gap, under, legend = 40, 60, 45
            panel = min(200, max(60, (480 - gap * (maps - 1)) // n))
            return cls(
                True,
                gap,
                under,
                0,
                0,
                legend,
                16,
                160,
                (1 / n,) * maps,
                panel * maps + gap * (maps - 1) + under + legend,
            )
        gap, under, buttons, slider, legend = 95, 55, 45, 85, 60
        return cls(
            False, gap, under, buttons, slider, legend, 14, 0, (0.28, *(0.72 / n,) * maps), 300 + (260 + gap) * maps
        )


def _axis(row: int) -> str:
    """plotly's name of a row's axes: x, x2, x3, ..."""
    return "" if row == 1 else str(row)


def step_title(tl: Timeline, labels: dict, present: bool) -> Callable[[int], str]:
    """A step's title: its query (not presenting) and every policy's regret, wrapped to fit the chart at
    a projector's 1024 px (about 650 px wide)."""
    names = list(tl.policies)

    def title(s: int) -> str:
        regrets = ", ".join(f"{labels.get(n, n)} {tl.policies[n].regret[s]:.3f}" for n in names)
        if present:
            return f"Step {s}<br>" + wrap(f"regret: {regrets}", 52, sep=", ")
        query = (
            f"Step {s}: query at position {int(tl.positions[s])} (layer {tl.model_layer}, "
            f"KV head {tl.kv_head}, budget {tl.spec.budget})"
        )
        return wrap(query, 72) + "<br>" + wrap(f"regret: {regrets}", 72, sep=", ")

    return title


def _state_maps(fig: go.Figure, tl: Timeline, first: int, max_tokens: int) -> int:
    """One steps x tokens map per policy, from row `first` on (the last `max_tokens` tokens); then the
    states' legend. Returns the number of positions."""
    positions = len(tl.tokens)
    for row, name in enumerate(tl.policies, start=first):
        heat = state_heatmap(tl, name, max_tokens, hover=f"{name}<br>")
        positions = int(heat.x[-1]) + 1
        fig.add_trace(heat, row=row, col=1)
        fig.update_yaxes(autorange="reversed", title_text="step", row=row, col=1)
    for entry in state_legend():
        fig.add_trace(entry, row=first, col=1)
    if any(len(pt.compressed_after) for pt in tl.policies.values()):
        fig.add_trace(
            go.Scatter(x=[None], y=[None], mode="lines", name=_recompress_label(tl), line=RECOMPRESS_LINE),
            row=first,
            col=1,
        )
    return positions


def _row_line(row: int, y: float, line: dict) -> dict:
    """A line across a map's row (between steps y - 0.5 and y + 0.5: y a half step)."""
    return dict(type="line", xref=f"x{_axis(row)} domain", x0=0, x1=1, yref=f"y{_axis(row)}", y0=y, y1=y, line=line)


def _fixed_lines(tl: Timeline, first: int, shift_step: int | None, positions: int) -> list[dict]:
    """The lines every frame shows: where a cache was scored again, the topic shift, the prompt's end."""
    rows = range(first, first + len(tl.policies))
    lines = [
        _row_line(row, s + 0.5, RECOMPRESS_LINE)
        for row, pt in zip(rows, tl.policies.values())
        for s in pt.compressed_after
    ]
    for row in rows:
        if shift_step is not None and 0 <= shift_step < tl.n_steps:
            lines.append(_row_line(row, shift_step - 0.5, dict(color="#000000", width=2, dash="dash")))
        if 0 <= tl.context_len - 0.5 <= positions:
            lines.append(
                dict(
                    type="line",
                    yref=f"y{_axis(row)} domain",
                    y0=0,
                    y1=1,
                    xref=f"x{_axis(row)}",
                    x0=tl.context_len - 0.5,
                    x1=tl.context_len - 0.5,
                    line=dict(color="#555555", width=1, dash="dash"),
                )
            )
    return lines


def _step_lines(s: int, first: int, maps: int) -> list[dict]:
    """The current step's dotted lines: on the regret chart (when there is one) and across every map."""
    regret = [
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
    ]
    return regret[: first - 1] + [
        _row_line(row, s, dict(color="#000000", width=1.5, dash="dot")) for row in range(first, first + maps)
    ]


def _controls(step: int, steps: int, size: Sizes, area: int) -> dict:
    """▶ Play / ❚❚ Pause and the step slider: below the last chart, or presenting, above the first."""
    if size.present:
        buttons_y, slider_y = size.controls / area + 1, (size.controls - 45) / area + 1
    else:
        buttons_y, slider_y = -size.under / area, -(size.under + size.buttons) / area
    font = dict(size=size.font)
    return dict(
        updatemenus=[
            dict(
                type="buttons",
                direction="left",
                x=0.0,
                y=buttons_y,
                xanchor="left",
                yanchor="top",
                showactive=False,
                font=font,
                pad=dict(t=0, r=10),
                buttons=[
                    dict(label="▶ Play", method="animate", args=[None, PLAY]),
                    dict(label="❚❚ Pause", method="animate", args=[[None], PAUSE]),
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
                currentvalue=dict(prefix="decode step ", font=dict(size=size.font + 2)),
                font=font,
                steps=[dict(label=str(s), method="animate", args=[[str(s)], JUMP]) for s in range(steps)],
            )
        ],
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

    Row 1: the regret of every policy per step; then one steps x tokens map per policy. A dotted line
    marks the current step on every chart. A frame per decode step (only the step lines and the title
    change), Play / Pause and a step slider: playing needs no server. `step`: the frame shown first.

    present: for a projector (Presentation mode): the maps alone (each step's regrets are in
    the title), text at 16 px or more, and Play / Pause and the step slider above the maps, so
    the lesson's move -- play, or drag the slider, and watch the maps -- fits one screen.
    """
    labels, steps, maps = labels or {}, tl.n_steps, len(tl.policies)
    step = min(max(int(step), 0), steps - 1)
    size = Sizes.of(maps, present)
    first = 1 if present else 2  # the row of the first policy's map
    title = step_title(tl, labels, present)
    # the title, then (presenting) the controls, then the first panel's title
    lines = max(title(s).count("<br>") + 1 for s in range(steps))
    top = (35 if present else 55) + (24 if present else 19) * lines + size.controls
    height = size.plot_and_bottom + top
    area = height - top - size.bottom  # the plot area, which paper coordinates divide
    fig = make_subplots(
        rows=first - 1 + maps,
        cols=1,
        row_heights=list(size.heights),
        vertical_spacing=size.gap / area,
        shared_xaxes=present,
        subplot_titles=([] if present else ["Regret per step: attention the full model put on evicted tokens"])
        + [f"{labels.get(n, n)}: tokens held at each decode step" for n in tl.policies],
    )
    if not present:
        fig.add_traces(regret_lines(tl, labels, legendgroup="regret"), rows=1, cols=1)
    fixed = _fixed_lines(tl, first, shift_step, _state_maps(fig, tl, first, max_tokens))
    fig.frames = [
        go.Frame(name=str(s), layout=dict(shapes=fixed + _step_lines(s, first, maps), title=dict(text=title(s))))
        for s in range(steps)
    ]
    fig.update_layout(
        title=dict(
            text=title(step),
            font=dict(size=18 if present else size.font),
            yref="container",
            y=1,
            yanchor="top",
            pad=dict(t=24 if present else 16),
        ),
        shapes=fixed + _step_lines(step, first, maps),
        height=height,
        margin=dict(l=50, r=10, t=top, b=size.bottom),
        legend=dict(
            orientation="h",
            yanchor="top",
            y=-(size.under + size.buttons + size.slider) / area,
            xanchor="left",
            x=0.0,
            font=dict(size=size.font),
        ),
        **_controls(step, steps, size, area),
    )
    if not present:
        fig.update_xaxes(title_text="decode step", row=1, col=1)
        fig.update_yaxes(title_text="regret", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="token position", row=first - 1 + maps, col=1)
    # every axis's text set (Streamlit's chart theme sizes unset tick fonts at 13.5 px), the panels' titles too
    fig.update_xaxes(tickfont=dict(size=size.font), title_font=dict(size=size.font))
    fig.update_yaxes(tickfont=dict(size=size.font), title_font=dict(size=size.font))
    fig.update_annotations(font=dict(size=size.font if present else size.font + 2))
    return fig
