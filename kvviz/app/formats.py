"""Explorer expander: one head's keys as a channel x token heatmap, before and after rotation (computed only
while the expander is open, and cached)."""

from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app.charts import chart, folded
from kvviz.plots import style

from kvviz.plots import quant as figures_quant
from kvviz.quant.formats import rotation_effect
from kvviz.quant.rotation import rotate
from kvviz.spec import View

MAX_HEATMAP_TOKENS = 512


@st.cache_resource(max_entries=16, show_spinner=False)
def _rotation(source_key: tuple, layer: int, kv_head: int, n: int, _trace) -> tuple:
    """(rotation effect, the drawn keys, the same keys rotated) of one KV head's first n keys; the last
    MAX_HEATMAP_TOKENS are drawn."""
    k = np.asarray(_trace.k[layer, kv_head, :n], dtype=np.float64)
    shown = k[max(0, n - MAX_HEATMAP_TOKENS) :]
    return rotation_effect(k), shown, rotate(shown)


def key_rotation_expander(source, view: View) -> None:
    """The View's layer and KV head: keys as cached next to the same keys Hadamard-rotated, with how
    outlying the largest channel is and what 2-bit per-token keys lose either way. Computed only while
    the expander is open."""
    trace = source.trace
    box = folded("Keys before and after rotation (channel × token)", key="_rotation_open", icon=":material/grid_on:")
    with box:
        if not box.open:
            return
        if trace.k is None:
            st.info("This source has no keys (attention logits only), so there is nothing to rotate.")
            return
        layer = min(view.layer, trace.n_layers - 1)
        kv_head = min(view.head, trace.n_q_heads - 1) // trace.group_size
        step = (
            len(trace.evaluated_queries) - 1 if view.step is None else min(view.step, len(trace.evaluated_queries) - 1)
        )
        n = int(trace.query_positions[trace.evaluated_queries[step]]) + 1
        start = max(0, n - MAX_HEATMAP_TOKENS)
        effect, shown, rotated = _rotation(source.key, layer, kv_head, n, trace)
        fig = figures_quant.key_rotation_figure(
            shown,
            rotated,
            trace.tokens[start:n],
            title=f"Layer {layer}, KV head {kv_head}: keys, channel × token",
            first_position=start,
        )
        chart(fig, key="rotation_heatmap", config=style.CHART_CONFIG)
        st.markdown(
            f"**Largest channel's max |k| / the median channel's:** {effect['peak_before']:.1f}× → "
            f"{effect['peak_after']:.1f}×  \n**2-bit per-token key error ‖K̂ − K‖ / ‖K‖** (groups of 32 "
            f"channels): {effect['error_before']:.3f} → {effect['error_after']:.3f}"
        )
        st.caption(
            "What to look for: outlier channels are the bright horizontal stripes on the left. Per-token "
            "groups share one scale across channels, so a stripe sets the step for every ordinary channel "
            "of that token. The orthonormal Hadamard rotation (right) mixes every channel into every "
            "other, spreading the stripe's energy evenly, so the scale fits all channels; queries get the "
            "same rotation, so q·k and the attention are unchanged until quantization."
            + (f" Showing the last {MAX_HEATMAP_TOKENS} of {n} tokens." if start else "")
        )
