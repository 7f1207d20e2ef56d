"""An example kvviz plug-in (docs/plugins.md): two scorers, a Policy subclass and a function."""

import numpy as np

from kvviz.policies import Policy, ScoreContext


class LastQueries(Policy):
    name = "last8"
    description = "attention from the last 8 context queries, summed over the KV group (SnapKV without pooling)"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        rows = ctx.history_rows[-8:]  # the last 8 context queries
        votes = np.zeros((ctx.trace.n_q_heads, ctx.n_positions))
        for _, attn in ctx.context_attention(rows=rows):  # (q_heads, rows, n_context)
            votes[:, : ctx.n_context] += attn.sum(axis=1)
        scores = ctx.per_kv_head(votes)  # (kv_heads, positions)
        scores[:, ctx.n_context :] = -np.inf  # later tokens: only while in the window
        return scores


def keep_early(ctx: ScoreContext) -> np.ndarray:
    """earliest tokens first (a position-only baseline)"""
    return -np.arange(ctx.n_positions, dtype=np.float64)  # one score shared by every KV head
