"""Attention rows computed on demand from q and k: a = softmax(q . K^T / sqrt(d)).

Never a full positions x positions matrix for every layer: callers ask for the rows
they need, one layer at a time, vectorised over heads and rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .trace import Trace


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax; -inf entries get exactly zero weight."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def masked_softmax(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Softmax over the kept entries only; evicted entries get exactly zero."""
    return softmax(np.where(keep, logits, -np.inf))


def logit_row(trace: Trace, layer: int, head: int, qi: int, keys: np.ndarray | None = None) -> np.ndarray:
    """Logits of query qi (index into query_positions) of one head over keys 0..p. Shape (p+1,).

    `keys` (p+1, head_dim) replaces the trace's keys (e.g. dequantized ones). For a
    logit-only source the exact stored logits are used, plus q . (keys - K) / sqrt(d)
    when other keys are given, so no quantization means exactly the source's logits.
    """
    p = int(trace.query_positions[qi])
    k_true = trace.k[layer, trace.kv_head(head), : p + 1]
    q = trace.q[layer, head, qi].astype(np.float64)
    scale = 1.0 / np.sqrt(trace.head_dim)
    if trace.logits is not None:
        base = trace.logits[layer, head, qi, : p + 1].astype(np.float64)
        if keys is None:
            return base
        return base + (keys.astype(np.float64) - k_true) @ q * scale
    k = k_true if keys is None else keys
    return k.astype(np.float64) @ q * scale


def context_rows(trace: Trace, layer: int, heads: np.ndarray, rows: np.ndarray,
                 n_keys: int, chunk: int = 512) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Causal attention of context queries `rows` (indices into query_positions) over keys 0..n_keys-1.

    Yields (row_indices, attention) chunks, attention of shape (len(heads), chunk, n_keys),
    float32, zero where a query may not look (future keys). Used by the history-based
    scorers; chunked so a long context never materialises all rows at once.
    """
    q_all = trace.q[layer][heads]                                   # (H, Nq, D)
    kv = trace.kv_head(np.asarray(heads))
    k = trace.k[layer][kv, :n_keys].astype(np.float32, copy=False)  # (H, n_keys, D)
    scale = np.float32(1.0 / np.sqrt(trace.head_dim))
    key_pos = np.arange(n_keys)
    for start in range(0, len(rows), chunk):
        idx = rows[start:start + chunk]
        if trace.logits is not None:
            logits = trace.logits[layer][heads][:, idx, :n_keys].astype(np.float32)
        else:
            q = q_all[:, idx].astype(np.float32, copy=False)        # (H, c, D)
            logits = np.matmul(q, np.swapaxes(k, 1, 2)) * scale    # (H, c, n_keys)
        future = key_pos[None, :] > trace.query_positions[idx][:, None]  # (c, n_keys)
        logits[:, future] = -np.inf
        yield idx, softmax(logits)
