"""Compression during decoding (kvpress's DecodingPress): every N decode steps the cache is scored
again over everything it holds and cut back to the budget.

`Spec.compress_every` (N, in decode steps; 0 = compress once):

    0    the cache is compressed once, when the prompt's last query (position c - 1) has read it;
         afterwards one-shot scorers evict the lowest score outside sinks and window as each token
         arrives (kvviz.policies.base).
    N    after the prompt's compression the cache grows without evicting. After the query at
         position p = c - 1 + kN (the N-th, 2N-th, ... decode step) has read the cache, the scorer
         scores again as if the prompt ended at p: the queries and keys of positions 0..p, the
         generated ones included (SnapKV's observation window is the last queries), and each KV head
         keeps `select`'s choice among the tokens it holds. A query reads at most budget + N tokens,
         its own among them.

The scorer reads the queries and keys of every position up to p, as the compression at the end of
the prompt does (kvviz stores every key; the scores of tokens the cache no longer holds are never
used). One deviation from kvpress: attention-based scorers (SnapKV) normalise the observation
window's attention over every key up to p, not over the held keys only.

Streaming scorers (H2O, TOVA) already decide at every step, and the oracle and Quest at every query:
for them the setting is refused, as is AdaKV's per-head allocation (its head budgets are fixed at
the prompt's compression point) and ChunkKV's kvpress rule (whole chunks cut from position 0 of the
prompt; with chunk_rule "budget" every token carries its chunk's score and `select` applies): the
setting and that rule are declared in kvviz.policies.decoding. The engine (Policy.keep_masks) and the real-model caches
(kvviz.decode.cache) both run `decoding_masks` / `recompressed`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from kvviz.policies.select import select
from kvviz.spec import SpecError
from kvviz.trace import Trace, validate


def is_due(p: int, context_len: int, every: int) -> bool:
    """Whether the cache is compressed again right after the query at position p has read it."""
    return every > 0 and p >= context_len and (p - context_len + 1) % every == 0


class LayerTrace(Trace):
    """A trace whose layers are all one layer (zero-stride views), checked as that one layer: the check of
    a Trace reads every value, which here would read the same layer n_layers times."""

    def __post_init__(self) -> None:
        one = {
            name: None if a is None else a[:1]
            for name, a in (("q", self.q), ("k", self.k), ("v", self.v), ("logits", self.logits))
        }
        validate(
            SimpleNamespace(
                **one,
                context_len=self.context_len,
                tokens=self.tokens,
                query_positions=self.query_positions,
                noise_eps=self.noise_eps,
            )
        )


def layer_trace(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray | None,
    layer: int,
    n_layers: int,
    tokens: tuple[str, ...],
    meta: dict,
    logits: np.ndarray | None = None,
) -> Trace:
    """One layer's positions 0..p as a trace whose prompt is all of them (what a scorer reads at a later
    compression point). q (Hq, p + 1, D): one query per position; k, v (H, p + 1, D); logits (Hq, p + 1,
    p + 1) or None. The trace has n_layers layers that are all this one (zero-stride views: no copy), so
    a scorer reads it at its own layer index (the random scorer's seed is the layer's)."""

    def every_layer(a):
        return None if a is None else np.broadcast_to(a[None], (n_layers, *a.shape))

    n = k.shape[1]
    return LayerTrace(
        q=every_layer(q),
        k=every_layer(k),
        v=every_layer(v),
        context_len=n,
        tokens=tuple(tokens[:n]),
        query_positions=np.arange(n),
        meta=meta,
        logits=every_layer(logits),
    )


def prefix_trace(trace: Trace, layer: int, end: int) -> Trace:
    """`layer_trace` of positions 0..end - 1 of a trace with a query at every position (a decoded run)."""
    rows = np.flatnonzero(trace.query_positions < end)
    if len(rows) != end:
        raise SpecError(
            "compressing again during decoding needs a query at every position (a decoded run's "
            "trace); this trace has queries at some positions only"
        )
    logits = None if trace.logits is None else trace.logits[layer][:, rows, :end]
    return layer_trace(
        trace.q[layer][:, rows],
        trace.k[layer][:, :end],
        None if trace.v is None else trace.v[layer][:, :end],
        layer,
        trace.n_layers,
        trace.tokens,
        trace.meta,
        logits,
    )


def recompressed(held: np.ndarray, scores: np.ndarray, spec) -> np.ndarray:
    """The kept positions (H, m') after compressing again: held (H, m) sorted positions each KV head holds,
    scores (H, >= held.max() + 1) the scorer's new scores of every position. Each head keeps `select`'s
    choice among its held tokens (sinks: its first `sink`, window: its last `recent`, both positions
    themselves since the held set starts with the sinks and ends with every token since the window)."""
    mask = select(np.take_along_axis(scores, held, axis=1), spec)  # (H, m)
    return held[mask].reshape(held.shape[0], -1)


def decoding_masks(
    held: np.ndarray,
    context_len: int,
    spec,
    positions: np.ndarray,
    out: np.ndarray,
    rescore: Callable[[int], np.ndarray],
) -> np.ndarray:
    """Kept masks at the evaluated positions >= context_len, compressing again every spec.compress_every
    steps. held (H, m): what each KV head keeps after the prompt's compression; rescore(end) -> scores
    (H, end) of positions 0..end - 1 at the compression point after query end - 1; out (len(positions),
    H, P) is filled at those positions (the query at p reads its cache after p has arrived, before the
    compression that follows it)."""
    H = held.shape[0]
    want: dict[int, list[int]] = {}
    for i, p in enumerate(positions):
        if p >= context_len:
            want.setdefault(int(p), []).append(i)
    last = max(want, default=context_len - 1)
    for p in range(context_len, last + 1):
        held = np.concatenate([held, np.full((H, 1), p)], axis=1)  # arrives; nothing evicted
        for i in want.get(p, ()):
            np.put_along_axis(out[i], held, True, axis=1)
        if p < last and is_due(p, context_len, spec.compress_every):
            held = recompressed(held, rescore(p + 1), spec)
    return out
