"""Explorer expander: one head's keys as a channel x token heatmap, before and after rotation."""

from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.plots import figures

from kvviz.plots import quant as figures_quant
from kvviz.quant.formats import rotation_effect
from kvviz.quant.rotation import rotate
from kvviz.spec import View

MAX_HEATMAP_TOKENS = 512


def key_rotation_expander(source, view: View) -> None:
    """The View's layer and KV head: keys as cached next to the same keys Hadamard-rotated, with how
    outlying the largest channel is and what 2-bit per-token keys lose either way."""
    trace = source.trace
    with st.expander("Keys before and after rotation (channel × token)", icon=":material/grid_on:"):
        if trace.k is None:
            st.info("This source has no keys (attention logits only), so there is nothing to rotate.")
            return
        layer = min(view.layer, trace.n_layers - 1)
        kv_head = min(view.head, trace.n_q_heads - 1) // trace.group_size
        step = len(trace.evaluated_queries) - 1 if view.step is None else min(view.step, len(trace.evaluated_queries) - 1)
        n = int(trace.query_positions[trace.evaluated_queries[step]]) + 1
        start = max(0, n - MAX_HEATMAP_TOKENS)
        k = np.asarray(trace.k[layer, kv_head, :n], dtype=np.float64)
        effect = rotation_effect(k)
        shown = k[start:]
        fig = figures_quant.key_rotation_figure(shown, rotate(shown), trace.tokens[start:n],
                                                title=f"Layer {layer}, KV head {kv_head}: keys, channel × token",
                                                first_position=start)
        st.plotly_chart(fig, key="rotation_heatmap", config=figures.CHART_CONFIG)
        st.markdown(f"**Largest channel's max |k| / the median channel's:** {effect['peak_before']:.1f}× → "
                    f"{effect['peak_after']:.1f}×  \n**2-bit per-token key error ‖K̂ − K‖ / ‖K‖** (groups of 32 "
                    f"channels): {effect['error_before']:.3f} → {effect['error_after']:.3f}")
        st.caption("What to look for: outlier channels are the bright horizontal stripes on the left. Per-token "
                   "groups share one scale across channels, so a stripe sets the step for every ordinary channel "
                   "of that token. The orthonormal Hadamard rotation (right) mixes every channel into every "
                   "other, spreading the stripe's energy evenly, so the scale fits all channels; queries get the "
                   "same rotation, so q·k and the attention are unchanged until quantization."
                   + (f" Showing the last {MAX_HEATMAP_TOKENS} of {n} tokens." if start else ""))
