"""Per-(layer, head) heatmaps and the per-token grid: a view's numbers laid out over the model's layers and
heads, or over the row's tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from kvviz.plots.style import OKABE_ITO, layout


def heatmap_figure(
    matrix: np.ndarray,
    title: str,
    colorbar: str,
    zmin: float | None = None,
    zmax: float | None = None,
    fmt: str = ".2f",
    layers: Sequence[int] | None = None,
) -> go.Figure:
    """A layers x heads heatmap (cividis: perceptually uniform and colour-blind safe); one cell a (layer, head),
    so it sends layers x heads numbers to the browser whatever the trace's length.

    `layers` names the rows by the model's own layer numbers (`Trace.layer_numbers`: a capture may keep
    some layers); without it the rows are numbered 0..layers-1."""
    m = np.asarray(matrix)
    numbers = list(range(m.shape[0])) if layers is None else [int(x) for x in layers]
    if len(numbers) != m.shape[0]:
        raise ValueError(f"{len(numbers)} layer numbers for {m.shape[0]} rows")
    fig = go.Figure(
        go.Heatmap(
            z=m,
            x=[str(h) for h in range(m.shape[1])],
            y=[str(layer) for layer in numbers],
            colorscale="Cividis",
            zmin=zmin,
            zmax=zmax,
            colorbar=dict(title=dict(text=colorbar)),
            hovertemplate="layer %{y}, head %{x}<br>" + colorbar + " %{z:" + fmt + "}<extra></extra>",
        )
    )
    fig = layout(
        fig,
        title,
        "query head (index)",
        "layer (index)" if layers is None else "layer (the model's number)",
        height=max(260, 120 + 18 * m.shape[0]),
    )
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


def _mix(hex_colour: str, weight: float) -> str:
    """hex_colour blended with white: weight 0 = white, 1 = the colour."""
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    w = min(max(float(weight), 0.0), 1.0)
    return "#{:02x}{:02x}{:02x}".format(*(round(255 + (c - 255) * w) for c in (r, g, b)))


def token_grid_html(
    tokens: Sequence[str],
    reasons: Sequence[str],
    original: Sequence[float],
    newest: int | None = None,
    shade: str = "reason",
    error: Sequence[float] | None = None,
    context_len: int | None = None,
) -> str:
    """The text as chips, each coloured by what the compressed cache does with it.

    shade "reason": sink / recent / heavy hitter / evicted / newest colours; "attention": the
    chip's depth is the token's original attention (cividis-like blue, a max-scaled square
    root so small weights stay visible); "error": vermillion where compression lowered the
    token's attention, blue where it raised it. Evicted tokens are struck through and dashed
    in every mode, so the grid reads without colour too. `context_len` draws a separator
    between the prompt and the generated tokens. The legend lists only classes that occur.
    """
    from html import escape

    original = np.asarray(original, dtype=float)
    err = np.zeros_like(original) if error is None else np.asarray(error, dtype=float)
    top = float(original.max()) if len(original) else 1.0
    worst = float(np.abs(err).max()) if len(err) else 1.0
    chips, present = [], []
    for i, (tok, why, a) in enumerate(zip(tokens, reasons, original)):
        kind = "newest" if i == newest else why
        if kind not in present:
            present.append(kind)
        bg, fg, border = GRID_STYLES[kind]
        if shade == "attention":
            bg = _mix(OKABE_ITO["blue"], np.sqrt(a / top) if top > 0 else 0)
            fg = "#ffffff" if a / max(top, 1e-300) > 0.3 else "#000000"
        elif shade == "error":
            e = err[i] / worst if worst > 0 else 0.0
            bg = _mix(OKABE_ITO["vermillion"] if e < 0 else OKABE_ITO["blue"], abs(e) ** 0.5)
            fg = "#ffffff" if abs(e) > 0.35 else "#000000"
        strike = ";text-decoration:line-through" if why == "evicted" else ""
        label = escape(tok) if tok.strip() else "&nbsp;"
        edge = "#8a8a8a" if border == "dashed" else (bg if shade == "reason" else "#555555")
        if context_len is not None and i == context_len:
            chips.append(
                "<span title='the prompt ends here: later tokens were generated' style='display:inline-block;"
                "margin:2px 6px;padding:0 4px;border-left:3px solid #000;font-size:11px;color:#000'>"
                "generated →</span>"
            )
        chips.append(
            f"<span title='{i}: {escape(tok)!s} — {escape(kind)}, attention {a:.4f}, error {err[i]:+.4f}' "
            f"style='display:inline-block;margin:2px;padding:1px 5px;border-radius:4px;"
            f"background:{bg};color:{fg};border:2px {border} {edge}{strike}'>{label}</span>"
        )
    if shade == "reason":
        items = [(name, *GRID_STYLES[name]) for name in GRID_STYLES if name in present]
    else:
        items = [
            (name, GRID_STYLES[name][0], GRID_STYLES[name][1], GRID_STYLES[name][2])
            for name in ("evicted", "newest")
            if name in present
        ]
        scale = (
            "darker = more of the original attention"
            if shade == "attention"
            else "vermillion = attention lowered by compression, blue = raised; deeper = more"
        )
        items.insert(0, (scale, "#ffffff", "#000000", "solid"))
    legend = " ".join(
        f"<span style='display:inline-block;margin:2px 6px 6px 0;padding:1px 6px;border-radius:4px;"
        f"background:{bg};color:{fg};border:2px {border} {bg if border != 'dashed' else '#8a8a8a'};"
        f"font-size:12px'>{escape(name)}</span>"
        for name, bg, fg, border in items
    )
    # the chips' font on their box, once (a page of a long text is a thousand chips, sent on every rerun)
    return (
        f"<div>{legend}</div><div style='line-height:1.9;font-family:monospace;font-size:13px'>{''.join(chips)}</div>"
    )
