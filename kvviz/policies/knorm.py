"""Key-norm baseline: keep the keys with the smallest L2 norm (query-free)."""

import numpy as np

from kvviz.attention import row_norms
from kvviz.policies.base import Policy, ScoreContext


class KNorm(Policy):
    name = "knorm"
    head_separable = True
    order = 60
    allocated_in_sweeps = True
    title = "K-norm"
    menu = "K-norm (smallest key norm)"
    colour = "#EECC66"
    symbol = "pentagon"
    dash = "5px,3px,1px,3px"
    chunkable = True
    description = "smallest key L2 norm first; needs no attention at all"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        # (kv_heads, positions): ||k_i|| (on the cache's device where it lives)
        return -row_norms(ctx.trace.k, ctx.layer)

    def arrival_score(self, key, layer, position, spec):
        return -np.sqrt(np.vecdot(key, key))  # as `score` computes it
