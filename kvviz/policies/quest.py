"""Quest (Tang et al. 2024): query-aware page reads; the cache stays whole.

A different kind of method: nothing is evicted. The cache is cut into pages of
`Spec.page_size` tokens from position 0 (Quest: 16); each page keeps, per channel, the
minimum m and maximum M of its keys. A query q bounds the logit any key of the page can
reach by
    U(page) = sum_d max(q_d m_d, q_d M_d)  >=  q . k  for every key k of the page,
and reads only its top pages by U (plus the sinks and the recent window). As the paper does,
each query head ranks the pages by its own bound and reads its own top pages
(`Spec.quest_heads="query"`); with GQA, a KV head's cache serves the union of what its query
heads read, and that union is what the ledger and memory card count as bytes read (a page is
read once per step however many of the group's heads chose it). `quest_heads="kv"` (coarser than
the paper): one choice per KV head by the largest bound among its query heads. Every token of
a page carries the page's bound, so the heavy budget reads whole pages, best first. What it
saves is memory *read* per step, not memory stored: the whole cache plus the per-page min / max
keys stay in memory. Reading every page is exact.
(No kvpress press corresponds: kvpress presses evict; Quest is a sparse-attention read.)
"""

import numpy as np

from kvviz.policies.allocation import allocate
from kvviz.policies.base import Policy, ScoreContext
from kvviz.settings import LABELS, Setting, declare, rule
from kvviz.spec import SpecError

declare(
    Setting(
        "page_size",
        "int",
        16,
        1,
        4096,
        url="page",
        owner=("scorer", "quest"),
        label="Quest page size (tokens)",
        help="Quest: tokens per page (Quest's default is 16).",
    ),
    Setting(
        "quest_heads",
        "choice",
        "query",
        choices=("query", "kv"),
        owner=("scorer", "quest"),
        label="Quest reads pages per",
        option_labels={"query": "query head (the paper)", "kv": "KV head"},
        help="query = each query head reads its own top pages (the paper); kv = one page choice per KV head "
        "by its group's largest bound (coarser than the paper: the whole group reads the same "
        "pages)",
    ),
)
LABELS["quest"] = lambda spec: f"quest (pages of {spec.page_size}, cache kept whole)"


@rule
def _equal_lengths(spec) -> None:
    if (
        spec.scorer == "quest"
        and spec.quest_heads == "query"
        and spec.evicts
        and spec.quantizes
        and spec.quant_model == "kv"
        and (
            spec.key_format != "int"
            or spec.value_format != "int"
            or spec.rotate != "none"
            or spec.residual_mode != "kivi"
        )
    ):
        raise SpecError(
            "Quest per query head reads a different number of tokens through each KV head; the FP8 / "
            "FP4 formats, rotation and HF's residual flush quantize a layer's heads together and need "
            "equal lengths. Use the integer format, or Quest per KV head (quest_heads 'kv')"
        )


def page_bounds(query: np.ndarray, keys: np.ndarray, page_size: int) -> np.ndarray:
    """Upper bound of q . k per page: query (Hq, d), keys (Hkv, n, d) -> (Hq, n_pages)."""
    Hkv, n, d = keys.shape
    g = query.shape[0] // Hkv
    full = n - n % page_size
    # per-page min / max: exact in the keys' own precision (no float64 or padded copy), as
    # page_size elementwise passes (a reduction over a middle axis is several times slower)
    pages = keys[:, :full].reshape(Hkv, -1, page_size, d)
    lo, hi = pages[:, :, 0].copy(), pages[:, :, 0].copy()  # (Hkv, full pages, d)
    for j in range(1, page_size):
        np.minimum(lo, pages[:, :, j], out=lo)
        np.maximum(hi, pages[:, :, j], out=hi)
    if full < n:  # the last, shorter page
        lo = np.concatenate([lo, keys[:, full:].min(axis=1, keepdims=True)], axis=1)
        hi = np.concatenate([hi, keys[:, full:].max(axis=1, keepdims=True)], axis=1)
    # max(q_d m_d, q_d M_d) is q_d M_d where q_d >= 0 and q_d m_d where q_d < 0 (M_d >= m_d), so
    # the bound is M . q+ + m . q-: two BLAS products per KV group, the group's heads at once.
    q = query.astype(np.float64).reshape(Hkv, g, d)
    q_pos, q_neg = np.maximum(q, 0.0), np.minimum(q, 0.0)
    bound = np.matmul(hi.astype(np.float64), np.swapaxes(q_pos, 1, 2))  # (Hkv, n_pages, g)
    bound += np.matmul(lo.astype(np.float64), np.swapaxes(q_neg, 1, 2))
    return np.swapaxes(bound, 1, 2).reshape(Hkv * g, -1)


class Quest(Policy):
    name = "quest"
    order = 110
    title = "Quest"
    short = "Quest (reads)"
    menu = "Quest (reads top pages per query; stores everything)"
    colour = "#1A85FF"
    symbol = "triangle-left"
    dash = "4px,4px,1px,4px,1px,4px"
    description = (
        "reads, for each query, its top pages by an upper bound of q·k from per-page min / max keys; "
        "the cache stays whole — saves memory read per step, not memory stored"
    )
    paper = "Tang et al. 2024, Quest: query-aware sparsity for efficient long-context LLM inference"
    kvpress = "none (a sparse read, not an eviction; kvpress presses evict)"
    needs_query = True
    # the page bounds read the query vector and the keys, not the attention
    uses_attention = False
    kind = "read"

    def note(self, spec, trace=None) -> str | None:
        return (
            f"Quest keeps the whole cache plus each page's min / max keys (pages of {spec.page_size}); this "
            "query reads only its top pages by the bound q·k ≤ Σ max(q·min, q·max)"
            + (
                ", each query head its own (a KV head serves the union of its heads' pages)"
                if spec.quest_heads == "query"
                else ", one choice per KV head"
            )
            + ", so it saves memory read per step, not memory stored (the memory card counts what is stored)."
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        raise TypeError("Quest picks pages per query: use query_scores")

    def fills_budget(self, spec) -> bool:
        # per query head: a KV head serves the union of its group's pages
        return spec.quest_heads == "kv"

    def query_scores(self, attention, ctx: ScoreContext, query=None, keys=None) -> np.ndarray:
        """Per KV head (quest_heads "kv"): each page's largest bound over the group's query heads, (Hkv, n)."""
        bound, size, n = self._bounds(query, keys, ctx)
        Hkv = keys.shape[0]
        per_kv = bound.reshape(Hkv, -1, bound.shape[1]).max(axis=1)  # (Hkv, n_pages)
        return np.repeat(per_kv, size, axis=1)[:, :n]

    def query_reads(self, attention, ctx: ScoreContext, query=None, keys=None) -> np.ndarray | None:
        """Per query head (quest_heads "query", the paper): each head's own top pages, (Hq, n) bool."""
        if ctx.spec.quest_heads != "query":
            return None
        bound, size, n = self._bounds(query, keys, ctx)
        # (Hq, n): each head's own bound
        scores = np.repeat(bound, size, axis=1)[:, :n]
        return allocate(scores, ctx.spec, ctx.layer, ctx.trace.n_layers, ctx.trace.context_len)

    @staticmethod
    def _bounds(query, keys, ctx: ScoreContext):
        if query is None or keys is None:
            raise TypeError("Quest needs the query vectors and the cached keys")
        return page_bounds(query, keys, ctx.spec.page_size), ctx.spec.page_size, keys.shape[1]
