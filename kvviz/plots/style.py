"""The look every kvviz chart shares: colours, fonts, the plotly toolbar, the common layout, and the
names and marker shapes of methods, bit widths and formats (no Streamlit).

One colour means one thing on every page, and colour is never the only cue:
- what happens to a token (Okabe-Ito): sink blue, recent bluish green, heavy hitter orange,
  kept without eviction sky blue, evicted vermillion (and hatched);
- the two causes of error: eviction vermillion, quantization reddish purple;
- eviction methods: a colour, a marker shape and a line dash each (METHOD_COLORS, METHOD_SYMBOLS,
  METHOD_DASH); the colours were chosen so every pair stays apart (CIE76 ΔE ≥ 15) for normal vision
  and simulated deuteranopia, protanopia and tritanopia (tests/test_colour_vision.py): H2O indigo,
  TOVA orange, SnapKV green, StreamingLLM rose, the oracle black, no eviction ("full") dark grey, ...;
- on the attention chart what happens to a token has a bar pattern too (REASON_PATTERNS).
Legends sit below the charts so they never cover a title at a projector's 1024 px.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from kvviz.quant.formats import FORMAT_LABELS

# Okabe & Ito (2008)
OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
    "grey": "#999999",
}
REASON_COLORS = {
    "sink": OKABE_ITO["blue"],
    "recent": OKABE_ITO["bluish_green"],
    "heavy hitter": OKABE_ITO["orange"],
    "kept (no eviction)": OKABE_ITO["sky_blue"],
    "evicted": OKABE_ITO["vermillion"],
}
PART_COLORS = {"eviction": OKABE_ITO["vermillion"], "quantization": OKABE_ITO["reddish_purple"]}
ORIGINAL_COLOR = OKABE_ITO["grey"]


class _ByPolicy(Mapping):
    """A method's look, read from its scorer's class (kvviz.policies: `colour`, `symbol`, `dash`, `title`),
    plus "full" (no eviction). The built-in colours are chosen together: every pair >= 15 CIE76 ΔE apart under
    normal vision and the three simulated dichromacies (Machado et al. 2009, full severity;
    tests/test_colour_vision.py), none too light to see on white, no yellow (the Trade-offs star is yellow);
    picked from Okabe-Ito and Paul Tol's palettes by a max-min search. And never by colour alone: a marker
    shape and a line dash each (the star is the Explorer's setting)."""

    def __init__(self, attr: str, full: str):
        self.attr, self.full = attr, full

    def _table(self) -> dict:
        from kvviz.policies import POLICIES

        table = {name: getattr(p, self.attr) or (name if self.attr == "title" else "") for name, p in POLICIES.items()}
        return {**{k: v for k, v in table.items() if v}, "full": self.full}

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())


METHOD_COLORS = _ByPolicy("colour", "#555555")
METHOD_SYMBOLS = _ByPolicy("symbol", "hexagon")
METHOD_DASH = _ByPolicy("dash", "longdashdot")
# the token's fate on the attention chart, as a bar pattern too (evicted: hatched)
REASON_PATTERNS = {"sink": ".", "recent": "-", "heavy hitter": "x", "kept (no eviction)": "", "evicted": "/"}
# the app's page font first (Streamlit's web font), then its older name and any sans-serif (an exported page)
FONT = dict(family='"Source Sans", "Source Sans Pro", sans-serif', size=13)
INK = "#31333F"  # the page's text colour
# plotly's own toolbar: its camera button saves the chart as SVG (vector, for slides), in the browser
CHART_CONFIG = {"toImageButtonOptions": {"format": "svg", "filename": "kvviz-chart"}, "displaylogo": False}


def wrap(text: str, width: int, sep: str = " ") -> str:
    """`text` broken into lines of at most `width` characters at its separators (plotly's <br>), so a
    title fits a narrow chart or panel; a piece longer than `width` keeps its own line, whole. With
    sep=", " a list breaks only between its items (the comma ends the line)."""
    lines: list[str] = []
    for piece in text.split(sep):
        if lines and len(lines[-1]) + len(sep) + len(piece) <= width:
            lines[-1] += sep + piece
        else:
            if lines:
                lines[-1] += sep.rstrip()
            lines.append(piece)
    return "<br>".join(lines)


# A legend below the plot, anchored to the figure's bottom edge (plotly reserves the margin it needs). Not to
# the plot area (y < 0 in paper units): after the window's width changes, plotly keeps such a legend where the
# previous width's margins put it, on top of the x axis's title, until the chart is drawn afresh.
LEGEND_BELOW = dict(orientation="h", yref="container", yanchor="bottom", y=0.0, xanchor="left", x=0.0)


