"""One evaluated attention row: what the cache keeps at a query, and that query's original vs
compressed attention for several query heads at once.

    original    a     = softmax(q . K^T / sqrt(d))               over tokens 0..p
    compressed  a_hat = softmax over the kept tokens of q . K_hat^T / sqrt(d)
                        (K_hat: kept keys, quantized; or logits + sigma * eps)
    outputs     o = a . V,  o_hat = a_hat . V_hat               (where values exist)

Eviction decides what is kept (`keep_masks`: per KV head, at the time the policy would), then what is
kept is quantized (`_quantized_kept`), as a real compressed cache would be. A policy that reads instead of
evicting (Quest) stores the whole cache, quantized as stored, and each query head reads its own pages of
it. kvviz.engine builds a view's rows and their ensemble from these.

A sliding-window layer (Trace.layer_windows) is left as the model runs it, as kvpress's presses skip
sliding layers: its cache is the window the model keeps (the last W tokens, at full precision), so its
compressed attention is its original, and what it keeps is the window (`window_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvviz.attention import kv_runs, logit_rows, softmax, softmax_and_log, window_masks, window_start
from kvviz.metrics import RowMetrics, divergences, row_metrics_batch
from kvviz.policies import ScoreContext, get_policy
from kvviz.policies.allocation import allocation_for
from kvviz.policies.base import cached_on_trace, group_union
from kvviz.policies.merging import merged_values
from kvviz.quant.kept import stored_kept
from kvviz.spec import Spec
from kvviz.trace import Trace

# Why each token is in (or out of) the compressed cache, for colouring charts.
EVICTED, SINK, RECENT, HEAVY, ALL = 0, 1, 2, 3, 4
REASONS = {EVICTED: "evicted", SINK: "sink", RECENT: "recent", HEAVY: "heavy hitter", ALL: "kept (no eviction)"}
UNCOMPRESSED = Spec()  # what a sliding-window layer runs under, whatever the spec


@dataclass(frozen=True, eq=False, slots=True)  # slots: a configuration builds one per member
class RowResult:
    """One evaluated attention row: layer, query head, query position."""

    layer: int
    head: int
    kv_head: int
    query: int  # index into trace.query_positions
    position: int  # the query's token position p; the row covers tokens 0..p
    original: np.ndarray
    compressed: np.ndarray
    kept: np.ndarray
    reason: np.ndarray
    error: np.ndarray  # per-token error: compressed minus original attention
    out_original: np.ndarray | None
    out_compressed: np.ndarray | None
    metrics: RowMetrics


def reasons_for(kept: np.ndarray, spec: Spec) -> np.ndarray:
    """Why each token is kept or not, for kept masks (..., n)."""
    n = kept.shape[-1]
    if not spec.evicts:
        return np.full(kept.shape, ALL, dtype=np.int8)
    reason = kept * np.int8(HEAVY)  # EVICTED is 0
    reason[..., max(0, n - spec.recent) :] = RECENT
    reason[..., : min(spec.sink, n)] = SINK
    return reason


def noise_eps(trace: Trace, spec: Spec, layer: int, head: int, position: int) -> np.ndarray:
    """Standard normals for the noise model; the source's own draw where it has one."""
    if trace.noise_eps is not None and spec.seed == 0:
        return trace.noise_eps[: position + 1]
    return np.random.default_rng([spec.seed, layer, head, position]).standard_normal(position + 1)


@dataclass(frozen=True)
class _Batch:
    """One batch of rows: query heads `heads` (H,) of one layer at query qi (position p, n = p + 1 tokens),
    each attending over its m kept tokens `at` (H, m); `flat` indexes those into the (H, n) rows."""

    trace: Trace
    spec: Spec
    layer: int
    qi: int
    p: int
    heads: np.ndarray  # (H,)
    kv_list: list[int]  # each row's KV head
    runs: list  # (KV head, slice of rows) for the runs of rows sharing a KV head
    at: np.ndarray  # (H, m)
    reads: np.ndarray | None  # Quest: each query head's own reads (q_heads, positions)

    @property
    def n(self) -> int:
        return self.p + 1

    @property
    def flat(self) -> np.ndarray:
        H, m = self.at.shape
        return (self.at + (np.arange(H) * self.n)[:, None]).ravel()


@dataclass(frozen=True)
class _Stored:
    """What the cache stores of the kept tokens: per KV head (K_hat - K, V_hat), None where not quantized;
    for Quest the whole cache, each row reading its own tokens of it."""

    by_kv: dict
    whole: bool

    def part(self, batch: _Batch, i: int, g: int, which: int) -> np.ndarray | None:
        """Row i's (K_hat - K) (which 0) or V_hat (1) at its kept tokens, (m, D); None: not quantized."""
        part = self.by_kv[g][which]
        return part if not self.whole or part is None else part[batch.at[i]]


