"""K/V quantization (KIVI-style group-wise min-max) and the handbook's logit-noise model.

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


def _group_view(x: np.ndarray, axis: str, group: int) -> tuple[np.ndarray, int]:
    """Reshape (..., tokens, dim) so each group of G values is the last axis.

    Returns the grouped array (..., n_groups, G) and the number of padding values added
    (groups that do not divide evenly are padded by repeating the edge value, which
    leaves min, max and max|x| of the partial group unchanged).
    """
    if axis == "channel":
        x = np.swapaxes(x, -1, -2)  # (..., dim, tokens): group consecutive tokens of a channel
    n = x.shape[-1]
    pad = (-n) % group
    if pad:
        x = np.concatenate([x, np.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
    return x.reshape(*x.shape[:-1], -1, group), pad


def _ungroup(xg: np.ndarray, axis: str, pad: int) -> np.ndarray:
    x = xg.reshape(*xg.shape[:-2], -1)
    if pad:
        x = x[..., :-pad]
    if axis == "channel":
        x = np.swapaxes(x, -1, -2)
    return x


def quantize_groups(xg: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Quantize-dequantize each group (last axis). Returns (x_hat, scale per group)."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = np.abs(xg).max(axis=-1, keepdims=True) / qmax
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.round(xg / safe), -qmax, qmax)
        return q * scale, scale
    levels = 2 ** bits - 1
    lo = xg.min(axis=-1, keepdims=True)
    hi = xg.max(axis=-1, keepdims=True)
    scale = (hi - lo) / levels
    safe = np.where(scale > 0, scale, 1.0)
    zero = np.round(-lo / safe)
    q = xg / safe                                   # in place from here on: one buffer
    np.round(q, out=q)
    q += zero
    np.clip(q, 0, levels, out=q)
    q -= zero
    q *= scale
    constant = (scale == 0)[..., 0]
    if constant.any():                              # a constant group is exact
        q[constant] = xg[constant]
    return q, scale


def quantize(x: np.ndarray, bits: int, axis: str = "token", group_size: int = 32,
             residual: int = 0, symmetric: bool = False) -> np.ndarray:
    """Quantize then dequantize x of shape (..., tokens, dim).

    The last `residual` tokens are returned unchanged; bits == 16 returns x itself.
    Groups never straddle the quantized / residual boundary.
    """
    if bits >= FULL_BITS:
        return x
    n_tokens = x.shape[-2]
    n_quant = max(0, n_tokens - residual)
    if n_quant == 0:
        return x
    group = min(group_size, n_quant if axis == "channel" else x.shape[-1])
    head = x[..., :n_quant, :]
    xg, pad = _group_view(head, axis, group)
    xg_hat, _ = quantize_groups(xg, bits, symmetric)
    out = x.copy()
    out[..., :n_quant, :] = _ungroup(xg_hat, axis, pad)
    return out


def quant_step(x: np.ndarray, bits: int, axis: str = "token", group_size: int = 32,
               symmetric: bool = False) -> np.ndarray:
    """The scale s of the group each element of x (..., tokens, dim) falls in.

    Every dequantized element is within s/2 of the original (asymmetric), the bound
    the tests check.
    """
    group = min(group_size, x.shape[-2] if axis == "channel" else x.shape[-1])
    xg, pad = _group_view(x, axis, group)
    _, scale = quantize_groups(xg, bits, symmetric)
    return _ungroup(np.broadcast_to(scale, xg.shape), axis, pad)


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


def logit_noise(n: int, sigma: float, rng: np.random.Generator | None = None,
                eps: np.ndarray | None = None) -> np.ndarray:
    """The handbook's stand-in for quantization: sigma * standard normal noise on logits."""
    if eps is None:
        eps = rng.standard_normal(n)
    return eps * sigma
