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
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n
    k = keys.astype(np.float64)
    lo = np.pad(k, ((0, 0), (0, pad), (0, 0)), constant_values=np.inf).reshape(Hkv, n_pages, page_size, d).min(2)
    hi = np.pad(k, ((0, 0), (0, pad), (0, 0)), constant_values=-np.inf).reshape(Hkv, n_pages, page_size, d).max(2)
    lo, hi = np.repeat(lo, g, axis=0), np.repeat(hi, g, axis=0)            # (Hq, n_pages, d)
    q = query.astype(np.float64)[:, None, :]
    return np.maximum(q * lo, q * hi).sum(-1)


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
