"""FP8 caches (vLLM / SGLang style): E4M3 or E5M2 values with FP32 scales.

    s = amax / format max            (per tensor, per KV head, or per token of one head)
    x_hat = s * round_fp8(x / s)     round to nearest, ties to even, saturating (no inf)

x / s never exceeds (s is rounded up to FP32) the format's largest finite value, so nothing overflows; a group that
is all zeros gets s = 1. Per tensor means one scale for the layer's whole K (or V): every
KV head and every quantized token in the call. Bytes: 1 per value plus 4 per scale.
"""

from __future__ import annotations

import numpy as np

from kvviz.quant.base import CacheBytes
from kvviz.quant.minifloat import E4M3, E5M2, Minifloat
from kvviz.settings import Setting, declare

FP8 = {"e4m3": E4M3, "e5m2": E5M2}
FP8_SCALES = ("tensor", "head", "token")

declare(
    Setting(
        "fp8_scale",
        "choice",
        "head",
        choices=FP8_SCALES,
        quantizes=True,
        label="FP8 scale per",
        option_labels={"tensor": "tensor (layer)", "head": "KV head", "token": "token"},
        help="One FP32 scale s = amax / format max for the layer's whole K (or V), for each KV head, or for "
        "each token of each head.",
    )
)
SCALE_BYTES = 4  # FP32 scales


def fp8_scales(x: np.ndarray, fmt: Minifloat, scale: str) -> np.ndarray:
    """FP32 scales amax / max broadcastable against x (U, T, D)."""
    a = np.abs(x)
    if scale == "tensor":
        amax = a.max(initial=0.0).reshape(1, 1, 1)
    elif scale == "head":
        amax = a.max(axis=(1, 2), keepdims=True, initial=0.0)
    elif scale == "token":
        amax = a.max(axis=2, keepdims=True, initial=0.0)
    else:
        raise ValueError(f"FP8 scale must be one of {FP8_SCALES}, got {scale!r}")
    s = fp32_at_least(amax.astype(np.float64) / fmt.max_value)
    return np.where(amax > 0, s, np.float32(1.0))


def fp32_at_least(x) -> np.ndarray:
    """x as FP32, rounded up where FP32 cannot hold it exactly, so that amax / s never exceeds (s is rounded up to FP32)
    the format's max (a plain conversion can round a tiny, subnormal scale down)."""
    x = np.asarray(x, dtype=np.float64)
    s = x.astype(np.float32)
    return np.where(s.astype(np.float64) < x, np.nextafter(s, np.float32(np.inf)), s)


def fp8_quantize(x: np.ndarray, fmt: str, scale: str = "head") -> np.ndarray:
    """Quantize-dequantize x (U, T, D) to FP8 (fmt 'e4m3' or 'e5m2'); same dtype as x."""
    f = FP8[fmt]
    s = fp8_scales(x, f, scale).astype(np.float64)
    return (f.round(x / s) * s).astype(x.dtype)


def fp8_bytes(n_quant: int, dim: int, scale: str, kv_heads: int) -> tuple[float, float]:
    """(payload, scale bytes) of one KV head's n_quant quantized tokens; a per-tensor scale
    is shared by the layer's kv_heads heads."""
    n_scales = (
        {"tensor": 1 / kv_heads, "head": 1.0, "token": float(n_quant)}[scale] if n_quant else 0.0
    )
    return float(n_quant * dim), n_scales * SCALE_BYTES


__all__ = ["CacheBytes", "FP8", "FP8_SCALES", "fp8_bytes", "fp8_quantize", "fp8_scales"]
