"""H2O, Heavy-Hitter Oracle (Zhang et al. 2023): keep the tokens with the most accumulated attention.

Two forms of the score (`Spec.h2o_normalized`):
    sum   s_i = sum over the queries seen so far of the attention they gave token i,
                summed over the query heads of the KV group (H2O as published)
    mean  s_i = that sum / the number of those queries that could see token i
                (kvpress's ObservedAttentionPress): an early token is no longer favoured
                just because more queries have looked at it
Streaming: at every decode step the new token arrives, the cache is trimmed back to the
budget by the current scores, and the step's attention is folded in.
"""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


class H2O(Policy):
    name = "h2o"
    description = ("accumulated attention from every query seen so far (optionally divided by how many queries "
                   "saw the token); streaming. The budget includes the arriving token: a query sees exactly "
                   "sink + recent + heavy tokens, itself among them")
    streaming = True

    def score(self, ctx: ScoreContext) -> np.ndarray:
        # Sum of the attention each context token received from the context queries,
        # summed over the query heads of each KV group -> (kv_heads, positions).
        received = np.zeros((ctx.trace.n_q_heads, ctx.n_positions))
        for _, attn in ctx.context_attention(trim=True):  # (q_heads, rows, m): the keys those rows see
            received[:, : attn.shape[-1]] += attn.sum(axis=1, dtype=np.float64)
        scores = ctx.per_kv_head(received)
        if ctx.spec.h2o_normalized:
            seen = ctx.history_counts()[: ctx.n_context]
            scores[:, : ctx.n_context] /= np.maximum(seen, 1)
        return scores

    def update(self, scores, attention, ctx, seen_counts=None):
        step = ctx.per_kv_head(attention)
        if ctx.spec.h2o_normalized:   # running mean: (mean * n + a) / (n + 1)
            scores *= seen_counts
            scores += step
            scores /= seen_counts + 1
        else:
            scores += step
