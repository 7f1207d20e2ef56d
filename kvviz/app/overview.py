"""Two Explorer sections: the layer x head overview (where compression hurts most) and the text as chips."""

from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app.charts import chart, folded
from kvviz.app.compute import Source, run_head_grid
from kvviz.app.store import state, w_choice, w_last_is_minus_one
from kvviz.engine import REASONS, Comparison
from kvviz.plots import grids
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import Trace, TraceError

OVERVIEW_MAX_CELLS = 1024  # layers x heads
# a 32k-token row: the heatmap sends layers x heads numbers whatever the length (computing it is the cost)
OVERVIEW_MAX_TOKENS = 32768
GRID_MAX_TOKENS = 1024  # tokens a page of the token grid holds


def _jump(layer: int, head: int) -> None:
    """Open (layer, head): `layer` the model's own number, as the Layer box and the link name it."""
    for name, value in (("layer", layer), ("head", head)):
        state()[name] = value
        st.session_state[name] = value


def head_overview(source: Source, spec: Spec, view: View) -> None:
    """A layers x heads heatmap of the error at this query, and a jump to the worst head."""
    t = source.trace
    if t.n_layers * t.n_q_heads <= 1:
        return
    box = folded("Layer × head overview: where does compression hurt most?", key="_overview_open")
    with box:
        if not box.open:  # folded: compute nothing (every layer and head is the costly part)
            return
        n = int(t.query_positions[t.evaluated_queries[-1 if view.step is None else view.step]]) + 1
        if t.n_layers * t.n_q_heads > OVERVIEW_MAX_CELLS or n > OVERVIEW_MAX_TOKENS:
            st.info(
                f"The overview covers up to {OVERVIEW_MAX_CELLS} layer × head cells and "
                f"{OVERVIEW_MAX_TOKENS} tokens; this trace is larger. Pick a layer and head in View."
            )
            return
        metric = st.radio(
            "Colour by",
            ("tv_distance", "mass_retained"),
            horizontal=True,
            key="_overview_metric",
            format_func={"tv_distance": "TV distance (error)", "mass_retained": "attention mass retained"}.get,
        )
        try:
            grid = run_head_grid(source, spec, view.step, metric)
        except (SpecError, TraceError, ValueError) as e:
            st.error(f"Cannot compute the overview: {e}")
            return
        label = "TV distance" if metric == "tv_distance" else "mass retained"
        chart(
            grids.heatmap_figure(
                grid, f"{label} per layer and query head at this query", label, layers=t.layer_numbers
            ),
            key="overview_chart",
        )
        worst = np.unravel_index(np.argmax(grid) if metric == "tv_distance" else np.argmin(grid), grid.shape)
        worst_layer = t.layer_numbers[int(worst[0])]
        st.button(
            f"Jump to the head that loses most: layer {worst_layer}, head {worst[1]}",
            key="_jump_worst",
            on_click=_jump,
            args=(int(worst_layer), int(worst[1])),
        )
        st.caption(
            "What to look for: bright cells (TV) or dark cells (mass) are the heads this setting hurts; "
            "early layers and local heads usually suffer most from heavy eviction."
        )


def has_text_tokens(trace: Trace) -> bool:
    """True for real text (a model capture), not the t0, t1, ... labels of synthetic sources."""
    return trace.meta.get("source") not in ("handbook", "synthetic")


def token_grid(comp: Comparison, source: Source) -> None:
    """The real text as chips: sink / recent / heavy hitter / evicted / the newest token."""
    if not has_text_tokens(source.trace):
        return
    p = comp.primary
    n = len(comp.tokens)
    c1, c2 = st.columns([2, 3], vertical_alignment="bottom")
    c1.markdown("**The text, as the compressed cache holds it**")
    shade = w_choice(
        c2,
        "grid_shade",
        "Colour the chips by",
        ("reason", "attention", "error"),
        widget="radio",
        format_func={"reason": "why kept", "attention": "original attention", "error": "attention error"}.get,
    )
    start, stop = 0, n
    if n > GRID_MAX_TOKENS:  # pages of GRID_MAX_TOKENS tokens, the last (the newest tokens) first
        pages = -(-n // GRID_MAX_TOKENS)
        c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
        page = w_last_is_minus_one(
            c1, "grid_page", f"Page (of {pages})", pages, (source.key, n), help="0 is the first page."
        )
        start, stop = page * GRID_MAX_TOKENS, min(n, (page + 1) * GRID_MAX_TOKENS)
        c2.caption(f"Tokens {start}-{stop - 1} of {n}, {GRID_MAX_TOKENS} a page.")
    reasons = [REASONS[int(r)] for r in p.reason[start:stop]]
    context = source.trace.context_len - start if start <= source.trace.context_len < stop else None
    st.html(
        grids.token_grid_html(
            comp.tokens[start:stop],
            reasons,
            p.original[start:stop],
            newest=n - 1 - start if stop == n else None,
            shade=shade,
            error=p.error[start:stop],
            context_len=context,
        )
    )
    st.caption(
        "What to look for: which words survive. Sinks and the recent window are kept by position; "
        "heavy hitters by score; struck-through tokens are gone for this query. Hover a token for its "
        "attention and error."
    )
