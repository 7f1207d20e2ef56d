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

from kvviz.attention import (
    kv_runs,
    logit_rows,
    softmax,
    softmax_and_log,
    window_masks,
    window_start,
)
from kvviz.metrics import RowMetrics, divergences, row_metrics_batch
from kvviz.policies import ScoreContext, get_policy
from kvviz.policies.allocation import allocation_for
from kvviz.policies.base import cached_on_trace, group_union
from kvviz.policies.merging import merged_values
from kvviz.quant import formats as qformats
from kvviz.quant import quantize_kept
from kvviz.spec import FULL_BITS, Spec
from kvviz.trace import Trace

# Why each token is in (or out of) the compressed cache, for colouring charts.
EVICTED, SINK, RECENT, HEAVY, ALL = 0, 1, 2, 3, 4
REASONS = {
    EVICTED: "evicted",
    SINK: "sink",
    RECENT: "recent",
    HEAVY: "heavy hitter",
    ALL: "kept (no eviction)",
}
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
    H = len(heads)
    p = int(trace.query_positions[qi])
    n = p + 1
    kvh = heads // trace.group_size  # (H,)
    sliding = trace.layer_windows[layer] is not None
    if sliding:  # the model keeps its window there, at full precision: no policy, no quantizer
        spec, reads, kept_kv = UNCOMPRESSED, None, window_masks(trace, layer, [p])[0]
    logits = logit_rows(trace, layer, heads, qi)  # (H, n), -inf before a sliding layer's window
    original, log_original = softmax_and_log(logits)
    # reads: Quest per query head, each row reads its own tokens from the whole cache, (Hq, n)
    # the oracle / Quest decide at this query
    if kept_kv is None and spec.evicts:
        reads, kept_kv = _query_kept(trace, spec, layer, qi, heads, original)
    if kept_kv is None:
        kept_kv = np.ones((trace.n_kv_heads, n), bool)

    # One cache per KV head: its rows share the kept tokens, the values and the quantized
    # K / V. Callers order heads by KV head, so each run of rows is one product.
    kv_list = kvh.tolist()
    runs = kv_runs(kv_list)
    # what each row attends over: its KV head's kept tokens (decided once per KV head), or its own reads
    if reads is None:
        kept_at = {g: np.flatnonzero(kept_kv[g, :n]) for g in set(kv_list)}
        rows_at = [kept_at[g] for g in kv_list]
    else:
        rows_at = [np.flatnonzero(reads[h, :n]) for h in heads.tolist()]
    sizes = np.array([len(a) for a in rows_at])
    # ragged caches (AdaKV): one head at a time
    if (sizes != sizes[0]).any():
        if reads is not None:
            return [
                row
                for h in heads.tolist()
                for row in evaluate_rows(trace, spec, layer, [h], qi, kept_kv, cache, reads)
            ]
        return [
            row
            for _, rows in runs
            for row in evaluate_rows(trace, spec, layer, heads[rows], qi, kept_kv, cache)
        ]
    m = int(sizes[0])  # the same for every row
    # (kv_heads, P, D), the trace's dtype: the model's values, and those the cache holds (merged: Spec.merge)
    own_values, values = held_values(trace, spec, layer, p, kept_kv, cache)
    # (H, m) kept positions, in order
    at = np.array(rows_at).reshape(H, m)
    flat = (at + (np.arange(H) * n)[:, None]).ravel()  # into the (H, n) rows
    # evict, then quantize what is kept: per KV head, over its compacted cache
    if reads is None:
        quantized = _quantized_kept(trace, spec, layer, p, kept_at, cache, values, kept_kv)
    # Quest: the whole cache is stored (quantized as stored); each row reads from it
    else:
        whole = _quantized_kept(
            trace, spec, layer, p, {g: np.arange(n) for g in set(kv_list)}, cache, values
        )

    def kept_part(i: int, g: int, which: int) -> np.ndarray | None:
        """Row i's (K_hat - K) (which 0) or V_hat (1) at its kept tokens, (m, D); None: not quantized."""
        if reads is None:
            return quantized[g][which]
        part = whole[g][which]
        return None if part is None else part[at[i]]

    kept_logits = logits.take(flat).reshape(H, m)  # (H, m)
    if spec.quant_model == "noise":
        eps = np.stack([noise_eps(trace, spec, layer, h, p) for h in heads])
        kept_logits += eps.take(flat).reshape(H, m) * spec.noise_sigma
    elif spec.quantizes_keys:
        # q . K_hat = q . K + q . (K_hat - K): exact logits wherever keys did not change
        # (H, D), the trace's dtype
        q = trace.q[layer, heads, qi] / np.float32(np.sqrt(trace.head_dim))
        if reads is None:
            # (K_hat - K).q^T: for a few query rows BLAS is ~2x faster this way round
            for g, rows in runs:
                kept_logits[rows] += (quantized[g][0] @ q[rows].T).T
        else:
            for i, g in enumerate(kv_list):
                kept_logits[i] += kept_part(i, g, 0) @ q[i]
    p_kept, logp_kept = softmax_and_log(kept_logits)  # over the kept tokens only
    compressed = np.zeros_like(original)
    compressed.ravel()[flat] = p_kept.ravel()
    error = compressed - original
    original_kept = original.take(flat).reshape(H, m)
    mass = original_kept.sum(axis=1)
    # evicted: a token the query sees (a sliding layer's window) is not kept
    seen = n - window_start(p, trace.layer_windows[layer])
    kl, kl_forward, js = divergences(
        original_kept,
        log_original.take(flat).reshape(H, m),
        p_kept,
        logp_kept,
        mass,
        evicted=m < seen,
    )

    out = out_hat = None
    if values is not None:
        out = np.empty((H, trace.head_dim))
        out_hat = np.empty_like(out)
        for g, rows in runs:
            out[rows] = original[rows].astype(values.dtype) @ own_values[g, :n]  # o = a . V
            # nothing evicted or quantized: the same
            if m == n and kept_part(rows.start, g, 1) is None:
                # arithmetic, zero error
                out_hat[rows] = compressed[rows].astype(values.dtype) @ values[g, :n]
            # o_hat = a_hat . V_hat
            elif reads is None:
                v_kept = (
                    quantized[g][1] if quantized[g][1] is not None else values[g, at[rows.start]]
                )
                out_hat[rows] = p_kept[rows].astype(values.dtype) @ v_kept
            else:
                for i in range(rows.start, rows.stop):
                    v_kept = kept_part(i, g, 1)
                    out_hat[i] = p_kept[i].astype(values.dtype) @ (
                        values[g, at[i]] if v_kept is None else v_kept
                    )
    tv_quant = None
    # what quantization adds: compressed vs eviction alone (a / mass on the kept tokens)
    if spec.quantizes:
        tv_quant = 0.5 * np.abs(p_kept - original_kept / mass[:, None]).sum(axis=1)
    metrics = row_metrics_batch(error, mass, kl, kl_forward, js, out, out_hat, tv_quant)
    # per KV head, shared by its rows
    if reads is None:
        row_kept, reason = kept_kv[:, :n], reasons_for(kept_kv[:, :n], spec)
        row_of = kv_list
    else:
        row_kept = reads[heads, :n]
        reason, row_of = reasons_for(row_kept, spec), range(H)
    if sliding:  # the window is the model's recent tokens; what it no longer sees, evicted
        reason = np.where(row_kept, np.int8(RECENT), np.int8(EVICTED))
    return [
        RowResult(
            layer=layer,
            head=int(h),
            kv_head=g,
            query=qi,
            position=p,
            original=original[i],
            compressed=compressed[i],
            kept=row_kept[r],
            reason=reason[r],
            error=error[i],
            out_original=None if out is None else out[i],
            out_compressed=None if out_hat is None else out_hat[i],
            metrics=metrics[i],
        )
        for i, (h, g, r) in enumerate(zip(heads.tolist(), kv_list, row_of))
    ]


