"""TOVA, Token Omission Via Attention (Oren et al. 2024): the last query decides, for all heads."""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


class TOVA(Policy):
    name = "tova"
    order = 20
    featured = 3
    title = "TOVA"
    menu = "TOVA (last query)"
    colour = "#E69F00"
    symbol = "square"
    dash = "dash"
    description = (
        "attention from the last query seen, averaged over all heads (one decision for every head); "
        "streaming. The budget includes the arriving token: a query sees exactly sink + recent + heavy "
        "tokens, itself among them"
    )
    streaming = True

    def score(self, ctx: ScoreContext) -> np.ndarray:
        last = ctx.history_rows[-1:]
        _, attn = next(ctx.context_attention(rows=last))  # (q_heads, 1, n_context)
        scores = np.full(ctx.n_positions, -np.inf)
        scores[: ctx.n_context] = attn[:, 0].mean(axis=0)
        return np.broadcast_to(scores, (ctx.trace.n_kv_heads, ctx.n_positions))

    def update(self, scores, attention, ctx, seen_counts=None):
        scores[:] = attention.mean(axis=0)  # one decision shared by every head
