"""The shared bookkeeping behind every eviction policy.

A policy only says how much each cached token matters (`score`). This base turns scores
into kept masks under the budget: the first `sink` tokens, the last `recent` tokens the
query sees (its own included), and the `heavy` highest-scoring tokens among the rest.

When decisions are made (docs/definitions.md):
- at the compression point (right after the context) from what the cache has seen by
  then: the context's own attention rows;
- streaming policies (`streaming = True`) keep deciding at every later step: the new
  token arrives, the cache is trimmed back to the budget by the current scores (a token
  no query has scored yet is not evicted before one has), the query attends over what is
  kept, and its attention updates the scores. An evicted token never comes back.
- one-shot policies keep their compression-time scores; a later kept set is the top of a
  growing candidate set under fixed scores, which is the same as greedy eviction.
Only the oracle (`needs_query = True`) sees the query it is evaluated on.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvviz.attention import context_rows, small_blas, softmax
from kvviz.limits import checkpoint
from kvviz.policies.allocation import allocate
from kvviz.policies.reads import READS, SpecReads
from kvviz.policies.recompress import decoding_masks, prefix_trace
from kvviz.policies.select import evict_one, select  # noqa: F401  (re-exported: policies import them from here)
from kvviz.spec import Spec
from kvviz.trace import Trace


@dataclass(frozen=True)
class ScoreContext:
    """What a policy may look at in one layer at the compression point."""

    trace: Trace
    layer: int
    spec: Spec

    @property
    def n_context(self) -> int:
        return self.trace.context_len

    @property
    def n_positions(self) -> int:
        return self.trace.n_positions

    @cached_property
    def history_rows(self) -> np.ndarray:
        """Context queries (indices) a real cache has seen by the compression point."""
        return self.trace.context_queries

    def history_counts(self) -> np.ndarray:
        """(positions,) how many of the history rows could see each token (queries at positions >= it)."""
        qp = self.trace.query_positions[self.history_rows]
        return len(qp) - np.searchsorted(qp, np.arange(self.n_positions), side="left")

    def context_attention(self, rows: np.ndarray | None = None, heads: np.ndarray | None = None, trim: bool = False):
        """Chunks of (rows, attention (heads, rows, n_context)) of context queries; trim=True: over
        the keys the chunk's rows may see only (heads, rows, m <= n_context), see context_rows."""
        rows = self.history_rows if rows is None else rows
        heads = np.arange(self.trace.n_q_heads) if heads is None else heads
        return context_rows(self.trace, self.layer, heads, rows, self.n_context, trim=trim)

    def per_kv_head(self, per_q_head: np.ndarray) -> np.ndarray:
        """Sum a (q_heads, n) array within each GQA group -> (kv_heads, n)."""
        g = self.trace.group_size
        return per_q_head.reshape(self.trace.n_kv_heads, g, -1).sum(axis=1)