def base_layout(title: str, x_title: str, y_title: str, height: int = 380, subtitle: str = "") -> dict:
    """The layout every kvviz chart shares, as a plain dict: a figure built from dicts in one
    `go.Figure(data=..., layout=...)` is validated once, where each update_* call validates again."""
    text = f"{title}<br><sup>{subtitle}</sup>" if subtitle else title
    return dict(
        title=dict(text=text, x=0.01),
        height=height,
        font=FONT,
        margin=dict(l=60, r=20, t=70 if subtitle else 50, b=50),
        legend=dict(LEGEND_BELOW),  # a copy: a caller may add to the layout it is given
        hoverlabel=dict(namelength=-1),
        xaxis=dict(title=dict(text=x_title)),
        yaxis=dict(title=dict(text=y_title)),
    )


def layout(fig: go.Figure, title: str, x_title: str, y_title: str, height: int = 380, subtitle: str = "") -> go.Figure:
    fig.update_layout(base_layout(title, x_title, y_title, height, subtitle))
    return fig


def _template() -> go.layout.Template:
    """plotly_white, cut to what kvviz draws: its layout without the polar, ternary, 3-D and map parts,
    and its defaults for bar, scatter and heatmap traces (plotly_white has defaults for 24 kinds)."""
    white = pio.templates["plotly_white"].to_plotly_json()
    unused = ("polar", "ternary", "scene", "geo", "coloraxis", "colorscale")
    layout = {k: v for k, v in white["layout"].items() if k not in unused}
    # the page's text colour, the title a size up
    layout |= {"font": {"color": INK}, "title": {**layout["title"], "font": {"size": 16}}}
    return go.layout.Template(layout=layout, data={kind: white["data"][kind] for kind in ("bar", "scatter", "heatmap")})


# Every figure made in this process starts from this template. Plotly validates a template whole each
# time a figure is given one (update_layout(template="plotly_white") took ~8 ms a chart, a fifth of a
# slider move's server time); its default template is set without validation.
pio.templates["kvviz"] = _template()
pio.templates.default = "kvviz"


# A point's bit width (its method has the shape): filled or open, large or small, explained once in a
# bit-width legend. The serving formats (FP8 / FP4, llama.cpp's blocks) are drawn larger than any integer
# width, so q4_0 never passes for KIVI's 4 bits, and no two of them share a mark.
BITS_MARKS = {
    16: ("", 11),
    8: ("", 7),
    6: ("-dot", 11),
    5: ("-dot", 7),
    4: ("-open", 11),
    3: ("-open-dot", 11),
    2: ("-open", 7),
    1: ("-open-dot", 7),
}
# the serving formats' names, as the quantizers name them (the integer format is named by its bits)
FORMAT_NAMES = {fmt: name for fmt, name in FORMAT_LABELS.items() if fmt != "int"}
FORMAT_MARKS = {
    "e4m3": ("-open-dot", 14),
    "e5m2": ("-open-dot", 18),
    "nvfp4": ("-open", 18),
    "mxfp4": ("-dot", 18),
    "q8_0": ("-dot", 14),
    "q4_0": ("-open", 14),
}


def point_marker(method: str, bits: int, fmt: str = "int", color: str | None = None) -> dict:
    """A trade-off point's marker: the method's shape, filled / open and sized by its bit width."""
    variant, size = BITS_MARKS.get(bits, ("", 9)) if fmt == "int" else FORMAT_MARKS.get(fmt, ("-open", 13))
    return dict(
        symbol=METHOD_SYMBOLS.get(method, "circle") + variant,
        size=size,
        color=color or METHOD_COLORS.get(method, OKABE_ITO["grey"]),
        line=dict(width=2),
    )


def width_name(bits: int, fmt: str = "int") -> str:
    """A bit width's (or a serving format's) name on a legend: '4-bit', '16-bit (off)', 'NVFP4'."""
    if fmt != "int":
        return FORMAT_NAMES.get(fmt, fmt)
    return "16-bit (off)" if bits >= 16 else f"{bits}-bit"


def width_legend(fig, widths) -> None:
    """The marker legend of a trade-off chart, once: what each (bits, format) in `widths`, in that order,
    looks like (the method's shape is the method's; a grey marker of each width)."""
    for bits, fmt in widths:
        fig.add_scatter(
            x=[None],
            y=[None],
            mode="markers",
            name=width_name(int(bits), fmt),
            legendgroup="bits",
            legendgrouptitle_text="bit width",
            marker=point_marker("", int(bits), fmt, color=OKABE_ITO["grey"]),
        )


METHOD_LABELS = _ByPolicy("title", "no eviction")


# --- Presentation mode: every text of a chart at 18 px or more ------------------------------------------------

PROJECTOR_FONT = 18


