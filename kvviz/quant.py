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


def _fake_quantize(block: np.ndarray, bits: int, symmetric: bool, reduce: int,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Quantize then dequantize every group of `block` into `out` (a new array if None).

    Asymmetric: x_hat = s * (clamp(round(x/s) + z, 0, 2^b-1) - z), in place on one buffer.
    """
    scale, lo = _scale(block, bits, symmetric, reduce)
    constant = not scale.all()
    safe = np.where(scale > 0, scale, 1) if constant else scale
    q = np.divide(block, safe, out=out)             # one buffer, updated in place
    np.round(q, out=q)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        np.clip(q, -qmax, qmax, out=q)
        q *= scale
        return q
    zero = np.round(-lo / safe)
    q += zero                                       # (a scalar clip beats array bounds)
    np.clip(q, 0, 2 ** bits - 1, out=q)
    q -= zero
    q *= scale
    if constant:                                    # a constant group is exact
        np.copyto(q, lo, where=scale == 0)
    return q


def quantize(x: np.ndarray, bits: int, axis: str = "token", group_size: int = 32,
             residual: int = 0, symmetric: bool = False) -> np.ndarray:
    """Quantize then dequantize x of shape (..., tokens, dim).

    The last `residual` tokens are returned unchanged; bits == 16 returns x itself.
    Groups never straddle the quantized / residual boundary.
    """
    if bits >= FULL_BITS:
        return x
    n_quant = max(0, x.shape[-2] - residual)
    if n_quant == 0:
        return x
    group = min(group_size, n_quant if axis == "channel" else x.shape[-1])
    out = np.empty_like(x)
    out[..., n_quant:, :] = x[..., n_quant:, :]     # the full-precision residual
    lead = x.shape[:-2]
    for tokens, channels, shape, reduce in _blocks(n_quant, x.shape[-1], axis, group):
        part = x[..., :n_quant, :][..., tokens, channels]
        region = out[..., :n_quant, :][..., tokens, channels]
        target = region.reshape(*lead, *shape)
        if np.shares_memory(target, out):          # write straight into the result
            _fake_quantize(part.reshape(*lead, *shape), bits, symmetric, reduce, out=target)
        else:
            region[...] = _fake_quantize(part.reshape(*lead, *shape), bits, symmetric, reduce).reshape(region.shape)
    return out


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
