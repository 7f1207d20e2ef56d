"""SnapKV (Li et al. 2024): the last context queries vote for the tokens before them.

The observation window is the last `w` context queries (`Spec.observation_window`: the
recent window, capped at 64, unless set). Each query of the window votes with its
attention over the tokens before the window; the votes are averaged over the window,
smoothed by 1-D average pooling (kernel 5, stride 1, zero padding counted in the mean)
and averaged over the query heads of each KV group. The heavy budget goes to the
top-voted tokens before the window; the window itself is kept because it lies inside the
recent window (the spec refuses a window larger than the recent window). Tokens inside
the window have no vote, so they can never take a heavy slot. (kvpress: SnapKVPress,
window_size=64, kernel_size=5.)
"""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


class SnapKV(Policy):
    name = "snapkv"
    description = ("votes of the last context queries (the observation window, kept as part of the recent "
                   "window), average-pooled; heavy slots go to the top-voted tokens before the window")

    def score(self, ctx: ScoreContext) -> np.ndarray:
        c, spec = ctx.n_context, ctx.spec
        window_start = max(0, c - spec.observation_window)
        scores = np.full((ctx.trace.n_kv_heads, ctx.n_positions), -np.inf)   # no vote: never a heavy hitter
        if window_start == 0:          # the window covers the whole context: nothing before it to rank
            return scores
        rows = ctx.history_rows[ctx.trace.query_positions[ctx.history_rows] >= window_start]
        votes = np.zeros((ctx.trace.n_q_heads, c))
        for _, attn in ctx.context_attention(rows=rows):  # (q_heads, rows, c)
            votes += attn.sum(axis=1, dtype=np.float64)
        votes /= max(len(rows), 1)
        # 1-D average pooling over the tokens before the window, kernel k, stride 1,
        # zero padding of k // 2 on each side counted in the mean.
        k = spec.snapkv_kernel
        padded = np.pad(votes[:, :window_start], ((0, 0), (k // 2, k // 2)))
        pooled = np.stack([np.convolve(row, np.full(k, 1.0 / k), mode="valid") for row in padded])
        scores[:, :window_start] = ctx.per_kv_head(pooled) / ctx.trace.group_size
        return scores
