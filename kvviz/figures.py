"""Plotly figure builders: pure functions, data in -> go.Figure out (no Streamlit).

Colours are the Okabe-Ito palette (safe for the common colour-vision deficiencies), and
every chart also encodes the key distinction by shape or position, not colour alone:
evicted tokens are drawn as crosses, the Pareto frontier as a thick dashed line.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

# Okabe & Ito (2008)
OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7",
    "grey": "#999999",
}
REASON_COLORS = {
    "sink": OKABE_ITO["blue"],
    "recent": OKABE_ITO["bluish_green"],
    "heavy hitter": OKABE_ITO["orange"],
    "kept (no eviction)": OKABE_ITO["sky_blue"],
    "evicted": OKABE_ITO["vermillion"],
}
ORIGINAL_COLOR = OKABE_ITO["grey"]
METHOD_COLORS = {
    "h2o": OKABE_ITO["orange"], "tova": OKABE_ITO["reddish_purple"], "snapkv": OKABE_ITO["bluish_green"],
    "streaming": OKABE_ITO["blue"], "oracle": OKABE_ITO["black"], "knorm": OKABE_ITO["sky_blue"],
    "random": OKABE_ITO["grey"], "full": OKABE_ITO["vermillion"],
}
METHOD_SYMBOLS = {"h2o": "circle", "tova": "diamond", "snapkv": "square", "streaming": "triangle-up",
                  "oracle": "star-diamond", "knorm": "pentagon", "random": "x-thin-open", "full": "hexagon"}
FONT = dict(family="Source Sans Pro, sans-serif", size=13)


def _layout(fig: go.Figure, title: str, x_title: str, y_title: str, height: int = 380,
            subtitle: str = "") -> go.Figure:
    text = f"{title}<br><sup>{subtitle}</sup>" if subtitle else title
    fig.update_layout(title=dict(text=text, x=0.01), height=height, font=FONT, template="plotly_white",
                      margin=dict(l=60, r=20, t=70 if subtitle else 50, b=50),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
                      hoverlabel=dict(namelength=-1))
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return fig


# --- explorer ----------------------------------------------------------------------------

def attention_figure(frame: pd.DataFrame, title: str = "Attention per token: original vs compressed",
                     row: str = "") -> go.Figure:
    """Grouped bars per token: original (grey) and compressed coloured by why the token was kept.

    Evicted tokens have no compressed bar; a vermillion cross marks their original weight.
    `frame` is `kvviz.ui_data.token_frame`; `row` names the one row shown ("layer 0, head 0, ...").
    """
    fig = go.Figure()
    hover = ("<b>%{customdata[0]}</b> (position %{x})<br>original %{customdata[1]:.4f}"
             "<br>compressed %{customdata[2]:.4f}<br>%{customdata[3]}<extra></extra>")
    custom = np.stack([frame["token"].astype(str), frame["original"], frame["compressed"], frame["reason"]], axis=1)
    fig.add_bar(x=frame["position"], y=frame["original"], name="original", marker_color=ORIGINAL_COLOR,
                offsetgroup="original", customdata=custom, hovertemplate=hover)
    for reason, color in REASON_COLORS.items():
        if reason == "evicted":
            continue
        sel = (frame["reason"] == reason).to_numpy()
        if sel.any():
            fig.add_bar(x=frame["position"][sel], y=frame["compressed"][sel], name=f"compressed: {reason}",
                        marker_color=color, offsetgroup="compressed", customdata=custom[sel],
                        hovertemplate=hover)
    ev = (frame["reason"] == "evicted").to_numpy()
    if ev.any():
        fig.add_scatter(x=frame["position"][ev], y=frame["original"][ev], mode="markers",
                        name="evicted (compressed = 0)",
                        marker=dict(symbol="x-thin-open", size=9, color=REASON_COLORS["evicted"],
                                    line=dict(width=2, color=REASON_COLORS["evicted"])),
                        customdata=custom[ev], hovertemplate=hover)
    fig.update_layout(barmode="group", bargap=0.15, bargroupgap=0.0)
    return _layout(fig, title, "token position (index)", "attention weight (probability)",
                   subtitle=f"one row: {row}" if row else "one row (the primary row, not an ensemble mean)")


def binned_attention_figure(frame: pd.DataFrame,
                            title: str = "Attention mass per bin of tokens: original vs compressed",
                            row: str = "") -> go.Figure:
    """Long sequences: one bar pair per bin; the original bar splits into kept (grey) and evicted
    (vermillion, hatched) mass, the compressed bar beside it.

    `frame` is `kvviz.ui_data.binned_frame`.
    """
    width = float(frame["tokens"].max())
    centers = frame["start"] + (frame["tokens"] - 1) / 2
    custom = np.stack([frame["start"], frame["end"], frame["first_token"].astype(str),
                       frame["last_token"].astype(str), frame["original"], frame["compressed"],
                       frame["kept_tokens"], frame["tokens"], frame["evicted_mass"]], axis=1)
    hover = ("<b>tokens %{customdata[0]}-%{customdata[1]}</b> (%{customdata[2]} ... %{customdata[3]})"
             "<br>original %{customdata[4]:.4f}<br>compressed %{customdata[5]:.4f}"
             "<br>kept %{customdata[6]} of %{customdata[7]}; evicted mass %{customdata[8]:.4f}<extra></extra>")
    fig = go.Figure()
    kept_mass = frame["original"] - frame["evicted_mass"]
    fig.add_bar(x=centers, y=kept_mass, width=width * 0.45, offset=-width * 0.45, name="original: kept tokens",
                marker_color=ORIGINAL_COLOR, customdata=custom, hovertemplate=hover)
    fig.add_bar(x=centers, y=frame["evicted_mass"], base=kept_mass, width=width * 0.45, offset=-width * 0.45,
                name="original: evicted tokens", marker_color=REASON_COLORS["evicted"],
                marker_pattern_shape="x", customdata=custom, hovertemplate=hover)
    fig.add_bar(x=centers, y=frame["compressed"], width=width * 0.45, offset=0, name="compressed",
                marker_color=REASON_COLORS["kept (no eviction)"], customdata=custom, hovertemplate=hover)
    fig.update_layout(barmode="overlay")
    return _layout(fig, title, f"token position (bins of {int(width)} tokens)", "attention mass per bin (probability)",
                   subtitle=f"one row: {row}" if row else "one row (the primary row, not an ensemble mean)")


BAND_TEXT = {"std": "± 1 sample std", "ci95": "95% t-interval for the mean", "range": "range (min–max)"}


def error_figure(frame: pd.DataFrame, bars: str = "std", members: int = 1,
                 title: str = "Per-token error: compressed − original attention",
                 what: str = "") -> go.Figure:
    """Mean error per token over the ensemble with error bars, coloured by why the token was kept.

    `frame` is `kvviz.ui_data.token_frame` (or `binned_frame`, which has `start`/`end`);
    `bars` one of kvviz.metrics.BANDS; `what` names the ensemble ("query heads 0-7 of layer 1").
    With one member there is no spread: the chart says it shows that one row.
    """
    from .ui_data import with_band

    frame = with_band(frame, bars)
    binned = "start" in frame.columns
    x = frame["start"] + (frame["tokens"] - 1) / 2 if binned else frame["position"]
    bar_text = BAND_TEXT[bars]
    fig = go.Figure()
    up = (frame["band_hi"] - frame["error_mean"]).clip(lower=0).fillna(0)
    down = (frame["error_mean"] - frame["band_lo"]).clip(lower=0).fillna(0)
    if binned:
        custom = np.stack([frame["start"], frame["end"], frame["error_mean"], frame["band_lo"],
                           frame["band_hi"]], axis=1)
        hover = ("<b>tokens %{customdata[0]}-%{customdata[1]}</b><br>mean error %{customdata[2]:.5f}"
                 "<br>bars %{customdata[3]:.5f} to %{customdata[4]:.5f}<extra></extra>")
        fig.add_bar(x=x, y=frame["error_mean"], name=f"mean error per bin ({bar_text}, N = {members})",
                    marker_color=OKABE_ITO["blue"], customdata=custom, hovertemplate=hover,
                    error_y=dict(type="data", symmetric=False, array=up, arrayminus=down,
                                 color=OKABE_ITO["black"], thickness=1.2, width=2))
        x_title = f"token position (bins of {int(frame['tokens'].max())} tokens)"
        y_title = "error in attention mass per bin (probability)"
    else:
        custom = np.stack([frame["token"].astype(str), frame["error_mean"], frame["band_lo"],
                           frame["band_hi"], frame["reason"]], axis=1)
        hover = ("<b>%{customdata[0]}</b> (position %{x})<br>mean error %{customdata[1]:.5f}"
                 "<br>bars %{customdata[2]:.5f} to %{customdata[3]:.5f}<br>%{customdata[4]}<extra></extra>")
        for reason, color in REASON_COLORS.items():
            sel = (frame["reason"] == reason).to_numpy()
            if not sel.any():
                continue
            fig.add_bar(x=x[sel], y=frame["error_mean"][sel], name=reason, marker_color=color, width=0.8,
                        customdata=custom[sel], hovertemplate=hover,
                        error_y=dict(type="data", symmetric=False, array=up[sel], arrayminus=down[sel],
                                     color=OKABE_ITO["black"], thickness=1.2, width=2))
        x_title = "token position (index)"
        y_title = "attention error (compressed − original)"
    fig.add_hline(y=0, line_width=1, line_color=OKABE_ITO["black"])
    fig.update_layout(barmode="overlay", bargap=0.15)
    if members > 1:
        subtitle = f"ensemble mean of N = {members} rows{f' ({what})' if what else ''}, bars: {bar_text}"
    else:
        subtitle = f"one row{f' ({what})' if what else ''}, no ensemble: no error bars"
    return _layout(fig, title, x_title, y_title, subtitle=subtitle)


# --- trade-offs -----------------------------------------------------------------------------

METRIC_LABELS = {"tv": "TV distance (0-1)",
                 "kl_compressed_vs_original": "KL(compressed ‖ original), nats",
                 "js": "Jensen–Shannon divergence, nats (≤ ln 2)",
                 "output_error": "output relative error (‖ô−o‖/‖o‖)",
                 "mass_retained": "attention mass retained (0-1)"}


def tradeoff_figure(rows: Sequence[dict], metric: str = "tv", front: Sequence[int] = (),
                    current: dict | None = None) -> go.Figure:
    """Error against memory ratio, one line per method (each line one bit width per budget sweep).

    `front` indexes the Pareto-optimal rows; `current` ({memory_ratio, <metric>, label}) is
    the explorer's setting, drawn as a large star.
    """
    frame = pd.DataFrame(list(rows))
    fig = go.Figure()
    if len(frame):
        frame = frame.dropna(subset=[metric])
        for (method, bits), g in frame.groupby(["method", "bits"], sort=True):
            g = g.sort_values("memory_ratio")
            dash = {16: "solid", 8: "dot", 4: "dash", 2: "dashdot"}.get(int(bits), "longdash")
            fig.add_scatter(
                x=g["memory_ratio"], y=g[metric], mode="lines+markers", name=f"{method} · {bits}-bit",
                legendgroup=method, line=dict(color=METHOD_COLORS.get(method, OKABE_ITO["grey"]), dash=dash),
                marker=dict(symbol=METHOD_SYMBOLS.get(method, "circle"), size=8),
                customdata=np.stack([g["method"], g["budget"], g["bits"]], axis=1),
                hovertemplate=("<b>%{customdata[0]}</b> budget %{customdata[1]} tokens, %{customdata[2]}-bit"
                               "<br>memory %{x:.3f} of 16-bit<br>" + metric + " %{y:.4f}<extra></extra>"))
        rows_list = list(rows)
        if len(front):
            pts = pd.DataFrame([rows_list[i] for i in front]).sort_values("memory_ratio")
            fig.add_scatter(x=pts["memory_ratio"], y=pts[metric], mode="lines", name="Pareto frontier",
                            line=dict(color=OKABE_ITO["black"], width=4, dash="dash"), opacity=0.55,
                            hoverinfo="skip")
    if current is not None and current.get(metric) is not None:
        fig.add_scatter(x=[current["memory_ratio"]], y=[current[metric]], mode="markers",
                        name=f"current: {current.get('label', 'explorer setting')}",
                        marker=dict(symbol="star", size=20, color=OKABE_ITO["yellow"],
                                    line=dict(width=2, color=OKABE_ITO["black"])),
                        hovertemplate="current setting<br>memory %{x:.3f}<br>" + metric + " %{y:.4f}<extra></extra>")
    fig = _layout(fig, "Error vs memory for every policy", "memory ratio (compressed / 16-bit cache bytes)",
                  METRIC_LABELS.get(metric, metric), height=520)
    fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1.0, xanchor="left", x=1.02))
    return fig


# --- concentration ----------------------------------------------------------------------------

def concentration_figure(fractions: np.ndarray, curves: np.ndarray, band: tuple = ((0.10, 0.20), (0.80, 0.90)),
                         labels: Sequence[str] | None = None) -> go.Figure:
    """Share of attention held by the top x% of tokens: one faint line per layer, the mean bold.

    `curves` is (layers, heads, F); the shaded band is the handbook's rule of thumb
    (10-20% of tokens take 80-90% of the mass).
    """
    x = 100 * np.asarray(fractions)
    fig = go.Figure()
    (x0, x1), (y0, y1) = band
    fig.add_shape(type="rect", x0=100 * x0, x1=100 * x1, y0=100 * y0, y1=100 * y1,
                  fillcolor=OKABE_ITO["orange"], opacity=0.25, line_width=0, layer="below")
    fig.add_annotation(x=100 * x1, y=100 * y0, text="handbook: 10-20% of tokens → 80-90% of mass",
                       showarrow=False, xanchor="left", yanchor="top", font=dict(size=11))
    per_layer = curves.mean(axis=1)
    for layer, c in enumerate(per_layer):
        fig.add_scatter(x=x, y=100 * c, mode="lines", line=dict(width=1, color=OKABE_ITO["sky_blue"]),
                        name=labels[layer] if labels else f"layer {layer}", opacity=0.6,
                        showlegend=len(per_layer) <= 8,
                        hovertemplate=f"layer {layer}<br>top %{{x:.0f}}% of tokens hold %{{y:.1f}}%<extra></extra>")
    fig.add_scatter(x=x, y=100 * curves.mean(axis=(0, 1)), mode="lines", name="mean over layers and heads",
                    line=dict(width=4, color=OKABE_ITO["blue"]),
                    hovertemplate="mean<br>top %{x:.0f}% of tokens hold %{y:.1f}%<extra></extra>")
    fig.add_scatter(x=x, y=x, mode="lines", name="uniform attention", line=dict(dash="dot", color=OKABE_ITO["grey"]),
                    hoverinfo="skip")
    fig = _layout(fig, "How concentrated is attention? Top x% of tokens hold y% of the mass",
                  "top tokens (% of tokens the query sees)", "attention mass held (%)", height=460)
    fig.update_yaxes(range=[0, 101])
    fig.update_xaxes(range=[0, 100])
    return fig


def heatmap_figure(matrix: np.ndarray, title: str, colorbar: str, zmin: float | None = None,
                   zmax: float | None = None, fmt: str = ".2f") -> go.Figure:
    """A layers x heads heatmap (cividis: perceptually uniform and colour-blind safe)."""
    m = np.asarray(matrix)
    fig = go.Figure(go.Heatmap(
        z=m, x=[str(h) for h in range(m.shape[1])], y=[str(layer) for layer in range(m.shape[0])],
        colorscale="Cividis", zmin=zmin, zmax=zmax, colorbar=dict(title=dict(text=colorbar)),
        hovertemplate="layer %{y}, head %{x}<br>" + colorbar + " %{z:" + fmt + "}<extra></extra>"))
    fig = _layout(fig, title, "query head (index)", "layer (index)", height=max(260, 120 + 18 * m.shape[0]))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return fig


# --- token grid ----------------------------------------------------------------------------------

GRID_STYLES = {  # background, text colour, border style: colour is never the only cue
    "sink": (OKABE_ITO["blue"], "#ffffff", "solid"),
    "recent": (OKABE_ITO["bluish_green"], "#ffffff", "solid"),
    "heavy hitter": (OKABE_ITO["orange"], "#000000", "solid"),
    "kept (no eviction)": (OKABE_ITO["sky_blue"], "#000000", "solid"),
    "evicted": ("#f2f2f2", "#8a8a8a", "dashed"),
    "newest": (OKABE_ITO["black"], "#ffffff", "double"),
}


def token_grid_html(tokens: Sequence[str], reasons: Sequence[str], original: Sequence[float],
                    newest: int | None = None) -> str:
    """The text as chips, each coloured by what the compressed cache does with it.

    Evicted tokens are struck through and dashed, so the grid reads without colour too;
    the hover title gives the position, the reason and the original attention.
    """
    from html import escape

    chips = []
    for i, (tok, why, a) in enumerate(zip(tokens, reasons, original)):
        kind = "newest" if i == newest else why
        bg, fg, border = GRID_STYLES[kind]
        strike = "line-through" if why == "evicted" else "none"
        label = escape(tok) if tok.strip() else "&nbsp;"
        chips.append(
            f"<span title='{i}: {escape(tok)!s} — {escape(kind)}, attention {a:.4f}' "
            f"style='display:inline-block;margin:2px;padding:1px 5px;border-radius:4px;"
            f"background:{bg};color:{fg};border:2px {border} {bg if border != 'dashed' else '#8a8a8a'};"
            f"text-decoration:{strike};font-family:monospace;font-size:13px'>{label}</span>")
    legend = " ".join(
        f"<span style='display:inline-block;margin:2px 6px 6px 0;padding:1px 6px;border-radius:4px;"
        f"background:{bg};color:{fg};border:2px {border} {bg if border != 'dashed' else '#8a8a8a'};"
        f"font-size:12px'>{name}</span>" for name, (bg, fg, border) in GRID_STYLES.items())
    return f"<div>{legend}</div><div style='line-height:1.9'>{''.join(chips)}</div>"


# --- export -------------------------------------------------------------------------------------

def figures_html(figures: Sequence[go.Figure], title: str = "kvviz") -> str:
    """A standalone HTML page holding the figures (plotly.js inlined once; works offline)."""
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    body = "\n".join(f"<section>{p}</section>" for p in parts)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='font-family:sans-serif'><h1>{title}</h1>{body}</body></html>")
