"""StreamingLLM (Xiao et al. 2023): attention sinks plus a recent window, by position only."""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


class Streaming(Policy):
    name = "streaming"
    head_separable = True
    window_only = True
    order = 40
    featured = 1
    title = "StreamingLLM"
    menu = "StreamingLLM (position only)"
    colour = "#EE6677"
    symbol = "triangle-up"
    dash = "longdash"
    description = "position only: sinks + recent window (a heavy budget widens the window)"

    def note(self, spec, trace=None) -> str | None:
        if spec.heavy > 0:
            return (
                "StreamingLLM ranks tokens by position only, so the heavy-hitter budget simply widens the "
                "recent window; pick another scorer under Advanced to keep heavy hitters."
            )
        return None

    def score(self, ctx: ScoreContext) -> np.ndarray:
        recency = np.arange(ctx.n_positions, dtype=np.float64)
        return np.broadcast_to(recency, (ctx.trace.n_kv_heads, ctx.n_positions))

    def arrival_score(self, key, layer, position, spec):
        return np.full(key.shape[0], float(position))
