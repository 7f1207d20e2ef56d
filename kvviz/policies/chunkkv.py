"""ChunkKV (Liu et al. 2025): score chunks of C consecutive tokens and keep them whole.

A token scorer (`Spec.chunk_scorer`, default SnapKV's votes; any `chunkable` scorer) scores every context token;
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
    budget  (a budget-exact variant, not kvpress's) every token carries its chunk's score and the
            heavy budget fills whole chunks, best first, beside the sinks and window (a budget that
            is not a multiple of C ends with the first tokens of one more chunk).
"""

import numpy as np

from kvviz.policies.allocation import kvpress_kept
from kvviz.policies.base import Policy, ScoreContext
from kvviz.settings import LABELS, Setting, declare


def inner_scorers() -> tuple[str, ...]:
    """The token scorers a chunk can pool: the one-shot scorers that say they can (`Policy.chunkable`).
    Looked up when asked: the registry that lists them lists ChunkKV too."""
    from kvviz.policies.registry import POLICIES

    return tuple(name for name, p in POLICIES.items() if p.chunkable)


declare(
    Setting(
        "chunk_size",
        "int",
        20,
        1,
        4096,
        url="chunk",
        owner=("scorer", "chunkkv"),
        label="ChunkKV chunk size (tokens)",
        help="ChunkKV: tokens per chunk (kvpress chunk_length 20).",
    ),
    Setting(
        "chunk_scorer",
        "choice",
        "snapkv",
        choices=inner_scorers,
        owner=("scorer", "chunkkv"),
        label="ChunkKV token scorer",
        help="ChunkKV: the token scorer whose scores are pooled per chunk.",
    ),
    Setting(
        "chunk_rule",
        "choice",
        "chunks",
        choices=("chunks", "budget"),
        owner=("scorer", "chunkkv"),
        label="ChunkKV keeps",
        option_labels={"chunks": "whole chunks (kvpress)", "budget": "chunks filling the budget"},
        help="ChunkKV: chunks = kvpress's count of whole chunks (the cache may hold fewer tokens than the "
        "budget); budget = chunks fill the heavy budget exactly, beside sinks and window (not kvpress's rule)",
    ),
)
LABELS["chunkkv"] = lambda spec: f"chunkkv ({spec.chunk_scorer}, chunks of {spec.chunk_size})"


def chunk_scores(token_scores: np.ndarray, c: int, size: int) -> np.ndarray:
    """(c,) each context token's chunk score from token scores (kv_heads, >= c)."""
    summed = np.asarray(token_scores, dtype=np.float64)[:, :c].sum(axis=0)  # over KV heads
    # whole chunks: one mean per row of a reshape
    full = c - c % size
    # (the same pairwise sums as a mean per slice)
    means = summed[:full].reshape(-1, size).mean(axis=1)
    out = np.empty(c)
    out[:full] = np.repeat(means, size)
    if full < c:  # the last, shorter chunk
        out[full:] = summed[full:].mean()
    return out


class ChunkKV(Policy):
    name = "chunkkv"
    order = 100
    title = "ChunkKV"
    menu = "ChunkKV (whole chunks of C tokens)"
    colour = "#CC79A7"
    symbol = "hourglass"
    dash = "12px,4px"
    description = (
        "whole chunks of C tokens, ranked by the mean score of their tokens (an inner scorer, "
        "SnapKV's votes by default) summed over heads; one decision for every head"
    )
    paper = (
        "Liu et al. 2025, ChunkKV: semantic-preserving KV cache compression for efficient long-context LLM inference"
    )
    kvpress = "ChunkKVPress(press=SnapKVPress(...), chunk_length=20)"

    def note(self, spec, trace=None) -> str | None:
        return (
            f"ChunkKV: chunks of {spec.chunk_size} tokens, ranked by the mean {spec.chunk_scorer} score of "
            "their tokens summed over heads, are kept whole (one decision for every head)"
            + (
                "; as kvpress, it keeps as many whole chunks as the budget's share of the chunks, so the cache "
                "can hold fewer tokens than the budget (the memory card counts what it holds)."
                if spec.chunk_rule == "chunks"
                else ", filling the heavy budget."
            )
        )

    def fills_budget(self, spec) -> bool:
        return spec.chunk_rule == "budget"

    def underfill_note(self, spec, kept: float, declared: float) -> str | None:
        if spec.chunk_rule != "chunks":
            return None
        return (
            f"ChunkKV keeps whole chunks of {spec.chunk_size}, as many as kvpress's ChunkKVPress does at "
            f"this budget: {kept:.0f} of the {declared:.0f} declared token slots hold tokens; bytes count "
            "what is held"
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        from kvviz.policies.registry import get_policy

        inner = get_policy(ctx.spec.chunk_scorer)
        c = ctx.n_context
        token = np.broadcast_to(inner.scores_at_compression(ctx), (ctx.trace.n_kv_heads, ctx.n_positions))[:, :c]
        # kvpress pads what the inner press leaves unranked with max + 1
        if ctx.spec.chunk_rule == "chunks":
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
        # kvpress: no whole chunk -> the inner press's rule
        if spec.chunk_rule != "chunks" or c < size:
            return None
        n_chunks = -(-c // size)
        keep = max(1, int(n_chunks * (kvpress_kept(spec.budget) / c)))
        # every token carries its chunk's score
        per_chunk = scores[0, ::size]
        best = np.argsort(-per_chunk, kind="stable")[:keep]  # ties: the earlier chunk
        mask = np.zeros(c, dtype=bool)
        for i in best:
            mask[i * size : (i + 1) * size] = True
        return np.broadcast_to(mask, (H, c))