def _merged(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in, nested dicts key by key (what update_layout does, without its
    per-key validation)."""
    out = dict(base)
    for key, value in changes.items():
        old = out.get(key)
        out[key] = _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def projector(
    fig: go.Figure, height: int | None = None, y_title: str | None = None, legend_right: bool = False
) -> go.Figure:
    """A chart for a projector (Presentation mode): every text at PROJECTOR_FONT px or more (the
    subtitle too: a plain second title line, not a small <sup>), the legend in two columns below the
    plot with room for it (legend_right: one column beside the plot, for a legend of many entries that
    would take the plot's height), and `y_title` (a shorter y-axis title that fits the plot's height).

    A new figure from the old one's dicts: plotly's update_layout on a built figure took ~9 ms a chart."""
    spec = fig.to_dict()
    look = spec["layout"]
    look.pop("template", None)  # the default template comes back with the new figure
    main, _, sub = (look.get("title", {}).get("text") or "").partition("<br><sup>")
    sub = sub.removesuffix("</sup>")
    text = main + (f"<br><span style='font-size:{PROJECTOR_FONT}px'>{sub}</span>" if sub else "")
    entries = sum(1 for t in spec["data"] if t.get("showlegend") is not False and t.get("name"))
    rows = -(-entries // 2)
    # set on each axis: Streamlit's chart theme sizes unset tick and axis-title fonts in rem (13.5 px here)
    fonts = dict(tickfont=dict(size=PROJECTOR_FONT), title=dict(font=dict(size=PROJECTOR_FONT)))
    # a log axis's in-between labels (the 2 and 5 of each decade) are drawn smaller than its ticks: off
    axes = {
        name: {**fonts, **({"minorloglabels": "none"} if look.get(name, {}).get("type") == "log" else {})}
        for name in ("xaxis", "yaxis", *look)
        if name.startswith(("xaxis", "yaxis"))
    }
    if y_title:
        axes.update({name: _merged(fonts, dict(title=dict(text=y_title))) for name in axes if name[0] == "y"})
    if legend_right:
        rows = 0
        legend = dict(
            font=dict(size=PROJECTOR_FONT),
            orientation="v",
            x=1.02,
            xanchor="left",
            yref="paper",  # beside the plot area, whatever the figure's own legend was anchored to
            y=1,
            yanchor="top",
        )
    else:
        legend = dict(
            font=dict(size=PROJECTOR_FONT),
            orientation="h",
            yref="container",
            y=0,
            yanchor="bottom",
            entrywidthmode="fraction",
            entrywidth=0.5,
        )
    # a figure's own annotations (subplot titles, notes) at 16 px or more, with the top margin the figure
    # asked for where it asked for more (its subplot titles sit in it); 16, not 18: a subplot title is laid
    # out for its panel's width (the needle grid's ~100 px columns), and at 18 px two neighbours overlapped
    least = PROJECTOR_FONT - 2
    annotations = [
        _merged(a, dict(font=dict(size=max((a.get("font") or {}).get("size") or 0, least))))
        for a in look.get("annotations", ())
    ]
    top = max((look.get("margin") or {}).get("t") or 0, 95 if sub else 60)
    changes = dict(
        font=dict(size=PROJECTOR_FONT),
        title=dict(text=text, font=dict(size=PROJECTOR_FONT + 4)),
        legend=legend,
        **({"annotations": annotations} if annotations else {}),
        margin=dict(l=80, r=20, t=top, b=70 + 28 * rows),
        **({"height": height + 28 * max(rows - 2, 0)} if height else {}),
        **axes,
    )
    # unvalidated, as kvviz.plots.figures builds: tests/test_figures.py validates the result
    return go.Figure(data=spec["data"], layout=_merged(look, changes), _validate=False)


def locked_axis(top: float | None, reach: float, bottom: float | None = 0) -> tuple[dict, str]:
    """A y axis locked at [bottom, top] (bottom None: ±top), unlocked without `top`, and what to add to
    the chart's subtitle. A lock never hides data: where the chart reaches past it (`reach`, data_reach
    of every value it draws: stacked bars, error bars and markers included) the axis widens to fit, and
    the subtitle says from what to what."""
    if not top:
        return {}, ""
    note = ""
    if reach > top:
        sign = "±" if bottom is None else ""
        note = f" · y-axis lock {sign}{top:.3g} widened to {sign}{reach:.3g}: a bar reaches past it"
        top = reach * 1.04
    return dict(range=[-top if bottom is None else bottom, top], autorange=False), note


def data_reach(*values) -> float:
    """The largest |value| among the arrays (NaN ignored), 0 where there is none."""
    finite = [np.abs(v[np.isfinite(v)]) for v in (np.asarray(x, dtype=float) for x in values)]
    return max((float(v.max()) for v in finite if v.size), default=0.0)
