"""ChunkKV (Liu et al. 2025): score chunks of C consecutive tokens and keep them whole.

A token scorer (`Spec.chunk_scorer`, default SnapKV's votes) scores every context token;
the context is cut into chunks of `Spec.chunk_size` tokens from position 0 (kvpress
chunk_length = 20; the last chunk may be shorter), and a chunk's score is the mean over its
tokens of the token scores summed over the KV heads — one decision shared by every head,
as kvpress's ChunkKVPress takes it. A context token the inner scorer leaves unranked
(SnapKV's observation window) scores max + 1, as kvpress pads it, so a chunk that straddles
the window ranks high.

Which chunks are kept (`Spec.chunk_rule`):
    chunks  (default, kvpress) the top max(1, floor(n_chunks * A / n)) chunks whole, A = kvviz's
            budget as kvpress's unrounded n(1 - ratio) (`allocation.kvpress_kept`), and nothing
            else: no separate sinks or window (they are kept where their chunks are). The cache
            then holds fewer tokens than the budget (whole chunks; the short last chunk), and the
            memory card and ledger count what it holds. Tokens that arrive later join the cache
            until it reaches the budget; past it, the lowest-scored token outside the sinks and
            window goes (an arrival has no chunk score: it stays while in the window).
    budget  (kvviz before #24) every token carries its chunk's score and the heavy budget fills
            whole chunks, best first, beside the sinks and window (a budget that is not a
            multiple of C ends with the first tokens of one more chunk).
"""

import numpy as np

from kvviz.policies.allocation import kvpress_kept
from kvviz.policies.base import Policy, ScoreContext
from kvviz.policies.expected_attention import ExpectedAttention
from kvviz.policies.h2o import H2O
from kvviz.policies.keydiff import KeyDiff
from kvviz.policies.knorm import KNorm
from kvviz.policies.random import Random
from kvviz.policies.snapkv import SnapKV

# The token scorers a chunk can pool (spec.CHUNK_INNER), named here rather than looked up in the
# registry, which lists ChunkKV itself (a wrapper that asked the registry would close a circle).
INNER = {p.name: p for p in (SnapKV(), ExpectedAttention(), KeyDiff(), KNorm(), H2O(), Random())}


def chunk_scores(token_scores: np.ndarray, c: int, size: int) -> np.ndarray:
    """(c,) each context token's chunk score from token scores (kv_heads, >= c)."""
    summed = np.asarray(token_scores, dtype=np.float64)[:, :c].sum(axis=0)      # over KV heads
    full = c - c % size                                     # whole chunks: one mean per row of a reshape
    means = summed[:full].reshape(-1, size).mean(axis=1)    # (the same pairwise sums as a mean per slice)
    out = np.empty(c)
    out[:full] = np.repeat(means, size)
    if full < c:                                            # the last, shorter chunk
        out[full:] = summed[full:].mean()
    return out


class ChunkKV(Policy):
    name = "chunkkv"
    description = ("whole chunks of C tokens, ranked by the mean score of their tokens (an inner scorer, "
                   "SnapKV's votes by default) summed over heads; one decision for every head")
    paper = "Liu et al. 2025, ChunkKV: semantic-preserving KV cache compression for efficient long-context LLM inference"
    kvpress = "ChunkKVPress(press=SnapKVPress(...), chunk_length=20)"

    def fills_budget(self, spec) -> bool:
        return spec.chunk_rule == "budget"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        inner = INNER[ctx.spec.chunk_scorer]
        c = ctx.n_context
        token = np.broadcast_to(inner.scores_at_compression(ctx), (ctx.trace.n_kv_heads, ctx.n_positions))[:, :c]
        if ctx.spec.chunk_rule == "chunks":   # kvpress pads what the inner press leaves unranked with max + 1
            ranked = np.isfinite(token)
            if not ranked.all():
                token = np.where(ranked, token, (token[ranked].max() if ranked.any() else 0.0) + 1.0)
        scores = np.full(ctx.n_positions, -np.inf)
        scores[:c] = chunk_scores(token, c, ctx.spec.chunk_size)
        return np.broadcast_to(scores, (ctx.trace.n_kv_heads, ctx.n_positions))

    def compression_kept(self, scores: np.ndarray, spec) -> np.ndarray | None:
        """kvpress's rule (chunk_rule "chunks"): the top whole chunks of the context, (H, c) bool."""
        H, c = scores.shape
        size = spec.chunk_size
        if spec.chunk_rule != "chunks" or c < size:    # kvpress: no whole chunk -> the inner press's rule
            return None
        n_chunks = -(-c // size)
        keep = max(1, int(n_chunks * (kvpress_kept(spec.budget) / c)))
        per_chunk = scores[0, ::size]                                   # every token carries its chunk's score
        best = np.argsort(-per_chunk, kind="stable")[:keep]            # ties: the earlier chunk
        mask = np.zeros(c, dtype=bool)
        for i in best:
            mask[i * size: (i + 1) * size] = True
        return np.broadcast_to(mask, (H, c))
