"""The look every kvviz chart shares: colours, fonts, the plotly toolbar, the common layout, and the
names and marker shapes of methods, bit widths and formats (no Streamlit).

One colour means one thing on every page, and colour is never the only cue:
- what happens to a token (Okabe-Ito): sink blue, recent bluish green, heavy hitter orange,
  kept without eviction sky blue, evicted vermillion (and hatched);
- the two causes of error: eviction vermillion, quantization reddish purple;
- eviction methods (Paul Tol's muted palette, none of the hues above, plus a marker shape
  each): H2O indigo, TOVA wine, SnapKV olive, StreamingLLM rose, K-norm sand, random pale
  grey, the oracle black, no eviction ("full") dark grey.
Legends sit below the charts so they never cover a title at a projector's 1024 px.
"""

from __future__ import annotations

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
PART_COLORS = {"eviction": OKABE_ITO["vermillion"], "quantization": OKABE_ITO["reddish_purple"]}
ORIGINAL_COLOR = OKABE_ITO["grey"]
METHOD_COLORS = {  # Paul Tol, muted (colour-blind safe); distinct from the token colours above
    "h2o": "#332288", "tova": "#882255", "snapkv": "#999933", "streaming": "#CC6677",
    "knorm": "#DDCC77", "random": "#BBBBBB", "oracle": "#000000", "full": "#555555",
}
FONT = dict(family="Source Sans Pro, sans-serif", size=13)
# plotly's own toolbar: its camera button saves the chart as SVG (vector, for slides), in the browser
CHART_CONFIG = {"toImageButtonOptions": {"format": "svg", "filename": "kvviz-chart"}, "displaylogo": False}


def layout(fig: go.Figure, title: str, x_title: str, y_title: str, height: int = 380,
            subtitle: str = "") -> go.Figure:
    text = f"{title}<br><sup>{subtitle}</sup>" if subtitle else title
    fig.update_layout(title=dict(text=text, x=0.01), height=height, font=FONT, template="plotly_white",
                      margin=dict(l=60, r=20, t=70 if subtitle else 50, b=50),
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0.0),
                      hoverlabel=dict(namelength=-1))
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return fig


BITS_SYMBOLS = {16: "circle", 8: "square", 6: "hexagon", 5: "pentagon", 4: "diamond", 3: "triangle-up", 2: "x",
                1: "cross"}
BITS_DASH = {16: "solid", 8: "dot", 4: "dash", 3: "longdash", 2: "dashdot"}
# FP8 / FP4 cache formats on the trade-off chart: open markers, told apart from the integer widths
FORMAT_NAMES = {"e4m3": "FP8 E4M3", "e5m2": "FP8 E5M2", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}
FORMAT_SYMBOLS = {"e4m3": "square-open", "e5m2": "square-x-open", "nvfp4": "diamond-open", "mxfp4": "diamond-wide-open"}


def width_symbol(bits: int, fmt: str) -> str:
    return BITS_SYMBOLS.get(bits, "circle") if fmt == "int" else FORMAT_SYMBOLS.get(fmt, "circle-open")


METHOD_LABELS = {"h2o": "H2O", "tova": "TOVA", "snapkv": "SnapKV", "streaming": "StreamingLLM",
                 "oracle": "oracle (the bound)", "knorm": "K-norm", "random": "random", "full": "no eviction"}
