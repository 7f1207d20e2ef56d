"""What a compressed cache stores of its kept tokens: evict, then quantize what is kept.

Per KV head, over its compacted cache (groups run over the kept tokens; the last `residual` kept tokens stay
at full precision), or, for the serving formats, every KV head of a layer at once (a per-tensor scale reads
them all). kvviz.rows reads the quantized keys as K_hat - K (exact logits wherever keys did not change) and the
values as V_hat.
"""

from __future__ import annotations

import numpy as np

from kvviz.quant import formats as qformats
from kvviz.quant.integer import grouping, quantize_kept
from kvviz.spec import FULL_BITS, Spec
from kvviz.trace import Trace


def stored_kept(
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
        return _stored_kept_formats(trace, spec, layer, p, kept_at, cache, values, kept_kv)
    keys = {g: (layer, g, p, hash(at.tobytes())) for g, at in kept_at.items()}
    missing = [g for g, key in keys.items() if key not in cache]
    if missing:
        heads, where = np.array(missing), np.stack([kept_at[g] for g in missing])  # (U,), (U, m)
        key_delta = v_hat = [None] * len(missing)
        settings = grouping(spec)
        if spec.key_bits < FULL_BITS:
            key_delta = quantize_kept(
                trace.k[layer], heads, where, spec.key_bits, spec.key_axis, delta=True, **settings
            )
        if values is not None and spec.value_bits < FULL_BITS:
            v_hat = quantize_kept(values, heads, where, spec.value_bits, spec.value_axis, **settings)
        for u, g in enumerate(missing):
            cache[keys[g]] = key_delta[u], v_hat[u]
    return {g: cache[key] for g, key in keys.items()}


def _stored_kept_formats(
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
    return {g: (None if key_delta is None else key_delta[g], None if v_hat is None else v_hat[g]) for g in kept_at}
