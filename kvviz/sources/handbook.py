"""The handbook's worked example, reproduced exactly.

One query over 64 tokens. Logits: 0.5 * randn(1, 64) from numpy's legacy generator with
seed 42; +2.0 on tokens 0-3 (attention sinks), +1.5 on the last 8 (local focus), +1.8 on
token 15 and +2.0 on token 28 (heavy hitters). The noise model's first draw is the next
64 standard normals of the same generator.

The example only has logits. So that the bits slider means real K/V quantization here
too, we realise keys whose dot product with a unit query u reproduces the logits:
    k_i = r_i - (u . r_i) u + l_i sqrt(d) u      =>   u . k_i / sqrt(d) = l_i
with random r_i and random values from a fixed seed. The exact logits are kept as well,
so without quantization the example is bit for bit the handbook's.
"""

from __future__ import annotations

import numpy as np

from kvviz.trace import Trace

SEQ_LEN = 64
HEAD_DIM = 64
SINKS = range(0, 4)
LOCAL = 8
HEAVY_HITTERS = {15: 1.8, 28: 2.0}
SIGMA = 0.01  # the handbook's noise scale
SINK, RECENT, HEAVY = 4, 8, 2  # the handbook's eviction example


def handbook_logits() -> tuple[np.ndarray, np.ndarray]:
    """(logits (64,), first noise draw eps (64,)) exactly as the handbook makes them."""
    rng = np.random.RandomState(42)  # same stream as np.random.seed(42)
    logits = rng.randn(1, SEQ_LEN) * 0.5
    logits[:, : len(SINKS)] += 2.0
    logits[:, -LOCAL:] += 1.5
    for token, boost in HEAVY_HITTERS.items():
        logits[:, token] += boost
    eps = rng.randn(SEQ_LEN)
    return logits[0], eps


def handbook_trace(head_dim: int = HEAD_DIM, seed: int = 0) -> Trace:
    logits, eps = handbook_logits()
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(head_dim)
    u /= np.linalg.norm(u)
    r = rng.standard_normal((SEQ_LEN, head_dim))
    keys = r - np.outer(r @ u, u) + np.outer(logits * np.sqrt(head_dim), u)
    values = rng.standard_normal((SEQ_LEN, head_dim))
    return Trace(
        q=u[None, None, None, :],
        k=keys[None, None],
        v=values[None, None],
        context_len=SEQ_LEN,
        tokens=tuple(f"t{i}" for i in range(SEQ_LEN)),
        query_positions=np.array([SEQ_LEN - 1]),
        meta={
            "source": "handbook",
            "description": "the handbook's worked example: one query over 64 tokens",
            "quantization_note": "keys realised from the example's logits (exact without quantization)",
        },
        logits=logits[None, None, None, :],
        noise_eps=eps,
    )
