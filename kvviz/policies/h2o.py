"""H2O, Heavy-Hitter Oracle (Zhang et al. 2023): keep the tokens with the most accumulated attention."""

import numpy as np

from .base import Policy, ScoreContext


class H2O(Policy):
    name = "h2o"
    description = "accumulated attention from every query seen so far; streaming"
    streaming = True

    def score(self, ctx: ScoreContext) -> np.ndarray:
        # Sum of the attention each context token received from the context queries,
        # summed over the query heads of each KV group -> (kv_heads, positions).
        received = np.zeros((ctx.trace.n_q_heads, ctx.n_positions))
        for _, attn in ctx.context_attention():          # (q_heads, rows, n_context)
            received[:, : ctx.n_context] += attn.sum(axis=1, dtype=np.float64)
        return ctx.per_kv_head(received)

    def update(self, scores, attention, ctx):
        scores += ctx.per_kv_head(attention)
