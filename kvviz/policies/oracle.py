"""Oracle: top-k by the evaluated query's own attention; the bound no causal policy can beat.

Like every policy it keeps one cache per KV head, so it ranks by the query's attention
summed over the query heads that read that cache (the engine and the decode loop both
ask `query_scores`): no cache shared by a GQA group can keep more of that group's
attention mass.
"""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


class Oracle(Policy):
    name = "oracle"
    order = 50
    featured = 5
    bound = True
    allocated_in_sweeps = True
    title = "Oracle (the bound)"
    short = "Oracle (bound)"
    menu = "Oracle (this query's attention, per KV head; the bound)"
    colour = "#000000"
    symbol = "cross"
    dash = "dot"
    description = "the evaluated query's true attention, summed over the KV group (an upper bound, not a real policy)"
    needs_query = True

    def note(self, spec, trace=None) -> str | None:
        if trace is None or trace.group_size <= 1:
            return None
        return (
            f"The oracle keeps one cache per KV head, chosen by the attention of all {trace.group_size} query "
            "heads that share it: it is the bound for the group's total attention mass, not for each query "
            "head on its own, so another policy can keep slightly more of this one head's mass."
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        raise TypeError("the oracle is scored per evaluated query: use query_scores")

    def query_scores(self, attention: np.ndarray, ctx: ScoreContext, query=None, keys=None) -> np.ndarray:
        """Scores (kv_heads, n) from one query's attention of every query head (q_heads, n)."""
        return ctx.per_kv_head(attention)
