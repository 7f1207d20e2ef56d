"""Oracle: top-k by the evaluated query's own attention; the bound no causal policy can beat."""

import numpy as np

from .base import Policy, ScoreContext


class Oracle(Policy):
    name = "oracle"
    description = "the evaluated query's true attention (an upper bound, not a real policy)"
    needs_query = True

    def score(self, ctx: ScoreContext) -> np.ndarray:
        raise TypeError("the oracle is scored per evaluated query: use keep_for_query")

    def keep_for_query(self, attention: np.ndarray, ctx: ScoreContext) -> np.ndarray:
        """Kept mask (n,) for one query's attention row (n,)."""
        from .base import select
        return select(attention[None, :], ctx.spec)[0]
