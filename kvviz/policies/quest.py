"""Quest (Tang et al. 2024): query-aware page reads; the cache stays whole.

A different kind of method: nothing is evicted. The cache is cut into pages of
`Spec.page_size` tokens from position 0 (Quest: 16); each page keeps, per channel, the
minimum m and maximum M of its keys. A query q bounds the logit any key of the page can
reach by
    U(page) = sum_d max(q_d m_d, q_d M_d)  >=  q . k  for every key k of the page,
and reads only its top pages by U (plus the sinks and the recent window), ranked per KV
head by the largest bound among the query heads of its group. Every token of a page carries
the page's bound, so the heavy budget reads whole pages, best first. What it saves is memory
*read* per step (the kept mask is what this query reads), not memory stored: the whole cache
plus the per-page min / max keys stay in memory. Reading every page is exact.
(No kvpress press corresponds: kvpress presses evict; Quest is a sparse-attention read.)
"""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext


def page_bounds(query: np.ndarray, keys: np.ndarray, page_size: int) -> np.ndarray:
    """Upper bound of q . k per page: query (Hq, d), keys (Hkv, n, d) -> (Hq, n_pages)."""
    Hkv, n, d = keys.shape
    g = query.shape[0] // Hkv
    full = n - n % page_size
    # min / max are exact in the keys' own precision: no float64 copy, no padded copy
    pages = keys[:, :full].reshape(Hkv, -1, page_size, d)
    lo, hi = pages.min(axis=2), pages.max(axis=2)                          # (Hkv, full pages, d)
    if full < n:                                                           # the last, shorter page
        lo = np.concatenate([lo, keys[:, full:].min(axis=1, keepdims=True)], axis=1)
        hi = np.concatenate([hi, keys[:, full:].max(axis=1, keepdims=True)], axis=1)
    lo, hi = lo.astype(np.float64)[:, None], hi.astype(np.float64)[:, None]   # (Hkv, 1, n_pages, d)
    q = query.astype(np.float64).reshape(Hkv, g, 1, d)                     # broadcast over the group
    return np.maximum(q * lo, q * hi).sum(-1).reshape(Hkv * g, -1)


class Quest(Policy):
    name = "quest"
    description = ("reads, for each query, its top pages by an upper bound of q·k from per-page min / max keys; "
                   "the cache stays whole — saves memory read per step, not memory stored")
    paper = "Tang et al. 2024, Quest: query-aware sparsity for efficient long-context LLM inference"
    kvpress = "none (a sparse read, not an eviction; kvpress presses evict)"
    needs_query = True
    kind = "read"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        raise TypeError("Quest picks pages per query: use query_scores")

    def query_scores(self, attention, ctx: ScoreContext, query=None, keys=None) -> np.ndarray:
        if query is None or keys is None:
            raise TypeError("Quest needs the query vectors and the cached keys")
        size = ctx.spec.page_size
        Hkv, n, _ = keys.shape
        bound = page_bounds(query, keys, size)                              # (Hq, n_pages)
        per_kv = bound.reshape(Hkv, -1, bound.shape[1]).max(axis=1)         # (Hkv, n_pages)
        return np.repeat(per_kv, size, axis=1)[:, :n]
