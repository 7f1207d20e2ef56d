"""The Explorer's figures: pure functions, data in -> go.Figure (or HTML) out (no Streamlit).
Colours, fonts and the shared layout are kvviz.plots.style's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from kvviz.plots.style import (
    OKABE_ITO,
    ORIGINAL_COLOR,
    PART_COLORS,
    REASON_COLORS,
    REASON_PATTERNS,
    base_layout,
    data_reach,
    locked_axis,
)

# --- explorer ----------------------------------------------------------------------------


def _token_axis(frame: pd.DataFrame, text_tokens: bool, max_labels: int = 48) -> dict:
    """The x axis's real-text ticks (every k-th token when there are many); none without text tokens."""
    if not text_tokens:
        return {}
    step = max(1, -(-len(frame) // max_labels))
    at = frame["position"].to_numpy()[::step]
    labels = [t.replace("\n", "↵").strip() or "␣" for t in frame["token"].astype(str).to_numpy()[::step]]
    return dict(tickmode="array", tickvals=at, ticktext=[w[:10] for w in labels], tickangle=-60)


def _figure(traces: list[dict], look: dict, x_axis: dict, y_axis: dict) -> go.Figure:
    """One figure from plain dicts: `look` is style.base_layout(...) plus the chart's own settings, and
    the axis dicts are merged into its axes. Built without plotly's validation (its own `_validate`
    switch, 3x faster on every slider move); tests/test_figures.py validates every builder's output.
    The kvviz template as an object, not plotly's default: Streamlit makes its own theme the
    default where its plotly module is first imported, which can come after kvviz.plots.style."""
    look["xaxis"] = {**look["xaxis"], **x_axis}
    look["yaxis"] = {**look["yaxis"], **y_axis}
    look["template"] = pio.templates["kvviz"]
    return go.Figure(data=traces, layout=look, _validate=False)


def _points(x, y, name: str, marker: dict, hovertemplate: str, **more) -> dict:
    """A trace of markers, in plotly's dict form."""
    return dict(type="scatter", x=x, y=y, mode="markers", name=name, marker=marker, hovertemplate=hovertemplate, **more)


# a pinned setting A's values: open diamonds on either chart
PINNED_MARKER = dict(symbol="diamond-open", size=7, color=OKABE_ITO["black"], line=dict(width=1.5))


def attention_figure(
    frame: pd.DataFrame,
    title: str = "Attention per token: original vs compressed",
    row: str = "",
    text_tokens: bool = False,
    pinned: pd.DataFrame | None = None,
    pinned_label: str = "A",
    y_top: float | None = None,
) -> go.Figure:
    """Grouped bars per token: original (grey) and compressed coloured by why the token was kept, with
    a pattern each as well (REASON_PATTERNS: sink dotted, recent lined, heavy hitter crossed).

    Evicted tokens have no compressed bar, and their original bar is hatched vermillion
    (shape and colour), so a long run of evictions reads as one band, not a wall of marks.
    `frame` is `kvviz.analysis.frames.token_frame`; `row` names the one row shown; `text_tokens`
    puts the real text on the axis; `pinned` (a token_frame of a pinned setting A) adds A's
    compressed attention as open diamonds; `y_top` locks the y-axis at [0, y_top].
    """
    hover = (
        "<b>%{customdata[0]}</b> (position %{x})<br>original %{customdata[1]:.4f}"
        "<br>compressed %{customdata[2]:.4f}<br>%{customdata[3]}<extra></extra>"
    )
    custom = np.stack([frame["token"].astype(str), frame["original"], frame["compressed"], frame["reason"]], axis=1)
    position, original, compressed = (frame[c].to_numpy() for c in ("position", "original", "compressed"))
    reason = frame["reason"].to_numpy()

    def bars(sel: np.ndarray, values: np.ndarray, name: str, group: str, marker: dict) -> dict:
        return dict(
            type="bar",
            x=position[sel],
            y=values[sel],
            name=name,
            marker=marker,
            offsetgroup=group,
            customdata=custom[sel],
            hovertemplate=hover,
        )

    ev = reason == "evicted"
    traces = [bars(~ev, original, "original", "original", dict(color=ORIGINAL_COLOR))]
    if ev.any():
        traces.append(bars(ev, original, "evicted: original (now 0)", "original", _evicted_marker()))
    for why in REASON_COLORS:
        sel = reason == why
        if why != "evicted" and sel.any():
            traces.append(bars(sel, compressed, f"compressed: {why}", "compressed", _kept_marker(why)))
    if pinned is not None:
        traces.append(
            _points(
                pinned["position"].to_numpy(),
                pinned["compressed"].to_numpy(),
                f"pinned {pinned_label}: compressed",
                PINNED_MARKER,
                "pinned: %{y:.4f}<extra></extra>",
            )
        )
    y_axis, lock_note = locked_axis(
        y_top, data_reach(original, compressed, [] if pinned is None else pinned["compressed"])
    )
    look = base_layout(
        title,
        "token" if text_tokens else "token position (index)",
        "attention weight (probability)",
        subtitle=_one_row(row) + lock_note,
    )
    look.update(barmode="group", bargap=0.15, bargroupgap=0.0)
    return _figure(traces, look, _token_axis(frame, text_tokens), y_axis)


def _evicted_marker() -> dict:
    """An evicted token's original bar: hatched vermillion, light, so a long run of evictions reads as a band."""
    return dict(
        color="rgba(213, 94, 0, 0.35)",
        line=dict(color=REASON_COLORS["evicted"], width=0.5),
        pattern=dict(shape="/", fgcolor=REASON_COLORS["evicted"], size=5),
    )


def _kept_marker(why: str) -> dict:
    """A kept token's compressed bar: the colour and the pattern of why it was kept."""
    pattern = dict(shape=REASON_PATTERNS[why], fgcolor="#ffffff", size=4, solidity=0.35)
    return dict(color=REASON_COLORS[why], pattern=pattern)


def _one_row(row: str) -> str:
    return f"one row: {row}" if row else "one row (the primary row, not an ensemble mean)"


# a bin's bars on hover: its tokens, both masses, what it kept (customdata of binned_attention_figure)
BIN_HOVER = (
    "<b>tokens %{customdata[0]}-%{customdata[1]}</b> (%{customdata[2]} ... %{customdata[3]})"
    "<br>original %{customdata[4]:.4f}<br>compressed %{customdata[5]:.4f}"
    "<br>kept %{customdata[6]} of %{customdata[7]}; evicted mass %{customdata[8]:.4f}<extra></extra>"
)


def binned_attention_figure(
    frame: pd.DataFrame,
    title: str = "Attention mass per bin of tokens: original vs compressed",
    row: str = "",
    y_top: float | None = None,
) -> go.Figure:
    """Long sequences: one bar pair per bin; the original bar splits into kept (grey) and evicted
    (vermillion, hatched) mass, the compressed bar beside it, each the sum over the bin's tokens; a black
    tick marks the largest single token's original attention in the bin (how peaked the bin is).

    `frame` is `kvviz.analysis.frames.binned_frame` (of the whole row or a range of it): 4 traces of one
    point per bin, whatever the row's length.
    """
    width = float(frame["tokens"].max())
    centers = (frame["start"] + (frame["tokens"] - 1) / 2).to_numpy()
    columns = ("start", "end", "first_token", "last_token", "original", "compressed", "kept_tokens")
    custom = np.stack(
        [frame[c].astype(str) if c.endswith("_token") else frame[c] for c in columns]
        + [frame["tokens"], frame["evicted_mass"]],
        axis=1,
    )
    hover = BIN_HOVER
    kept_mass = (frame["original"] - frame["evicted_mass"]).to_numpy()

    def bars(y: np.ndarray, name: str, offset: float, marker: dict, **more) -> dict:
        return dict(
            type="bar",
            x=centers,
            y=y,
            width=width * 0.45,
            offset=offset,
            name=name,
            marker=marker,
            customdata=custom,
            hovertemplate=hover,
            **more,
        )

    traces = [
        bars(kept_mass, "original: kept tokens", -width * 0.45, dict(color=ORIGINAL_COLOR)),
        bars(
            frame["evicted_mass"].to_numpy(),
            "original: evicted tokens",
            -width * 0.45,
            dict(color=REASON_COLORS["evicted"], pattern=dict(shape="x")),
            base=kept_mass.tolist(),  # plotly sends "base" as a list (its validator takes any value)
        ),
        bars(frame["compressed"].to_numpy(), "compressed", 0, dict(color=REASON_COLORS["kept (no eviction)"])),
    ]
    if "original_max" in frame:
        traces.append(
            _points(
                centers,
                frame["original_max"].to_numpy(),
                "original: largest single token in the bin",
                dict(symbol="line-ew-open", size=10, color=OKABE_ITO["black"], line=dict(width=2)),
                "<b>tokens %{customdata[0]}-%{customdata[1]}</b><br>largest single token %{y:.4f}<extra></extra>",
                customdata=custom,
            )
        )
    y_axis, lock_note = locked_axis(
        y_top, data_reach(frame["original"], frame["compressed"], frame.get("original_max", []))
    )
    look = base_layout(
        title,
        f"token position {_span(frame)} (bins of {int(width)} tokens)",
        "attention mass per bin (sum)",
        subtitle=_one_row(row) + lock_note,
    )
    look.update(barmode="overlay")
    return _figure(traces, look, {}, y_axis)


def _span(frame: pd.DataFrame) -> str:
    """'0-32767': the tokens a binned frame covers."""
    return f"{int(frame['start'].iloc[0])}-{int(frame['end'].iloc[-1])}"


BAND_TEXT = {"std": "± 1 sample std", "ci95": "95% t-interval for the mean", "range": "range (min–max)"}


def error_figure(
    frame: pd.DataFrame,
    bars: str = "std",
    members: int = 1,
    title: str = "Per-token error: compressed − original attention",
    what: str = "",
    y_range: float | None = None,
    text_tokens: bool = False,
    pinned: pd.DataFrame | None = None,
    pinned_label: str = "A",
) -> go.Figure:
    """The per-token error split into its two causes, with error bars on the total.

    Stacked bars: the eviction part (whole tokens lost, their mass spread over the kept ones)
    and the quantization part (small errors on every kept token), each the ensemble mean;
    black ticks mark the mean total error with the `bars` band (kvviz.metrics.BANDS) over
    the N members. `frame` is `kvviz.analysis.frames.token_frame` (or `binned_frame`); `what` names
    the ensemble; `y_range` locks the axis to ±y_range; `pinned` adds a pinned setting's
    total error as open diamonds. With one member the chart says it shows that one row.
    """
    from kvviz.analysis.frames import band_bounds

    # the columns as arrays, once: pandas' per-operation overhead was most of this builder's time
    col = {c: frame[c].to_numpy() for c in frame.columns if c.startswith("error_")}
    mean = col["error_mean"]
    band = band_bounds(col, bars)
    binned = "start" in frame.columns
    x = (frame["start"] + (frame["tokens"] - 1) / 2 if binned else frame["position"]).to_numpy()
    if binned:
        hover = _Hover("tokens %{customdata[0]}-%{customdata[1]}", np.stack([frame["start"], frame["end"]], axis=1))
        x_title = f"token position {_span(frame)} (bins of {int(frame['tokens'].max())} tokens)"
        y_title = "mass error per bin (sum)"
    else:
        ids = np.stack([frame["token"].astype(str), frame["position"]], axis=1)
        hover = _Hover("%{customdata[0]} (position %{customdata[1]})", ids)
        x_title = "token" if text_tokens else "token position (index)"
        y_title = "attention error (compressed − original)"
    bar_span = _bar_span(mean, band)
    traces = _part_bars(x, col, hover) + [_total_ticks(x, mean, band, bar_span, hover, bars, members)]
    extreme = col.get("error_extreme") if binned else None
    if extreme is not None:
        traces.append(
            _points(
                x,
                extreme,
                "largest single-token error in the bin (one row)",
                dict(symbol="circle-open", size=6, color=OKABE_ITO["blue"]),
                f"<b>{hover.label}</b><br>largest single-token error %{{y:.5f}}<extra></extra>",
                customdata=hover.ids,
            )
        )
    if pinned is not None:
        px = pinned["start"] + (pinned["tokens"] - 1) / 2 if binned else pinned["position"]
        traces.append(
            _points(
                px.to_numpy(),
                pinned["error_mean"].to_numpy(),
                f"pinned {pinned_label}: total",
                PINNED_MARKER,
                "pinned: %{y:.5f}<extra></extra>",
            )
        )
    of = f" ({what})" if what else ""
    if members > 1:
        subtitle = f"ensemble mean of N = {members} rows{of}, bars: {BAND_TEXT[bars]}"
    else:
        subtitle = f"one row{of}, no ensemble: no error bars"
    reach = _error_reach(col, bar_span if members > 1 else None, extreme, pinned)
    y_axis, lock_note = locked_axis(y_range, reach, bottom=None)
    look = base_layout(title, x_title, y_title, subtitle=subtitle + lock_note)
    look.update(barmode="relative", bargap=0.15, shapes=[_zero_line()])
    x_axis = {} if binned else _token_axis(frame, text_tokens)
    return _figure(traces, look, x_axis, y_axis)


@dataclass(frozen=True)
class _Hover:
    """How a bar or tick names its token (or bin) on hover, from its customdata columns `ids`."""

    label: str
    ids: np.ndarray


def _zero_line() -> dict:
    """The zero line: add_hline's shape, drawn across the plot whatever the x range."""
    return dict(
        type="line", xref="x domain", x0=0, x1=1, yref="y", y0=0, y1=0, line=dict(width=1, color=OKABE_ITO["black"])
    )


def _part_bars(x: np.ndarray, col: dict, hover: _Hover) -> list[dict]:
    """The eviction and the quantization part of the error, stacked (a part that is all zero is left out)."""
    traces = []
    for part in ("eviction", "quantization"):
        values = col[f"error_{part}_mean"]
        if np.any(np.abs(values) > 0):
            traces.append(
                dict(
                    type="bar",
                    x=x,
                    y=values,
                    name=f"{part} part",
                    marker=dict(color=PART_COLORS[part], pattern=dict(shape="/" if part == "eviction" else "")),
                    customdata=hover.ids,
                    hovertemplate=f"<b>{hover.label}</b><br>{part} part %{{y:.5f}}<extra></extra>",
                )
            )
    return traces


def _bar_span(mean: np.ndarray, band) -> tuple[np.ndarray, np.ndarray]:
    """(up, down): how far the band reaches above and below the mean, never negative, 0 where undefined."""
    band_lo, band_hi = band
    up = np.nan_to_num(np.clip(band_hi - mean, 0, None), nan=0.0)
    down = np.nan_to_num(np.clip(mean - band_lo, 0, None), nan=0.0)
    return up, down


def _total_ticks(x, mean, band, bar_span, hover: _Hover, bars: str, members: int) -> dict:
    """Black ticks at the mean total error, with the band's error bars (`bar_span`) when there is an
    ensemble."""
    band_lo, band_hi = band
    up, down = bar_span
    return dict(
        type="scatter",
        x=x,
        y=mean,
        mode="markers",
        name=f"total ({BAND_TEXT[bars]})" if members > 1 else "total",
        marker=dict(symbol="line-ew-open", size=12, color=OKABE_ITO["black"], line=dict(width=2)),
        customdata=np.concatenate([hover.ids, np.stack([band_lo, band_hi], axis=1)], axis=1),
        error_y=dict(
            type="data",
            symmetric=False,
            array=up,
            arrayminus=down,
            color=OKABE_ITO["black"],
            thickness=1.2,
            width=2,
            visible=members > 1,
        ),
        hovertemplate=(
            f"<b>{hover.label}</b><br>total error %{{y:.5f}}"
            + ("<br>band %{customdata[2]:.5f} to %{customdata[3]:.5f}" if members > 1 else "")
            + "<extra></extra>"
        ),
    )


def _error_reach(col: dict, bar_span, extreme, pinned) -> float:
    """How far the error chart reaches: the stacked parts (positive and negative stacks apart), the totals
    with their error bars where drawn (bar_span None: no bars), a bin's largest single error, the pinned
    totals."""
    mean = col["error_mean"]
    parts = np.nan_to_num(np.stack([col[f"error_{p}_mean"] for p in ("eviction", "quantization")]))
    drawn = [parts.clip(min=0).sum(axis=0), parts.clip(max=0).sum(axis=0), mean]
    if bar_span is not None:
        up, down = bar_span
        drawn += [mean + up, mean - down]
    if extreme is not None:
        drawn.append(extreme)
    if pinned is not None:
        drawn.append(pinned["error_mean"])
    return data_reach(*drawn)
