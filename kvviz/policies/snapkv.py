"""SnapKV (Li et al. 2024): the last context queries vote for the tokens before them."""

import numpy as np

from .base import Policy, ScoreContext


class SnapKV(Policy):
    name = "snapkv"
    description = "votes of the last context queries, average-pooled; the window is kept"

    def score_key(self, spec):
        return (spec.snapkv_window, spec.snapkv_kernel)

    def score(self, ctx: ScoreContext) -> np.ndarray:
        c, spec = ctx.n_context, ctx.spec
        window_start = max(0, c - spec.snapkv_window)
        rows = ctx.history_rows[ctx.trace.query_positions[ctx.history_rows] >= window_start]
        votes = np.zeros((ctx.trace.n_q_heads, c))
        for _, attn in ctx.context_attention(rows=rows):  # (q_heads, rows, c)
            votes += attn.sum(axis=1, dtype=np.float64)
        votes /= max(len(rows), 1)
        # 1-D average pooling, kernel k, stride 1, zero padding counted in the mean.
        k = spec.snapkv_kernel
        # When the window covers the whole context, the votes rank every token instead.
        prefix_end = window_start if window_start > 0 else c
        prefix = votes[:, :prefix_end]
        padded = np.pad(prefix, ((0, 0), (k // 2, k // 2)))
        pooled = np.stack([np.convolve(row, np.full(k, 1.0 / k), mode="valid") for row in padded])
        scores = np.full((ctx.trace.n_kv_heads, ctx.n_positions), -np.inf)
        scores[:, :prefix_end] = ctx.per_kv_head(pooled) / ctx.trace.group_size
        if window_start > 0:
            scores[:, window_start:c] = np.inf  # the observation window itself is always kept
        return scores