def group_union(reads: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """Per-query-head masks (q_heads, n) -> what each KV head's cache serves (kv_heads, n): their union."""
    return reads.reshape(n_kv_heads, reads.shape[0] // n_kv_heads, -1).any(axis=1)


# (trace id, layer, scorer, key) -> (weak reference to the trace, scores): the cache must not keep a
# trace alive after its owner (an app cache, a sweep) let it go; a dead reference is a miss.
_SCORE_CACHE: OrderedDict = OrderedDict()
_SCORE_CACHE_SIZE = 32


def cached_on_trace(trace: Trace, layer: int, name: str, key: tuple, compute):
    """`compute()`, cached in the score cache per (trace, layer, name, key): statistics a scorer derives
    from a layer of the trace alone (Expected Attention's query mean and covariance, which every horizon
    reuses), and kept sets. The entry holds a weak reference to its trace: an id reused by a new trace
    never hits, and the cache never keeps a trace (often the largest object in the process) alive after
    its owner lets it go."""
    hit = _cache_get(trace, layer, name, key)
    if hit is not None:
        return hit
    value = compute()
    _cache_put(trace, layer, name, key, value)
    return value


def _cache_get(trace: Trace, layer: int, name: str, key: tuple):
    full_key = (id(trace), layer, name, key)
    hit = _SCORE_CACHE.get(full_key)
    if hit is not None and hit[0]() is trace:
        _SCORE_CACHE.move_to_end(full_key)
        return hit[1]
    return None


def _cache_put(trace: Trace, layer: int, name: str, key: tuple, value) -> None:
    _SCORE_CACHE[(id(trace), layer, name, key)] = (weakref.ref(trace), value)
    while len(_SCORE_CACHE) > _SCORE_CACHE_SIZE:
        _SCORE_CACHE.popitem(last=False)


class Policy:
    """Base class: subclasses set `name` and implement `score` (and `update` if streaming)."""

    name: str = ""
    description: str = ""
    streaming: bool = False  # keeps deciding at every later step
    # sees the evaluated query (the oracle bound; Quest reads pages by it)
    needs_query: bool = False
    # needs_query policies: ranks by the query's attention (the oracle), not
    uses_attention: bool = True
    # by its vector and the keys alone (Quest)
    kind: str = "evict"  # "evict": the cache holds only what is kept (saves memory stored);
    # "read": the cache stays whole, each query reads a part (saves memory read)
    paper: str = ""  # the published method
    kvpress: str = ""  # the corresponding NVIDIA kvpress press, if any
    # how menus and charts show it (kvviz.plots.style, kvviz.app.labels read these; a plug-in may leave them)
    # place in the scorer menu (built-ins 10, 20, ...; plug-ins after them)
    order: int = 1000
    title: str = ""  # the method's name on charts and legends (default: `name`)
    short: str = ""  # a compact name for narrow places (default: `title`)
    menu: str = ""  # the scorer menu's line (default: `title`)
    # chart colour (tests/test_colour_vision.py keeps the built-ins apart)
    colour: str = ""
    symbol: str = "circle"  # plotly marker: a method is never told by colour alone
    dash: str = "solid"  # plotly line dash
    chunkable: bool = False  # a one-shot token scorer whose scores ChunkKV can pool per chunk
    # one KV head's scores read only that head's keys and its query group's queries, in the same operations
    # whatever the other heads hold: the engine may score only the heads a view shows
    # (tests/test_head_view.py checks each such scorer against scoring every head)
    head_separable: bool = False
    # heads keep different numbers of tokens by the policy's own rule (a threshold, a per-head kind of budget):
    # the kept sets at the compression point are `compression_kept`'s, and each head's cap after it `head_caps`
    ragged: bool = False
    # scores from a forward pass of the model beyond the prompt's (KVzip's reconstruction): the real-model
    # side runs it and puts the scores in the prompt's trace (kvviz.decode.reconstruct)
    reconstructs: bool = False
    # ranks by position alone (StreamingLLM): a sweep spends its budget on sinks and the recent window, no heavy part
    window_only: bool = False
    # > 0: one of the few methods a comparison opens on (the Trade-offs methods, the needle test, the decode
    # timeline, the eval sweep), in this rank; 0: offered everywhere, shown by default nowhere
    featured: int = 0
    # reads what no cache can know (the query being evaluated): the bound the real methods are measured
    # against, drawn as a thin reference line and left out of Pareto frontiers (the oracle)
    bound: bool = False
    # the eval sweep also offers it under AdaKV's and PyramidKV's allocations (adakv-<name>, pyramid-<name>)
    allocated_in_sweeps: bool = False

    def note(self, spec: Spec, trace: Trace | None = None) -> str | None:
        """What this scorer keeps and why, for the Explorer, where the sliders alone do not say it (a streaming
        policy: that it decides again at every decode step)."""
        return self.streaming_note(spec, trace) if self.streaming else None

    def streaming_note(self, spec: Spec, trace: Trace | None, scored_by: str = "") -> str | None:
        """A streaming policy's note: it decides again at every decode step (`scored_by`: what its scores
        are where the title does not say it); None where the trace has no decode steps."""
        if trace is None or not trace.has_later_queries:
            return None
        return (
            f"{self.title} decides again at every decode step{scored_by}: the new token arrives inside the "
            f"budget, so each query attends over exactly {spec.budget} tokens (sink + recent + heavy), itself "
            "among them."
        )

    def scores_follow_budget(self, spec: Spec) -> bool:
        """Whether the scores change with the budget (SnapKV's automatic window follows the recent window):
        when they do not, kept sets grow with the budget and `solve` can bisect exactly."""
        return False

    def underfill_note(self, spec: Spec, kept: float, declared: float) -> str | None:
        """Why the cache holds fewer tokens (`kept`) than the budget declares, for the memory ledger; None
        when this scorer has nothing to say."""
        return None

    def score(self, ctx: ScoreContext) -> np.ndarray:
        """Importance of every position, shape (kv_heads, positions); higher = keep.

        Context positions are scored at the compression point. Later positions get the
        score they would have on arrival (-inf where the policy cannot score them: they
        then stay only while inside the recent window).
        """
        raise NotImplementedError

    def query_scores(
        self, attention: np.ndarray, ctx: ScoreContext, query: np.ndarray | None = None, keys: np.ndarray | None = None
    ) -> np.ndarray:
        """needs_query policies: scores (kv_heads, n) at one query from its attention (q_heads, n),
        its query vectors (q_heads, head_dim) and the cached keys (kv_heads, n, head_dim)."""
        raise TypeError(f"{self.name} scores at the compression point: use score")

    def query_reads(
        self, attention: np.ndarray, ctx: ScoreContext, query: np.ndarray | None = None, keys: np.ndarray | None = None
    ) -> np.ndarray | None:
        """needs_query policies that choose per query head (Quest as the paper): each query head's own
        read mask (q_heads, n) under the allocation; None where one choice serves a KV head's group."""
        return None

    def query_kept(
        self, attention: np.ndarray, ctx: ScoreContext, query: np.ndarray | None = None, keys: np.ndarray | None = None
    ) -> np.ndarray:
        """needs_query policies: the kept (read) mask (kv_heads, n) at one query, under the allocation;
        where query heads choose their own (query_reads), what the KV head's cache serves: their union."""
        reads = self.query_reads(attention, ctx, query=query, keys=keys)
        if reads is not None:
            return group_union(reads, ctx.trace.n_kv_heads)
        return allocate(
            self.query_scores(attention, ctx, query=query, keys=keys),
            ctx.spec,
            ctx.layer,
            ctx.trace.n_layers,
            ctx.trace.context_len,
        )

    def update(
        self, scores: np.ndarray, attention: np.ndarray, ctx: ScoreContext, seen_counts: np.ndarray | None = None
    ) -> None:
        """Streaming policies: fold one later query's attention (q_heads, m) over the kept tokens
        into their scores (kv_heads, m) in place. seen_counts (kv_heads, m): how many queries
        had seen each kept token before this one."""

    def arrival_score(self, key: np.ndarray, layer: int, position: int, spec: Spec) -> np.ndarray:
        """Score of a token entering the cache after the compression point, per KV head.

        key (kv_heads, head_dim) is its cached key. Streaming policies give +inf (no query
        has scored it yet, so it is not evicted before one has); the default -inf means
        the policy cannot score it and it stays only while inside the recent window.
        """
        return np.full(key.shape[0], np.inf if self.streaming else -np.inf)

    def compression_kept(self, scores: np.ndarray, spec: Spec) -> np.ndarray | None:
        """A kept mask (kv_heads, c) of the context at the compression point by the policy's own rule,
        from its scores (kv_heads, c); None = the shared rule, `select` under the budget."""
        return None

    def head_caps(self, scores: np.ndarray, spec: Spec) -> np.ndarray:
        """Ragged policies: (kv_heads,) the most tokens each head holds after the compression point, from the
        context's scores (kv_heads, c); past its cap a head drops its lowest score outside the sinks and the
        window (`evict_one`), and np.inf keeps every arrival."""
        raise NotImplementedError(f"{self.name} is not ragged")

    def fit_budget(self, spec: Spec, budget: int, n: int) -> Spec:
        """Ragged policies: the spec with the policy's own setting chosen to keep about `budget` of `n`
        prompt tokens per head (a sweep's, a needle grid's or a leaderboard's budget axis); others keep
        their budget as the spec says."""
        return spec

    def fills_budget(self, spec: Spec) -> bool:
        """True when every KV head keeps (reads) exactly min(budget, tokens seen), as `select` does;
        a policy that keeps a number of its own says False (a ragged one always), and memory is counted
        from its masks."""
        return not self.ragged

    def score_key(self, spec: Spec) -> tuple:
        """What else the scores depend on, for a plug-in whose scores read something besides the trace and
        the Spec (an environment variable, a file). The Spec fields a scorer reads need no listing: they
        are found by watching it read them (kvviz.policies.reads)."""
        return ()

    # --- bookkeeping ---------------------------------------------------------------
    def scores_at_compression(self, ctx: ScoreContext) -> np.ndarray:
        """`score(ctx)`, cached per (trace, layer, scorer, the values of the Spec fields the scorer reads):
        a sweep over budgets and bits, or an app rerun, reuses H2O's pass over the whole context. The
        fields are those this scorer has been seen to read (READS); each computation runs on a view of the
        Spec that notes them, and is stored under the fields known once it is done."""
        extra = self.score_key(ctx.spec)
        hit = _cache_get(ctx.trace, ctx.layer, self.name, (READS.key(self.name, ctx.spec), extra))
        if hit is not None:
            return hit
        read: set[str] = set()
        scores = np.asarray(self.score(ScoreContext(ctx.trace, ctx.layer, SpecReads(ctx.spec, read))), dtype=np.float64)
        scores.flags.writeable = False
        READS.note(self.name, read)
        _cache_put(ctx.trace, ctx.layer, self.name, (READS.key(self.name, ctx.spec), extra), scores)
        return scores

    def keep_masks(self, ctx: ScoreContext, positions: np.ndarray) -> np.ndarray:
        """Kept masks at the given evaluated query positions, shape (len, kv_heads, positions), with every
        KV head under the spec's budget (an allocation over heads or layers wraps this:
        `kvviz.policies.allocation`, through `kvviz.rows.keep_masks`)."""
        trace, spec = ctx.trace, ctx.spec
        P, Hkv = trace.n_positions, trace.n_kv_heads
        positions = np.asarray(positions)
        out = np.zeros((len(positions), Hkv, P), dtype=bool)
        if not spec.evicts:
            for i, p in enumerate(positions):
                out[i, :, : p + 1] = True
            return out
        scores = self.scores_at_compression(ctx)
        if scores.shape != (Hkv, P):  # a score shared by every KV head
            scores = np.broadcast_to(scores, (Hkv, P))
        if not self.streaming:
            if spec.compress_every:  # compressed again every N decode steps
                return self._decoding(ctx, spec, scores, positions, out)
            c = trace.context_len
            own = self.compression_kept(scores[:, :c], spec)
            # the policy's own rule at the compression point; each head its own count if ragged
            if own is not None:
                caps = self.head_caps(scores[:, :c], spec) if self.ragged else np.full(Hkv, spec.budget)
                return self._grow(own, caps, scores, spec, c, positions, out)
            # one decision for every head: take it once
            shared = scores.strides[0] == 0 and Hkv > 1
            for i, p in enumerate(positions):
                out[i, :, : p + 1] = select(scores[: 1 if shared else Hkv, : p + 1], spec)
            return out
        with small_blas():  # one query a step: small products
            return self._simulate(ctx, scores.copy(), positions, out)

    def _decoding(
        self, ctx: ScoreContext, spec: Spec, scores: np.ndarray, positions: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        """Kept masks when the cache is compressed again every spec.compress_every decode steps
        (kvviz.policies.recompress): before the prompt's end as compressing once gives them; after it, the
        cache grows and is scored again over what it holds every N steps."""
        c = ctx.trace.context_len
        own = self.compression_kept(scores[:, :c], spec)
        for i, p in enumerate(positions):
            if p < c:
                out[i, :, : p + 1] = own[:, : p + 1] if own is not None else select(scores[:, : p + 1], spec)
        kept_c = own if own is not None else select(scores[:, :c], spec)
        # (H, m): equal per head
        held = np.stack([np.flatnonzero(r) for r in kept_c])
        return decoding_masks(held, c, spec, positions, out, lambda end: self.scores_until(ctx, end))

    def scores_until(self, ctx: ScoreContext, end: int) -> np.ndarray:
        """Scores (kv_heads, end) at a compression point after the query at end - 1: the scorer reads the
        queries and keys of positions 0..end - 1 as a prompt (kvviz.policies.recompress)."""
        sub = ScoreContext(prefix_trace(ctx.trace, ctx.layer, end), ctx.layer, ctx.spec)
        scores = np.asarray(self.score(sub), dtype=np.float64)
        return np.broadcast_to(scores, (ctx.trace.n_kv_heads, end))

    @staticmethod
    def _grow(
        kept_c: np.ndarray,
        caps: np.ndarray,
        scores: np.ndarray,
        spec: Spec,
        c: int,
        positions: np.ndarray,
        out: np.ndarray,
    ) -> np.ndarray:
        """Kept masks after a compression point whose kept set kept_c (H, c) is the policy's own: a
        query before the point sees the part of it up to itself; later tokens join the cache, which
        past a head's cap (H,) drops that head's lowest score outside sinks and window (`evict_one`,
        as the real-model cache's arrivals do)."""
        for i, p in enumerate(positions):
            if p < c:
                out[i, :, : p + 1] = kept_c[:, : p + 1]
        later = sorted((int(p), i) for i, p in enumerate(positions) if p >= c)
        for h in range(kept_c.shape[0]):
            kept = np.flatnonzero(kept_c[h])[None, :]  # (1, m_h)
            p = c
            for target, i in later:
                while p <= target:
                    kept = np.append(kept, [[p]], axis=1)
                    if kept.shape[1] > caps[h]:
                        kept = evict_one(kept, scores[h : h + 1], spec, p)
                    p += 1
                out[i, h, kept[0]] = True
        return out

    def _simulate(self, ctx: ScoreContext, scores: np.ndarray, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Run a streaming policy step by step from the compression point.

        The cache is held as kept positions per KV head, `kept` (kv_heads, m): every head
        keeps the same number of tokens, so it stays rectangular. Each step's attention
        is computed over the kept keys only, as a real compressed cache would.
        """
        trace, spec, layer = ctx.trace, ctx.spec, ctx.layer
        c, Hkv, g = trace.context_len, trace.n_kv_heads, trace.group_size
        kept = np.nonzero(select(scores[:, :c], spec))[1].reshape(Hkv, -1)  # (Hkv, m)
        scores[:, c:] = np.inf  # nothing has scored a token that has not arrived
        # queries that saw each token
        seen_counts = ctx.history_counts().astype(np.float64)
        want = {int(p): i for i, p in enumerate(positions)}
        for i, p in enumerate(positions):  # queries evaluated at the compression point
            if p < c:
                np.put_along_axis(out[i], kept[kept <= p].reshape(Hkv, -1), True, axis=1)
        query_at = {int(trace.query_positions[qi]): int(qi) for qi in trace.later_queries}
        inv_sqrt_d = 1.0 / np.sqrt(trace.head_dim)
        for p in range(c, int(positions.max()) + 1 if len(positions) else c):
            checkpoint()
            # the new token arrives
            kept = np.concatenate([kept, np.full((Hkv, 1), p)], axis=1)
            if kept.shape[1] > spec.budget:  # evict one per head
                kept = evict_one(kept, scores, spec, p)
            if p in want:
                np.put_along_axis(out[want[p]], kept, True, axis=1)
            qi = query_at.get(p)
            if qi is None:
                continue
            kept_q = np.repeat(kept, g, axis=0)  # (Hq, m)
            if trace.logits is not None:
                logits = np.take_along_axis(trace.logits[layer, :, qi].astype(np.float64), kept_q, axis=1)
            else:
                q = trace.q[layer, :, qi].reshape(Hkv, g, -1)  # (Hkv, g, D)
                # (Hkv, m, D), row gathers
                k = trace.k[layer][np.arange(Hkv)[:, None], kept]
                logits = np.swapaxes(np.matmul(k, np.swapaxes(q, 1, 2)), 1, 2)  # (Hkv, g, m)
                logits = logits.reshape(-1, kept.shape[1]).astype(np.float64)
                logits *= inv_sqrt_d  # (Hq, m)
            attn = softmax(logits)
            seen = np.take_along_axis(scores, kept, axis=1)  # (Hkv, m)
            seen[np.isposinf(seen)] = 0.0  # arrivals have now been seen by a query
            self.update(seen, attn, ctx, seen_counts[kept])
            np.put_along_axis(scores, kept, seen, axis=1)
            seen_counts[: p + 1] += 1
        return out
