"""ChunkKV (Liu et al. 2025): score chunks of C consecutive tokens and keep them whole.

A token scorer (`Spec.chunk_scorer`, default SnapKV's votes) scores every context token;
the context is cut into chunks of `Spec.chunk_size` tokens from position 0 (kvpress
chunk_length = 20; the last chunk may be shorter), and a chunk's score is the mean over its
tokens of the token scores summed over the KV heads — one decision shared by every head,
as kvpress's ChunkKVPress takes it. Every token carries its chunk's score, so the heavy
budget fills whole chunks, best first (a budget that is not a multiple of C ends with the
first tokens of one more chunk; chunks cut by the sinks or the window compete with what is
left of them). A chunk with a token the inner scorer cannot rank (SnapKV's observation
window) scores -inf: it lies in the recent window, which is kept anyway.
"""

import numpy as np

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

    def score_key(self, spec):
        return (spec.chunk_size, spec.chunk_scorer) + INNER[spec.chunk_scorer].score_key(spec)

    def score(self, ctx: ScoreContext) -> np.ndarray:
        inner = INNER[ctx.spec.chunk_scorer]
        c = ctx.n_context
        token = np.broadcast_to(inner.scores_at_compression(ctx), (ctx.trace.n_kv_heads, ctx.n_positions))
        scores = np.full(ctx.n_positions, -np.inf)
        scores[:c] = chunk_scores(token, c, ctx.spec.chunk_size)
        return np.broadcast_to(scores, (ctx.trace.n_kv_heads, ctx.n_positions))
