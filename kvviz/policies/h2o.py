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

from kvviz.attention import attention_sums
from kvviz.policies.base import Policy, ScoreContext
from kvviz.settings import LABELS, Setting, declare

declare(
    Setting(
        "h2o_normalized",
        "bool",
        False,
        url="h2o_norm",
        owner=("scorer", "h2o"),
        label="H2O: divide by the queries that saw each token",
        help="Off: accumulated attention (H2O as published). On: accumulated attention / number of queries "
        "that could see the token, so early tokens are not favoured for having been seen more often "
        "(kvpress's observed-attention press).",
    )
)
LABELS["h2o"] = lambda spec: "h2o (mean over the queries that saw each token)" if spec.h2o_normalized else "h2o"


class H2O(Policy):
    name = "h2o"
    head_separable = True
    order = 10
    featured = 2
    title = "H2O"
    menu = "H2O (accumulated attention)"
    colour = "#332288"
    symbol = "circle"
    dash = "solid"
    chunkable = True
    description = (
        "accumulated attention from every query seen so far (optionally divided by how many queries "
        "saw the token); streaming. The budget includes the arriving token: a query sees exactly "
        "sink + recent + heavy tokens, itself among them"
    )
    streaming = True

    def note(self, spec, trace=None) -> str | None:
        return self.streaming_note(
            spec, trace, " divided by the queries that saw each token" if spec.h2o_normalized else ""
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        # Sum of the attention each context token received from the context queries,
        # summed over the query heads of each KV group -> (kv_heads, positions).
        received = np.zeros((ctx.trace.n_q_heads, ctx.n_positions))
        # each chunk of rows over the keys it sees, summed (on the cache's device where it lives)
        heads = np.arange(ctx.trace.n_q_heads)
        received[:, : ctx.n_context] = attention_sums(
            ctx.trace, ctx.layer, heads, ctx.history_rows, ctx.n_context, trim=True
        )
        scores = ctx.per_kv_head(received)
        if ctx.spec.h2o_normalized:
            seen = ctx.history_counts()[: ctx.n_context]
            scores[:, : ctx.n_context] /= np.maximum(seen, 1)
        return scores

    def update(self, scores, attention, ctx, seen_counts=None):
        step = ctx.per_kv_head(attention)
        if ctx.spec.h2o_normalized:  # running mean: (mean * n + a) / (n + 1)
            scores *= seen_counts
            scores += step
            scores /= seen_counts + 1
        else:
            scores += step
