"""Seeded random baseline: what any policy must beat."""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


class Random(Policy):
    name = "random"
    order = 70
    title = "Random"
    menu = "Random (seeded baseline)"
    colour = "#997700"
    symbol = "triangle-down"
    dash = "1px,3px"
    chunkable = True
    description = "uniformly random heavy hitters (seeded)"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        rng = np.random.default_rng([ctx.spec.seed, ctx.layer])
        return rng.random((ctx.trace.n_kv_heads, ctx.n_positions))

    def arrival_score(self, key, layer, position, spec):
        return np.random.default_rng([spec.seed, layer, position]).random(key.shape[0])
