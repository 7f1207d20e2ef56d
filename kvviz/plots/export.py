"""A chart or several as one standalone HTML page: plotly.js inlined once (works offline), with what was
computed, the metrics and a link back to the live view (the pages' "Download charts" buttons)."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from kvviz.plots.style import CHART_CONFIG


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