def evaluate_rows(
    trace: Trace,
    spec: Spec,
    layer: int,
    heads,
    qi: int,
    kept_kv: np.ndarray | None,
    cache: dict | None = None,
    reads: np.ndarray | None = None,
) -> list[RowResult]:
    """Original vs compressed attention of one query for several query heads, batched.

    kept_kv (kv_heads, positions) is the policy's kept mask at this query (None for the
    oracle and Quest, which decide from this query, and without eviction). `cache`
    shares the quantized kept keys / values between calls. reads (q_heads, positions):
    Quest's per-query-head reads where already decided (with kept_kv their union).
    """
    cache = {} if cache is None else cache
    heads = np.asarray(heads, dtype=int)
    p = int(trace.query_positions[qi])
    n = p + 1
    sliding = trace.layer_windows[layer] is not None
    if sliding:  # the model keeps its window there, at full precision: no policy, no quantizer
        spec, reads, kept_kv = UNCOMPRESSED, None, window_masks(trace, layer, [p])[0]
    logits = logit_rows(trace, layer, heads, qi)  # (H, n), -inf before a sliding layer's window
    original, log_original = softmax_and_log(logits)
    # the oracle / Quest decide at this query (reads: Quest per query head, each row its own tokens, (Hq, n))
    if kept_kv is None and spec.evicts:
        reads, kept_kv = _query_kept(trace, spec, layer, qi, heads, original)
    if kept_kv is None:
        kept_kv = np.ones((trace.n_kv_heads, n), bool)

    # One cache per KV head: its rows share the kept tokens, the values and the quantized
    # K / V. Callers order heads by KV head, so each run of rows is one product.
    kv_list = (heads // trace.group_size).tolist()
    runs = kv_runs(kv_list)
    # what each row attends over: its KV head's kept tokens (decided once per KV head), or its own reads
    kept_at, rows_at = _row_tokens(heads, kv_list, kept_kv, reads, n)
    if len({len(a) for a in rows_at}) > 1:  # ragged caches (AdaKV): one head at a time
        groups = [[h] for h in heads.tolist()] if reads is not None else [heads[rows] for _, rows in runs]
        return [row for group in groups for row in evaluate_rows(trace, spec, layer, group, qi, kept_kv, cache, reads)]
    batch = _Batch(trace, spec, layer, qi, p, heads, kv_list, runs, np.array(rows_at), reads)
    # (kv_heads, P, D), the trace's dtype: the model's values, and those the cache holds (merged: Spec.merge)
    own_values, values = held_values(trace, spec, layer, p, kept_kv, cache)
    # evict, then quantize what is kept: per KV head, over its compacted cache (Quest: the whole cache)
    stored = _Stored(
        stored_kept(trace, spec, layer, p, kept_at, cache, values, kept_kv if reads is None else None),
        reads is not None,
    )
    # over the kept tokens only
    p_kept, logp_kept = softmax_and_log(_kept_logits(batch, logits, stored))
    compressed = np.zeros_like(original)
    compressed.ravel()[batch.flat] = p_kept.ravel()
    out, out_hat = _outputs(batch, original, compressed, p_kept, own_values, values, stored)
    error = compressed - original
    metrics = _metrics(batch, original, log_original, error, p_kept, logp_kept, out, out_hat)
    return _results(batch, kept_kv, sliding, original, compressed, error, out, out_hat, metrics)


def _metrics(batch: _Batch, original, log_original, error, p_kept, logp_kept, out, out_hat) -> list:
    """Each row's metrics (kvviz.metrics): the error, the mass kept, the divergences, the outputs' error and
    what quantization adds (compressed vs eviction alone: a / mass on the kept tokens)."""
    flat, m = batch.flat, batch.at.shape[1]
    original_kept = original.take(flat).reshape(-1, m)
    mass = original_kept.sum(axis=1)
    # evicted: a token the query sees (a sliding layer's window) is not kept
    seen = batch.n - window_start(batch.p, batch.trace.layer_windows[batch.layer])
    log_kept = log_original.take(flat).reshape(-1, m)
    divergence = divergences(original_kept, log_kept, p_kept, logp_kept, mass, evicted=m < seen)
    tv_quant = None
    if batch.spec.quantizes:
        tv_quant = 0.5 * np.abs(p_kept - original_kept / mass[:, None]).sum(axis=1)
    return row_metrics_batch(error, mass, *divergence, out, out_hat, tv_quant)


def _row_tokens(heads, kv_list: list[int], kept_kv: np.ndarray, reads, n: int) -> tuple[dict, list]:
    """(KV head -> the tokens its cache stores, each row's tokens it attends over): a KV head's kept tokens,
    shared by its rows; Quest stores the whole cache and each row reads its own."""
    if reads is None:
        kept_at = {g: np.flatnonzero(kept_kv[g, :n]) for g in set(kv_list)}
        return kept_at, [kept_at[g] for g in kv_list]
    kept_at = {g: np.arange(n) for g in set(kv_list)}
    return kept_at, [np.flatnonzero(reads[h, :n]) for h in heads.tolist()]


def _kept_logits(batch: _Batch, logits: np.ndarray, stored: _Stored) -> np.ndarray:
    """(H, m) the compressed logits at the kept tokens: q . K_hat / sqrt(d), or the logits plus the noise
    model's sigma * eps."""
    trace, spec, H, m = batch.trace, batch.spec, *batch.at.shape
    kept_logits = logits.take(batch.flat).reshape(H, m)
    if spec.quant_model == "noise":
        eps = np.stack([noise_eps(trace, spec, batch.layer, h, batch.p) for h in batch.heads])
        kept_logits += eps.take(batch.flat).reshape(H, m) * spec.noise_sigma
    elif spec.quantizes_keys:
        # q . K_hat = q . K + q . (K_hat - K): exact logits wherever keys did not change
        # (H, D), the trace's dtype
        q = trace.q[batch.layer, batch.heads, batch.qi] / np.float32(np.sqrt(trace.head_dim))
        if not stored.whole:
            # (K_hat - K).q^T: for a few query rows BLAS is ~2x faster this way round
            for g, rows in batch.runs:
                kept_logits[rows] += (stored.by_kv[g][0] @ q[rows].T).T
        else:
            for i, g in enumerate(batch.kv_list):
                kept_logits[i] += stored.part(batch, i, g, 0) @ q[i]
    return kept_logits


def _outputs(batch, original, compressed, p_kept, own_values, values, stored):
    """(o, o_hat), each (H, D): o = a . V with the model's values, o_hat = a_hat . V_hat with the values
    the cache holds at the kept tokens (quantized, merged); (None, None) without values."""
    if values is None:
        return None, None
    n, m = batch.n, batch.at.shape[1]
    out = np.empty((len(batch.heads), batch.trace.head_dim))
    out_hat = np.empty_like(out)
    for g, rows in batch.runs:
        out[rows] = original[rows].astype(values.dtype) @ own_values[g, :n]  # o = a . V
        # nothing evicted or quantized: the same arithmetic, zero error
        if m == n and stored.part(batch, rows.start, g, 1) is None:
            out_hat[rows] = compressed[rows].astype(values.dtype) @ values[g, :n]
        # o_hat = a_hat . V_hat
        elif not stored.whole:
            v_hat = stored.by_kv[g][1]
            v_kept = v_hat if v_hat is not None else values[g, batch.at[rows.start]]
            out_hat[rows] = p_kept[rows].astype(values.dtype) @ v_kept
        else:
            for i in range(rows.start, rows.stop):
                v_kept = stored.part(batch, i, g, 1)
                out_hat[i] = p_kept[i].astype(values.dtype) @ (values[g, batch.at[i]] if v_kept is None else v_kept)
    return out, out_hat


def _results(batch, kept_kv, sliding, original, compressed, error, out, out_hat, metrics) -> list[RowResult]:
    """The batch's RowResults: what each row's cache keeps (its KV head's, shared by its rows; Quest: its
    own reads) and why."""
    n = batch.n
    if batch.reads is None:
        row_kept, row_of = kept_kv[:, :n], batch.kv_list
    else:
        row_kept, row_of = batch.reads[batch.heads, :n], range(len(batch.heads))
    reason = reasons_for(row_kept, batch.spec)
    if sliding:  # the window is the model's recent tokens; what it no longer sees, evicted
        reason = np.where(row_kept, np.int8(RECENT), np.int8(EVICTED))
    return [
        RowResult(
            layer=batch.layer,
            head=int(h),
            kv_head=g,
            query=batch.qi,
            position=batch.p,
            original=original[i],
            compressed=compressed[i],
            kept=row_kept[r],
            reason=reason[r],
            error=error[i],
            out_original=None if out is None else out[i],
            out_compressed=None if out_hat is None else out_hat[i],
            metrics=metrics[i],
        )
        for i, (h, g, r) in enumerate(zip(batch.heads.tolist(), batch.kv_list, row_of))
    ]


def _query_kept(
    trace: Trace, spec: Spec, layer: int, qi: int, heads: np.ndarray | None = None, attention: np.ndarray | None = None
) -> tuple[np.ndarray | None, np.ndarray]:
    """A needs_query policy (the oracle, Quest) at query qi: (each query head's own read mask (q_heads, n)
    or None, the kept (read) mask of every KV head (kv_heads, n)).

    The oracle ranks by every query head's attention: `attention` (len(heads), n) holds the rows
    already computed and the others are computed here. Quest reads only the query and the keys.
    Decided once per (trace, layer, query, settings): the memory count and the rows reuse it.
    """
    policy, ctx = get_policy(spec.scorer), ScoreContext(trace, layer, spec)
    n = int(trace.query_positions[qi]) + 1

    def decide():
        rows = None
        if policy.uses_attention:
            rows = np.empty((trace.n_q_heads, n))
            done = np.array([], dtype=int) if heads is None else np.asarray(heads)
            if len(done):
                rows[done] = attention
            missing = np.setdiff1d(np.arange(trace.n_q_heads), done)
            if len(missing):
                rows[missing] = softmax(logit_rows(trace, layer, missing, qi))
        inputs = dict(query=trace.q[layer, :, qi], keys=trace.k[layer, :, :n])
        reads = policy.query_reads(rows, ctx, **inputs)
        kept = policy.query_kept(rows, ctx, **inputs) if reads is None else group_union(reads, trace.n_kv_heads)
        for shared in (reads, kept):  # cached: every caller reads the same arrays
            if shared is not None:
                shared.setflags(write=False)
        return reads, kept

    return cached_on_trace(trace, layer, f"query-kept/{spec.scorer}", (qi, spec.eviction_key), decide)


def evaluate_row(
    trace: Trace, spec: Spec, layer: int, head: int, qi: int, kept_kv: np.ndarray | None = None
) -> RowResult:
    """One row; kept_kv (kv_heads, positions) as in evaluate_rows (None: oracle / no eviction)."""
    if kept_kv is None and spec.evicts and not get_policy(spec.scorer).needs_query:
        kept_kv = keep_masks(trace, spec, layer, [int(trace.query_positions[qi])])[0]
    return evaluate_rows(trace, spec, layer, [head], qi, kept_kv)[0]


def held_values(
    trace: Trace, spec: Spec, layer: int, p: int, kept_kv: np.ndarray, cache: dict
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The layer's values (kv_heads, P, D): the model's own, and those the cache holds for a query at p:
    the same, or with Spec.merge the evicted values folded into the kept ones at the compression point
    (kvviz.policies.merging): the prompt's for a later query, a compression at the query itself inside
    the prompt. (None, None): the trace has no values."""
    if trace.v is None:
        return None, None
    own = trace.v[layer]
    if not (spec.merge and spec.evicts):
        return own, own
    point = min(p, trace.context_len - 1)
    key = ("merged", layer, point)
    if key not in cache:
        kept = kept_kv if point == p else keep_masks(trace, spec, layer, [point])[0]
        cache[key] = merged_values(trace.k[layer], own, kept[:, : point + 1])
    return own, cache[key]


def keep_masks(trace: Trace, spec: Spec, layer: int, positions) -> np.ndarray | None:
    """Kept masks (len(positions), kv_heads, positions) of the spec's policy under its budget allocation;
    None for the oracle. A sliding layer's: its window, whatever the policy."""
    if trace.layer_windows[layer] is not None:
        return window_masks(trace, layer, positions)
    policy = get_policy(spec.scorer)
    if policy.needs_query and spec.evicts:
        return None
    ctx = ScoreContext(trace, layer, spec)
    return allocation_for(spec).keep_masks(policy, ctx, np.asarray(positions))


def kept_at_query(trace: Trace, spec: Spec, layer: int, qi: int) -> np.ndarray:
    """What every KV head of a layer holds (reads, for Quest) at query qi: (kv_heads, p + 1) bool."""
    p = int(trace.query_positions[qi])
    if trace.layer_windows[layer] is not None:  # a sliding layer: the model's window
        return window_masks(trace, layer, [p])[0, :, : p + 1]
    if not spec.evicts:
        return np.ones((trace.n_kv_heads, p + 1), dtype=bool)
    if get_policy(spec.scorer).needs_query:
        return _query_kept(trace, spec, layer, qi)[1]
    return keep_masks(trace, spec, layer, [p])[0, :, : p + 1]


def read_masks(trace: Trace, spec: Spec, layer: int, qi: int) -> np.ndarray:
    """(q_heads, p + 1) bool: what each query head attends over at query qi — its KV head's kept set, or,
    where query heads choose their own (Quest per query head), its own reads."""
    sliding = trace.layer_windows[layer] is not None
    if spec.evicts and get_policy(spec.scorer).needs_query and not sliding:
        reads, kept = _query_kept(trace, spec, layer, qi)
        if reads is not None:
            return reads
    else:
        kept = kept_at_query(trace, spec, layer, qi)
    return np.repeat(kept, trace.group_size, axis=0)
