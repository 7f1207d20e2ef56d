"""Overviews of a trace over its layers and heads (numpy only): the sink share per (layer, head) and
how concentrated attention is. Each reads one layer at a time (a trace opened lazily from its file
reads them one by one)."""

from __future__ import annotations

import numpy as np

from kvviz.trace import Trace, TraceError


class OverviewError(TraceError):
    """An overview that cannot be drawn (no layers from the first one asked)."""


def _tail_rows(trace: Trace, n_rows: int, which: str) -> np.ndarray:
    rows = trace.context_queries if which == "context" else np.arange(trace.n_queries)
    return rows[-n_rows:]


def head_overview(trace: Trace, n_rows: int = 32, which: str = "context") -> np.ndarray:
    """Sink share per (layer, query head): attention on token 0, averaged over the last
    `n_rows` queries of the context (which="context") or of the whole trace ("all")."""
    from kvviz.attention import context_rows

    rows = _tail_rows(trace, n_rows, which)
    heads = np.arange(trace.n_q_heads)
    out = np.zeros((trace.n_layers, trace.n_q_heads))
    for layer in range(trace.n_layers):
        total = np.zeros(trace.n_q_heads)
        for _, a in context_rows(trace, layer, heads, rows, trace.n_positions):  # (Hq, c, T)
            total += a[:, :, 0].sum(axis=1)
        out[layer] = total / len(rows)
    return out


def concentration(
    trace: Trace, first_layer: int = 2, n_rows: int = 32, top: float = 0.10, which: str = "context"
) -> dict[str, float]:
    """How concentrated attention is, averaged over layers >= first_layer, all heads and the
    last `n_rows` context queries: the first token's share, and the share held by the top
    `top` fraction of the keys each query sees (at least one key)."""
    from kvviz.attention import context_rows

    rows = _tail_rows(trace, n_rows, which)
    heads = np.arange(trace.n_q_heads)
    first, topk, count = 0.0, 0.0, 0
    for layer in range(first_layer, trace.n_layers):
        for idx, a in context_rows(trace, layer, heads, rows, trace.n_positions):  # (Hq, c, T)
            seen = trace.query_positions[idx] + 1  # keys per row
            srt = -np.sort(-a, axis=-1)  # descending
            csum = np.cumsum(srt, axis=-1)
            k = np.maximum(1, np.ceil(top * seen).astype(int))  # (c,)
            topk += np.take_along_axis(csum, (k - 1)[None, :, None].repeat(len(heads), 0), -1).sum()
            first += a[:, :, 0].sum()
            count += a.shape[0] * a.shape[1]
    if count == 0:
        raise OverviewError(f"the trace has no layers from {first_layer} on")
    return {
        "first_token": float(first / count),
        "top_share": float(topk / count),
        "rows": int(len(rows)),
        "layers": int(trace.n_layers - first_layer),
    }
