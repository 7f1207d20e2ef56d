"""FP8 caches (vLLM / SGLang style): E4M3 or E5M2 values with FP32 scales.

    s = amax / format max            (per tensor, per KV head, or per token of one head)
    x_hat = s * round_fp8(x / s)     round to nearest, ties to even, saturating (no inf)

x / s never exceeds (s is rounded up to FP32) the format's largest finite value, so nothing overflows; a group that
is all zeros gets s = 1. Per tensor means one scale for the layer's whole K (or V): every
KV head and every quantized token in the call. Bytes: 1 per value plus 4 per scale.

Static scales (`fp8_scale="static"`) are what vLLM does at decode time: one FP32 k_scale and one
v_scale per layer, fixed before the request is seen. A checkpoint without them gets 1.0, so the
cache is a plain cast to FP8: E4M3 saturates every |x| above 448 to 448 and flushes every |x| below
half its smallest subnormal (2^-10) to zero. `fp8_calibrate` sets them as a calibration run would,
from the trace's own context: s = amax / format max over the layer's context keys (values), every KV
head; later queries keep them, so a later token larger than the context's amax saturates.
"""

from __future__ import annotations

import numpy as np

from kvviz.quant.base import CacheBytes
from kvviz.quant.minifloat import E4M3, E5M2, Minifloat
from kvviz.settings import Setting, declare, rule

FP8 = {"e4m3": E4M3, "e5m2": E5M2}
FP8_SCALES = ("tensor", "head", "token", "static")
UNCALIBRATED = 1.0  # vLLM's k_scale / v_scale when the checkpoint has none

declare(
    Setting(
        "fp8_scale",
        "choice",
        "head",
        choices=FP8_SCALES,
        quantizes=True,
        label="FP8 scale per",
        option_labels={
            "tensor": "tensor (layer)",
            "head": "KV head",
            "token": "token",
            "static": "static (vLLM k_scale / v_scale)",
        },
        help="One FP32 scale s = amax / format max for the layer's whole K (or V), for each KV head, or for "
        "each token of each head; or vLLM's static scale per layer, fixed before the request: 1.0 (a "
        "checkpoint without scales: a plain cast, saturating at ±448 in E4M3) unless calibrated.",
    ),
    Setting(
        "fp8_calibrate",
        "bool",
        False,
        quantizes=True,
        url="fp8_cal",
        label="Calibrate the static scales",
        help="Static FP8 scales from the context, as a calibration run sets vLLM's k_scale / v_scale: "
        "amax / format max per layer over the context's keys (values), kept for the later queries. "
        "Off: 1.0, vLLM's default for a checkpoint without scales. Needs FP8 scale per: static.",
    ),
)


@rule
def _calibrate_needs_static(spec) -> None:
    if spec.fp8_calibrate and spec.fp8_scale != "static":
        from kvviz.spec import SpecError

        raise SpecError("fp8_calibrate sets static FP8 scales: use it with fp8_scale static (--fp8-scale static)")


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
    elif scale == "static":
        return np.full((1, 1, 1), UNCALIBRATED, np.float32)
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


def fp8_quantize(x: np.ndarray, fmt: str, scale: str = "head", static_scale: float | None = None) -> np.ndarray:
    """Quantize-dequantize x (U, T, D) to FP8 (fmt 'e4m3' or 'e5m2'); same dtype as x. static_scale: the
    fixed scale of scale="static" (None: 1.0)."""
    f = FP8[fmt]
    s = _scale(x, f, scale, static_scale)
    return (f.round(x / s) * s).astype(x.dtype)


def _scale(x: np.ndarray, f: Minifloat, scale: str, static_scale: float | None) -> np.ndarray:
    if scale == "static" and static_scale is not None:
        return np.full((1, 1, 1), static_scale, np.float64)
    return fp8_scales(x, f, scale).astype(np.float64)


def calibrate(context: np.ndarray, fmt: str) -> float:
    """The static scale a calibration run sets from these values (a layer's context K or V, any shape):
    amax / format max, as FP32 rounded up (1.0 for all zeros)."""
    amax = float(np.abs(np.asarray(context, dtype=np.float64)).max(initial=0.0))
    return float(fp32_at_least(amax / FP8[fmt].max_value)) if amax > 0 else UNCALIBRATED


def clipped(x: np.ndarray, fmt: str, scale: str = "static", static_scale: float | None = None) -> tuple[int, int]:
    """(saturated, flushed): how many values of x a cast with these scales saturates (|x / s| above the
    format's max, stored as ±max) and flushes to zero (x != 0 stored as 0)."""
    f = FP8[fmt]
    y = np.asarray(x, dtype=np.float64) / _scale(x, f, scale, static_scale)
    saturated = int((np.abs(y) > f.max_value).sum())
    flushed = int(((y != 0) & (f.round(y) == 0)).sum())
    return saturated, flushed


def fp8_bytes(n_quant: int, dim: int, scale: str, kv_heads: int) -> tuple[float, float]:
    """(payload, scale bytes) of one KV head's n_quant quantized tokens; a per-tensor scale
    is shared by the layer's kv_heads heads."""
    n_scales = (
        {"tensor": 1 / kv_heads, "head": 1.0, "token": float(n_quant), "static": 1 / kv_heads}[scale]
        if n_quant
        else 0.0
    )
    return float(n_quant * dim), n_scales * SCALE_BYTES


__all__ = [
    "CacheBytes",
    "FP8",
    "FP8_SCALES",
    "UNCALIBRATED",
    "calibrate",
    "clipped",
    "fp8_bytes",
    "fp8_quantize",
    "fp8_scales",
]
