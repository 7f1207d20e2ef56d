"""K/V quantization (KIVI-style group-wise min-max) and what a quantized cache costs in bytes.

(The handbook's logit-noise model is applied by the engine: logits + sigma * eps.)

Asymmetric, per group of G values:
    s = (max - min) / (2^b - 1);  z = round(-min / s)
    q = clamp(round(x / s) + z, 0, 2^b - 1);   x_hat = s * (q - z)
Symmetric (b >= 2): s = max|x| / (2^(b-1) - 1), no zero point.

Axis "channel": a group is one channel across G consecutive tokens (KIVI keys).
Axis "token":   a group is G consecutive channels of one token (KIVI values).
The last `residual` tokens stay in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .spec import FULL_BITS

SCALE_BITS = 16
ZERO_BITS = 16


def _blocks(n_tokens: int, dim: int, axis: str, group: int):
    """The groups of a (..., tokens, dim) array as (token slice, channel slice, shape, reduce axis).

    Each block reshapes to (..., n_groups, G, dim) (channel axis: G consecutive tokens of
    one channel) or (..., tokens, n_groups, G) (token axis: G consecutive channels of one
    token), so min / max reduce along one axis of a view - no transposed copy. A last,
    shorter group is its own block.
    """
    if axis == "channel":
        full = n_tokens - n_tokens % group
        if full:
            yield slice(0, full), slice(None), (full // group, group, dim), -2
        if full < n_tokens:
            yield slice(full, n_tokens), slice(None), (1, n_tokens - full, dim), -2
    else:
        full = dim - dim % group
        if full:
            yield slice(None), slice(0, full), (n_tokens, full // group, group), -1
        if full < dim:
            yield slice(None), slice(full, dim), (n_tokens, 1, dim - full), -1


def _scale(block: np.ndarray, bits: int, symmetric: bool, reduce: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-group scale s and (asymmetric) minimum, shaped to broadcast against `block`."""
    rows, axis = block, reduce
    if reduce == -1:  # numpy reduces a short last axis row by row (slow): put it first
        rows, axis = np.ascontiguousarray(np.moveaxis(block, -1, 0)), 0
    if symmetric:
        hi = np.abs(rows).max(axis=axis)
        return np.expand_dims(hi / (2 ** (bits - 1) - 1), reduce), None
    lo = rows.min(axis=axis)
    scale = (rows.max(axis=axis) - lo) / (2 ** bits - 1)
    return np.expand_dims(scale, reduce), np.expand_dims(lo, reduce)


def quantize(x: np.ndarray, bits: int, axis: str = "token", group_size: int = 32,
             residual: int = 0, symmetric: bool = False) -> np.ndarray:
    """Quantize then dequantize x of shape (..., tokens, dim).

    The last `residual` tokens are returned unchanged; bits == 16 returns x itself.
    Groups never straddle the quantized / residual boundary.
    """
    if bits >= FULL_BITS or x.shape[-2] <= residual:
        return x
    lead, (n_tokens, dim) = x.shape[:-2], x.shape[-2:]
    rows = np.ascontiguousarray(x).reshape(-1, n_tokens, dim)            # (U, T, D)
    positions = np.broadcast_to(np.arange(n_tokens), (len(rows), n_tokens))
    out = quantize_kept(rows, np.arange(len(rows)), positions, bits, axis, group_size, residual, symmetric)
    return out.reshape(*lead, n_tokens, dim)


