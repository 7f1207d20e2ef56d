"""A chart or several as one standalone HTML page: plotly.js inlined once (works offline), with what was
computed, the metrics and a link back to the live view (the pages' "Download charts" buttons); and a
figure as the JSON the app's live charts draw."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from _plotly_utils.utils import to_typed_array_spec

from kvviz.plots.style import CHART_CONFIG


def figure_json(fig: go.Figure) -> str:
    """The figure as plotly.js reads it, the same as `fig.to_json()` gives (tests/test_figures.py
    compares the two for every figure builder), without its copies: plotly's to_json deep-copies the
    figure's data and layout before it encodes them (2.4 ms for the Explorer's attention chart, 0.3 ms
    this way; two charts on every slider move). Arrays go as plotly's own typed-array spec (base64), as
    to_json sends them. A value JSON cannot hold as it stands (NaN, a date) goes through plotly's own
    encoder."""
    figure = {"data": fig._data, "layout": fig._layout}  # the figure's own dicts: read, never changed
    frames = [frame._props for frame in fig._frame_objs]
    if frames:
        figure["frames"] = frames
    try:
        return json.dumps(figure, default=_typed_array, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return fig.to_json()


def _typed_array(value):
    if isinstance(value, np.ndarray):
        spec = to_typed_array_spec(value) if value.size and value.dtype.kind in "biuf" else value
        return spec if isinstance(spec, dict) else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is left to plotly's encoder")


def figures_html(
    figures: Sequence[go.Figure], title: str = "kvviz", metrics: dict | None = None, about: str = "", link: str = ""
) -> str:
    """A standalone HTML page holding the figures (plotly.js inlined once; works offline), with
    what was computed (`about`: '# ' lines), the metrics and a link back to the live view."""
    from html import escape

    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(i == 0), config=CHART_CONFIG) for i, fig in enumerate(figures)
    ]
    body = "\n".join(f"<section>{p}</section>" for p in parts)
    info = "".join(f"<li>{escape(line[2:])}</li>" for line in about.splitlines() if line.startswith("# "))
    table = "".join(
        f"<tr><td>{escape(k)}</td><td>{escape(_fmt_metric(v))}</td></tr>" for k, v in (metrics or {}).items()
    )
    back = f"<p><a href='{escape(link, quote=True)}'>Open this view in kvviz</a></p>" if link else ""
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title></head>"
        f"<body style='font-family:sans-serif'><h1>{escape(title)}</h1>{back}"
        + (f"<ul>{info}</ul>" if info else "")
        + (f"<table><tr><th>metric</th><th>value</th></tr>{table}</table>" if table else "")
        + f"{body}</body></html>"
    )


def _fmt_metric(v) -> str:
    if isinstance(v, float):
        return "∞" if v == float("inf") else f"{v:.6g}"
    return "" if v is None else str(v)