def _query_kept(
    trace: Trace,
    spec: Spec,
    layer: int,
    qi: int,
    heads: np.ndarray | None = None,
    attention: np.ndarray | None = None,
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
        kept = (
            policy.query_kept(rows, ctx, **inputs)
            if reads is None
            else group_union(reads, trace.n_kv_heads)
        )
        for shared in (reads, kept):  # cached: every caller reads the same arrays
            if shared is not None:
                shared.setflags(write=False)
        return reads, kept

    return cached_on_trace(
        trace, layer, f"query-kept/{spec.scorer}", (qi, spec.eviction_key), decide
    )


def evaluate_row(
    trace: Trace, spec: Spec, layer: int, head: int, qi: int, kept_kv: np.ndarray | None = None
) -> RowResult:
    """One row; kept_kv (kv_heads, positions) as in evaluate_rows (None: oracle / no eviction)."""
    if kept_kv is None and spec.evicts and not get_policy(spec.scorer).needs_query:
        kept_kv = keep_masks(trace, spec, layer, [int(trace.query_positions[qi])])[0]
    return evaluate_rows(trace, spec, layer, [head], qi, kept_kv)[0]


def _quantized_kept(
    trace: Trace,
    spec: Spec,
    layer: int,
    p: int,
    kept_at: dict[int, np.ndarray],
    cache: dict,
    values: np.ndarray | None,
    kept_kv: np.ndarray | None = None,
) -> dict[int, tuple[np.ndarray | None, np.ndarray | None]]:
    """KV head -> (K_hat - K, V_hat) of its kept tokens at kept_at[g] (m,); None where not quantized.
    values: the layer's values the cache holds (held_values).

    Evict, then quantize what is kept: groups run over the compacted cache, and the last
    `residual` kept tokens stay at full precision. The caches not yet in `cache` are
    quantized in one call.
    """
    if spec.quant_model != "kv" or not spec.quantizes:
        return {g: (None, None) for g in kept_at}
    if qformats.uses_formats(spec):
        return _quantized_kept_formats(trace, spec, layer, p, kept_at, cache, values, kept_kv)
    keys = {g: (layer, g, p, hash(at.tobytes())) for g, at in kept_at.items()}
    missing = [g for g, key in keys.items() if key not in cache]
    if missing:
        heads, where = np.array(missing), np.stack([kept_at[g] for g in missing])  # (U,), (U, m)
        key_delta = v_hat = [None] * len(missing)
        settings = dict(
            group_size=spec.group_size,
            residual=spec.residual,
            symmetric=spec.symmetric,
            zero_point=spec.zero_point,
            partial=spec.partial,
        )
        if spec.key_bits < FULL_BITS:
            key_delta = quantize_kept(
                trace.k[layer], heads, where, spec.key_bits, spec.key_axis, delta=True, **settings
            )
        if values is not None and spec.value_bits < FULL_BITS:
            v_hat = quantize_kept(
                values, heads, where, spec.value_bits, spec.value_axis, **settings
            )
        for u, g in enumerate(missing):
            cache[keys[g]] = key_delta[u], v_hat[u]
    return {g: cache[key] for g, key in keys.items()}


def _quantized_kept_formats(
    trace: Trace,
    spec: Spec,
    layer: int,
    p: int,
    kept_at: dict[int, np.ndarray],
    cache: dict,
    values: np.ndarray | None,
    kept_kv: np.ndarray | None,
) -> dict[int, tuple[np.ndarray | None, np.ndarray | None]]:
    """_quantized_kept for kvviz.quant.formats: every KV head of the layer at once (a per-tensor
    scale reads them all), rotated and quantized in the spec's format; residual per its mode."""
    n = p + 1
    if kept_kv is None:
        kept_kv = np.ones((trace.n_kv_heads, n), bool)
    where = np.stack([np.flatnonzero(kept_kv[g, :n]) for g in range(trace.n_kv_heads)])  # (H, m)
    key = ("formats", layer, p, hash(where.tobytes()))
    if key not in cache:
        residual = qformats.residual_at(spec, where, p, trace.context_len)
        rows = np.arange(trace.n_kv_heads)[:, None]
        key_delta = v_hat = None
        c = trace.context_len  # static FP8 scales are calibrated on the context (fp8_calibrate)
        if spec.quantizes_keys:
            k = trace.k[layer][rows, where]
            sk = qformats.layer_static_scale(spec, "k", trace.k[layer][:, :c])
            key_delta = qformats.quantize_tensor(k, spec, "k", residual, sk) - k
        if values is not None and spec.quantizes_values:
            sv = qformats.layer_static_scale(spec, "v", trace.v[layer][:, :c])
            v_hat = qformats.quantize_tensor(values[rows, where], spec, "v", residual, sv)
        cache[key] = key_delta, v_hat
    key_delta, v_hat = cache[key]
    return {
        g: (None if key_delta is None else key_delta[g], None if v_hat is None else v_hat[g])
        for g in kept_at
    }


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
