"""Shared test helper: a Trace of a test's own random arrays, every position a query."""

import numpy as np

from kvviz.trace import Trace


def every_query_trace(q, k, v, context_len: int, meta: dict) -> Trace:
    """The trace of q, k, v (layers, heads, positions, head_dim) in which every position is a query and
    the tokens are named t0, t1, ...; the first `context_len` positions are the prompt."""
    n = k.shape[2]
    return Trace(
        q=q,
        k=k,
        v=v,
        context_len=context_len,
        tokens=tuple(f"t{i}" for i in range(n)),
        query_positions=np.arange(n),
        meta=meta,
    )