def quantize_kept(cache: np.ndarray, heads: np.ndarray, positions: np.ndarray, bits: int,
                  axis: str = "token", group_size: int = 32, residual: int = 0,
                  symmetric: bool = False, delta: bool = False) -> np.ndarray:
    """Quantize-dequantize the kept tokens of a cache, read in place: (U, T, D).

    cache (heads, positions, D) is one layer's K or V; result row u holds
    cache[heads[u], positions[u]] (positions (U, T), in cache order) after evicting
    everything else and quantizing what is kept: groups run over the compacted tokens,
    and the last `residual` of them stay exact. With delta=True the result is
    x_hat - x, exactly zero where nothing changed (what the engine adds to exact logits).
    """
    from .quant_kernel import fake_quantize  # numba: compiled on first use, cached on disk

    if cache.dtype not in (np.float32, np.float64):   # float16 and friends: compute in float32
        return quantize_kept(cache.astype(np.float32), heads, positions, bits, axis, group_size, residual,
                             symmetric, delta).astype(cache.dtype)
    cache = np.ascontiguousarray(cache)
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    heads = np.ascontiguousarray(heads, dtype=np.int64)
    n_tokens, dim = positions.shape[1], cache.shape[-1]
    out = np.empty((len(positions), n_tokens, dim), dtype=cache.dtype)
    if bits >= FULL_BITS:
        out[...] = 0 if delta else cache[heads[:, None], positions]
        return out
    n_quant = max(0, n_tokens - residual)
    group = max(1, min(group_size, n_quant if axis == "channel" else dim))
    top = cache.dtype.type(2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1)
    fake_quantize(cache, heads, positions, n_quant, axis == "channel", group, top, symmetric, delta, out)
    return out


def compile_kernel() -> None:
    """Compile the quantization kernel for float32 and float64 caches, or load it from
    numba's on-disk cache (a few seconds the first time after an install or an edit)."""
    for dtype in (np.float32, np.float64):
        cache = np.zeros((1, 4, 4), dtype=dtype)
        for axis in ("channel", "token"):
            quantize_kept(cache, np.zeros(1, int), np.arange(4)[None], 4, axis, 2, delta=True)


def quant_step(x: np.ndarray, bits: int, axis: str = "token", group_size: int = 32,
               symmetric: bool = False) -> np.ndarray:
    """The scale s of the group each element of x (..., tokens, dim) falls in.

    Every dequantized element is within s/2 of the original, the bound the tests check.
    """
    group = min(group_size, x.shape[-2] if axis == "channel" else x.shape[-1])
    out = np.empty(x.shape, dtype=np.float64)
    lead = x.shape[:-2]
    for tokens, channels, shape, reduce in _blocks(x.shape[-2], x.shape[-1], axis, group):
        block = x[..., tokens, channels].reshape(*lead, *shape)
        scale, _ = _scale(block, bits, symmetric, reduce)
        out[..., tokens, channels] = np.broadcast_to(scale, block.shape).reshape(out[..., tokens, channels].shape)
    return out


@dataclass(frozen=True)
class CacheBytes:
    """Bytes of one tensor's cache (K or V) for n tokens of `dim` channels."""

    payload: float
    overhead: float  # scales and zero points
    residual: float

    @property
    def total(self) -> float:
        return self.payload + self.overhead + self.residual


def tensor_bytes(n_tokens: int, dim: int, bits: int, axis: str, group_size: int,
                 residual: int, symmetric: bool) -> CacheBytes:
    """Memory of one (kv head's) K or V cache holding n_tokens tokens.

    A quantized group costs b*G bits plus a 16-bit scale and (asymmetric) a 16-bit zero
    point; residual tokens and bits == 16 cost 16 bits a value.
    """
    if bits >= FULL_BITS:
        return CacheBytes(0.0, 0.0, n_tokens * dim * 2.0)
    n_quant = max(0, n_tokens - residual)
    n_res = n_tokens - n_quant
    if n_quant == 0:
        return CacheBytes(0.0, 0.0, n_res * dim * 2.0)
    group = min(group_size, n_quant if axis == "channel" else dim)
    if axis == "channel":
        n_groups = dim * -(-n_quant // group)
    else:
        n_groups = n_quant * -(-dim // group)
    overhead_bits = SCALE_BITS + (0 if symmetric else ZERO_BITS)
    return CacheBytes(payload=n_quant * dim * bits / 8, overhead=n_groups * overhead_bits / 8,
                      residual=n_res * dim * 2.0)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: float = 2.0) -> float:
    """Full-cache bytes per token: K and V, every layer and KV head (fp16: 2 bytes)."""
    return 2 * bytes_per_value * layers * kv_heads * head_dim
