"""NVFP4: E2M1 values in blocks of 16 consecutive channels of one token, an E4M3 scale per
block and one FP32 scale per tensor (NVIDIA's two-level scaling).

    s_t = amax(tensor) / (448 * 6)                       FP32 (rounded up), per tensor (the layer's K or V)
    s_b = round_e4m3(amax(block) / (6 * s_t))            <= 448 by construction: never overflows
    x_hat = s_t * s_b * round_e2m1(x / (s_t * s_b))      nearest, ties to even, saturating at 6

A block whose E4M3 scale underflows to 0 reconstructs as zeros. Bytes: half a byte per value,
one per block of 16, four per tensor (4.5 bits a value).
"""

from __future__ import annotations

import numpy as np

from kvviz.quant.fp8 import fp32_at_least
from kvviz.quant.minifloat import E2M1, E4M3

NVFP4_BLOCK = 16


def blocked(x: np.ndarray, block: int) -> np.ndarray:
    """x (..., D) as (..., ceil(D / block), block), zero-padded (zeros never raise an amax)."""
    d = x.shape[-1]
    pad = -d % block
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad), dtype=x.dtype)], axis=-1)
    return x.reshape(*x.shape[:-1], -1, block)


def nvfp4_scales(x: np.ndarray, block: int = NVFP4_BLOCK) -> tuple[np.float32, np.ndarray]:
    """(tensor scale s_t, block scales s_b (..., n_blocks, 1)) of x (..., D)."""
    amax_t = float(np.abs(x).max(initial=0.0))
    s_t = fp32_at_least(amax_t / (E4M3.max_value * E2M1.max_value))[()] if amax_t > 0 else np.float32(1.0)
    amax_b = np.abs(blocked(x, block)).max(axis=-1, keepdims=True).astype(np.float64)
    s_b = E4M3.round(amax_b / (E2M1.max_value * float(s_t)))
    return s_t, s_b


def nvfp4_quantize(x: np.ndarray, block: int = NVFP4_BLOCK) -> np.ndarray:
    """Quantize-dequantize x (U, T, D) (all of one tensor) to NVFP4; same dtype as x."""
    s_t, s_b = nvfp4_scales(x, block)
    s = s_b * float(s_t)
    xb = blocked(x, block).astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    out = np.where(s > 0, E2M1.round(xb / safe) * s, 0.0)
    return out.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].astype(x.dtype)


def nvfp4_bytes(n_quant: int, dim: int, kv_heads: int, block: int = NVFP4_BLOCK) -> tuple[float, float]:
    """(payload, scale bytes) of one KV head's n_quant tokens; the tensor scale is shared by kv_heads."""
    if not n_quant:
        return 0.0, 0.0
    return n_quant * dim / 2, n_quant * -(-dim // block) * 1.0 + 4.0 / kv_heads
