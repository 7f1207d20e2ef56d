"""From scores to kept masks: the budget rule every policy shares (docs/definitions.md).

`select` keeps the first `sink` tokens, the last `recent`, and the `heavy` highest-scoring
tokens among the rest; `evict_one` is its streaming form, one eviction per decode step.
Pure functions over arrays: the policy base and the allocations (AdaKV, PyramidKV) both use them.
"""

from __future__ import annotations

import numpy as np

from kvviz.spec import Spec


def keep_sinks_and_window(keep: np.ndarray, spec: Spec) -> np.ndarray:
    """Mark the first `sink` and the last `recent` of the n tokens kept in keep (H, n), in place; returns it."""
    n = keep.shape[1]
    keep[:, : spec.sink] = True
    keep[:, max(0, n - spec.recent) :] = True
    return keep


def select(scores: np.ndarray, spec: Spec) -> np.ndarray:
    """Kept mask (kv_heads, n): sinks, recent window, and the top `heavy` of the rest.

    Keeps min(sink + recent + heavy, n) tokens. Ties go to the earlier token. O(n) per
    row: a partition finds the score of the last heavy hitter, and the earliest of the
    tokens tied at that score fill what is left.
    """
    H, n = scores.shape
    keep = keep_sinks_and_window(np.zeros((H, n), dtype=bool), spec)
    # candidates: [first, end)
    first, end = min(spec.sink, n), max(min(spec.sink, n), n - spec.recent)
    take = min(spec.heavy, end - first)
    if take > 0:
        key = -scores[:, first:end]  # best first
        # (H, 1): the last one taken
        cut = np.partition(key, take - 1, axis=1)[:, take - 1 : take]
        above = key < cut  # strictly better
        tied = key == cut
        need = take - above.sum(axis=1, keepdims=True)
        # too many tied: earliest first
        if (tied.sum(axis=1, keepdims=True) > need).any():
            tied &= np.cumsum(tied, axis=1) <= need
        keep[:, first:end] = above | tied
    return keep


def evict_one(kept: np.ndarray, scores: np.ndarray, spec: Spec, p: int) -> np.ndarray:
    """Drop, per KV head, the lowest-scoring token outside the sinks and the recent window.

    kept (H, m+1) -> (H, m). The one eviction rule of kvviz: the engine's streaming simulation and the
    decode caches (uniform and ragged) all call it. A token no query has scored yet (+inf) goes only
    before protected ones. Ties: the later of two equal scores goes, so the token `select` would rank
    last is the one evicted, and greedy eviction under fixed scores keeps exactly the set `select` keeps.
    """
    H = kept.shape[0]
    protected = (kept < spec.sink) | (kept > p - spec.recent)
    # take_along_axis, without its index building
    at = scores[np.arange(H)[:, None], kept]
    key = np.where(protected, np.inf, np.minimum(at, np.finfo(np.float64).max))
    victim = key.shape[1] - 1 - np.argmin(key[:, ::-1], axis=1)  # the last of the lowest
    drop = np.ones(kept.shape, dtype=bool)
    drop[np.arange(H), victim] = False
    return kept[drop].reshape(H, -1)
