"""KeyDiff (Park et al. 2025): keep the keys least similar to the mean key (query-free).

Anchor: the mean of the context's L2-normalised keys of each KV head,
a = mean_i k_i / ||k_i||; score_i = -cos(k_i, a). Keys that point away from the common
direction carry distinct information; those close to it are redundant. (kvpress:
KeyDiffPress, one shot over the context; the paper's block-wise form is kvpress's
BlockPress around it.) Tokens after the compression point get no score.
"""

import numpy as np

from kvviz.attention import normalised_mean
from kvviz.policies.base import Policy, ScoreContext


class KeyDiff(Policy):
    name = "keydiff"
    head_separable = True
    order = 90
    title = "KeyDiff"
    menu = "KeyDiff (least similar to the mean key)"
    colour = "#AA4499"
    symbol = "bowtie"
    dash = "2px,2px,8px,2px"
    chunkable = True
    description = (
        "least cosine-similar to the anchor, the mean of the context's normalised keys; needs no attention at all"
    )
    paper = "Park et al. 2025, KeyDiff: key similarity-based KV cache eviction for long-context LLM inference"
    kvpress = "KeyDiffPress"

    def note(self, spec, trace=None) -> str | None:
        return (
            "KeyDiff: keys least similar (cosine) to the mean of the context's normalised keys are kept; no "
            "attention is needed."
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        c = ctx.n_context
        # norms (kv_heads, c), anchor (kv_heads, d), dots (kv_heads, c): on the cache's device where it lives
        norms, anchor, dots = normalised_mean(ctx.trace.k, ctx.layer, c)
        anchor_norm = np.maximum(np.linalg.norm(anchor.astype(np.float64), axis=-1, keepdims=True), 1e-12)
        cos = dots.astype(np.float64) / (norms * anchor_norm)
        scores = np.full((ctx.trace.n_kv_heads, ctx.n_positions), -np.inf)
        scores[:, :c] = -cos
        return scores
