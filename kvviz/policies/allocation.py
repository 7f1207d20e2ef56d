"""Budget allocation: how the heavy budget is spread over the KV heads and the layers.

A wrapper around any scorer: the scorer says how much each token matters, the allocation
says how many heavy hitters each (layer, KV head) cache may hold. Sinks and the recent
window stay per head, as always.

    uniform  every KV head of every layer keeps `heavy` heavy hitters (kvviz's default).
    adakv    AdaKV (Feng et al. 2024; kvpress AdaKVPress): one budget per layer,
             kv_heads * heavy heavy hitters, given to the top scores across all KV heads
             of the layer taken together (scores must be comparable across heads, e.g.
             attention), after a safeguard: each head first keeps its own top
             floor(alpha * heavy) (kvpress alpha_safeguard = 0.2). Heads then hold
             different numbers of tokens: the caches are ragged.
    pyramid  PyramidKV (Cai et al. 2024; kvpress PyramidKVPress): layer budgets falling
             linearly from 2h - h/beta at the lowest layer to h/beta at the highest (h =
             heavy, kvpress beta = 20), rounded (largest remainder) to sum to exactly n_layers * h,
             the uniform total. beta = 1 is flat.

AdaKV is decided once, at the compression point, from the compression-time scores (the
oracle: from each evaluated query's own attention); afterwards each head keeps its own
budget, as a real ragged cache would.
"""

from __future__ import annotations

import numpy as np

from kvviz.policies.select import select
from kvviz.spec import Spec


def pyramid_budgets(heavy: int, n_layers: int, beta: float) -> np.ndarray:
    """Heavy budget of each layer (n_layers,) int: linear from the bottom, non-increasing, sum n_layers * heavy."""
    if n_layers <= 1 or heavy == 0:
        return np.full(max(n_layers, 1), heavy, dtype=np.int64)[:n_layers]
    lo = heavy / beta
    hi = 2.0 * heavy - lo
    real = hi - np.arange(n_layers) * (hi - lo) / (n_layers - 1)
    out = np.floor(real + 1e-9).astype(np.int64)
    rest = int(n_layers * heavy - out.sum())      # 0 <= rest < n_layers, to the largest fractional parts
    # (largest remainder keeps the budgets non-increasing: of two layers with the same floor the
    # lower one has the larger fraction; it is also kvpress's rounding wherever that sums exactly)
    order = np.lexsort((np.arange(n_layers), -(real - out)))
    out[order[:rest]] += 1
    return out


def layer_spec(spec: Spec, layer: int, n_layers: int) -> Spec:
    """The spec one layer runs under: the pyramid's heavy budget for that layer; otherwise `spec`."""
    if spec.allocation != "pyramid" or not spec.evicts:
        return spec
    heavy = int(pyramid_budgets(spec.heavy, n_layers, spec.pyramid_beta)[layer])
    return spec.with_(heavy=heavy, allocation="uniform")


def candidates(n: int, spec: Spec) -> tuple[int, int]:
    """[first, end): the tokens of a row of n that compete for heavy slots (outside sinks and window)."""
    first = min(spec.sink, n)
    return first, max(first, n - spec.recent)


def adakv_heavy(scores: np.ndarray, spec: Spec) -> np.ndarray:
    """AdaKV's heavy budget per KV head (H,) from scores (H, n) of one layer.

    Safeguard: each head's top floor(alpha * heavy) candidates first; then the rest of the
    layer's H * heavy slots to the best remaining candidates of any head. Ties: the earlier
    token, then the lower head (as `select` breaks ties within a head).
    """
    H, n = scores.shape
    first, end = candidates(n, spec)
    n_c = end - first
    take = min(spec.heavy, n_c)
    if take <= 0:
        return np.zeros(H, dtype=np.int64)
    floor = min(int(spec.adakv_alpha * spec.heavy), take)
    s = np.nan_to_num(np.asarray(scores[:, first:end], dtype=np.float64), nan=-np.inf, posinf=np.finfo(float).max)
    order = np.argsort(-s, axis=1, kind="stable")                   # per head, best first, earlier on ties
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n_c)[None, :].repeat(H, 0), axis=1)
    counts = np.full(H, floor, dtype=np.int64)
    rest = H * take - H * floor
    if rest > 0:
        free = rank >= floor                                        # not taken by the safeguard
        hs, ts = np.nonzero(free)
        key = np.lexsort((hs, ts, -s[hs, ts]))                       # best score, then earlier token, lower head
        chosen = hs[key[:rest]]
        counts += np.bincount(chosen, minlength=H)
    return counts


def select_heads(scores: np.ndarray, spec: Spec, heavy: np.ndarray) -> np.ndarray:
    """`select` with a heavy budget per KV head (H,): a ragged kept mask (H, n)."""

    heavy = np.asarray(heavy)
    if (heavy == heavy[0]).all():
        return select(scores, spec if spec.heavy == heavy[0] else spec.with_(heavy=int(heavy[0])))
    out = np.zeros(scores.shape, dtype=bool)
    for v in np.unique(heavy):
        rows = np.flatnonzero(heavy == v)
        out[rows] = select(scores[rows], spec.with_(heavy=int(v)))
    return out


def allocate(scores: np.ndarray, spec: Spec, layer: int, n_layers: int) -> np.ndarray:
    """Kept mask (H, n) of one layer from its scores under the spec's allocation."""

    if spec.allocation == "adakv" and spec.evicts:
        return select_heads(scores, spec, adakv_heavy(scores, spec))
    return select(scores, layer_spec(spec, layer, n_layers))

