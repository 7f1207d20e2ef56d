"""The cache formats by name, and a Spec's K / V quantizer: rotate, quantize, count the bytes.

    int     integer min-max groups (KIVI; kvviz.quant.integer): the bits / axis / group settings
    e4m3    FP8 E4M3 (OCP, saturating, no inf), FP32 scale per tensor / KV head / token (fp8_scale)
    e5m2    FP8 E5M2, the same scales
    nvfp4   E2M1 in blocks of 16 channels, E4M3 block scale, FP32 tensor scale
    mxfp4   E2M1 in blocks of 32 channels, E8M0 (power-of-two) block scale
    q8_0    llama.cpp / ollama: int8 in blocks of 32 channels, fp16 block scale (34 bytes per 32 values)
    q4_0    llama.cpp / ollama: 4-bit in blocks of 32 channels, fp16 block scale (18 bytes per 32 values)

The FP8 / FP4 formats fix their own width, so the bits setting only applies to `int`; their
blocks always run along the channels of one token (as the hardware formats do), while `int`
follows the key / value axis. Rotation (kvviz.quant.rotation) composes with all of them: the
kept tokens are rotated, quantized in the rotated basis, and rotated back, so the engine and
the decode path see K_hat = Q(K R) R^T (and V_hat likewise when values are rotated). It costs
no bytes (one fixed matrix, not stored per token).

Residual modes, which kept tokens stay at full precision:
    kivi   the last `residual` kept tokens (a sliding window; KIVI, and kvviz's default)
    hf     transformers' QuantizedCache: the prompt is quantized whole at the compression point,
           later tokens collect in a full-precision window that is flushed into the quantized
           store once it holds `residual` (residual_length) tokens, so at decode step j
           (j = 0 for the first token after the prompt) the last (j mod residual) + 1 tokens are
           exact. Flushing re-quantizes the dequantized store too; with per-token groups (HF's
           default axis 0) every token's group is its own, and re-quantizing a dequantized
           min-max group gives it back (its min and max are reconstructed exactly), so only the
           window matters.
"""

from __future__ import annotations

import numpy as np

from kvviz.settings import LABELS, Setting, declare
from kvviz.spec import FULL_BITS, Spec
from kvviz.quant import integer
from kvviz.quant.base import CacheBytes
from kvviz.quant.fp8 import calibrate, fp8_bytes, fp8_quantize
from kvviz.quant.ggml import GGML_FORMATS, ggml_bytes, ggml_quantize
from kvviz.quant.mxfp4 import mxfp4_bytes, mxfp4_quantize
from kvviz.quant.nvfp4 import nvfp4_bytes, nvfp4_quantize
from kvviz.quant.rotation import rotate, unrotate

FORMATS = ("int", "e4m3", "e5m2", "nvfp4", "mxfp4", *GGML_FORMATS)
FORMAT_LABELS = {
    "int": "integer groups",
    "e4m3": "FP8 E4M3",
    "e5m2": "FP8 E5M2",
    "nvfp4": "NVFP4",
    "mxfp4": "MXFP4",
    "q8_0": "llama.cpp q8_0",
    "q4_0": "llama.cpp q4_0",
}
# The serving formats (all but `int`, whose width is the bits setting) and the width each fixes: its values'
# bits, scales not counted (a sweep's `bits` column). Every page, link and command that lists formats reads them
# from here, so a format added above appears there by itself (tests/test_formats.py checks the table is whole).
SERVING_FORMATS = tuple(f for f in FORMATS if f != "int")
FORMAT_BITS = {"e4m3": 8, "e5m2": 8, "nvfp4": 4, "mxfp4": 4, "q8_0": 8, "q4_0": 4}
RESIDUAL_MODES = ("kivi", "hf")
_MENU = {
    "int": "integer groups (bits above)",
    "e4m3": "FP8 E4M3",
    "e5m2": "FP8 E5M2",
    "nvfp4": "NVFP4 (E2M1, blocks of 16)",
    "mxfp4": "MXFP4 (E2M1, blocks of 32)",
    "q8_0": "llama.cpp q8_0 (int8, fp16 scale per 32)",
    "q4_0": "llama.cpp q4_0 (4-bit, fp16 scale per 32)",
}

declare(
    Setting(
        "key_format",
        "choice",
        "int",
        choices=FORMATS,
        url="key_fmt",
        quantizes=True,
        label="Key format",
        option_labels=_MENU,
        help="Integer min-max groups (KIVI) at the bits above, or a serving format: FP8 (vLLM, SGLang) with "
        "FP32 scales, NVFP4 (E2M1 values, E4M3 scale per 16, FP32 per tensor) or MXFP4 (E2M1, "
        "power-of-two scale per 32), or llama.cpp's q8_0 / q4_0 (blocks of 32 channels, fp16 scale: 34 / 18 "
        "bytes per block). These fix their own width.",
    ),
    Setting(
        "value_format",
        "choice",
        "int",
        choices=FORMATS,
        url="value_fmt",
        quantizes=True,
        label="Value format",
        option_labels=_MENU,
        help="value cache format (as the key format)",
    ),
    Setting(
        "residual_mode",
        "choice",
        "kivi",
        choices=RESIDUAL_MODES,
        url="res_mode",
        quantizes=True,
        label="Residual window",
        option_labels={"kivi": "sliding (KIVI)", "hf": "flushed (HF QuantizedCache)"},
        help="Sliding: the last `Residual` tokens are always exact. Flushed: transformers' QuantizedCache "
        "quantizes the prompt whole, then collects new tokens at full precision and quantizes them "
        "together once `Residual` of them have arrived.",
    ),
)


def format_label(fmt: str, bits: int) -> str:
    """A key or value format in words: '4-bit int', '16-bit', 'FP8 E4M3'."""
    if fmt == "int":
        return "16-bit" if bits >= FULL_BITS else f"{bits}-bit int"
    return FORMAT_LABELS[fmt]


def quantization_label(spec: Spec) -> str:
    """What Spec.label says about real K/V quantization."""
    if spec.key_format == "int" and spec.value_format == "int":
        parts = [f"K{spec.key_bits}/V{spec.value_bits}-bit"]
    else:
        parts = [
            f"K {format_label(spec.key_format, spec.key_bits)} / V {format_label(spec.value_format, spec.value_bits)}"
        ]
        if {"e4m3", "e5m2"} & {spec.key_format, spec.value_format}:
            parts.append(
                f"FP8 scale per {spec.fp8_scale}"
                if spec.fp8_scale != "static"
                else "FP8 static scales " + ("calibrated on the context" if spec.fp8_calibrate else "1.0")
            )
    if spec.rotate != "none":
        parts.append("Hadamard-rotated " + ("keys" if spec.rotate == "keys" else "keys and values"))
    if spec.residual_mode == "hf":
        parts.append(f"HF QuantizedCache residual {spec.residual}")
    if spec.zero_point == "int" and not spec.symmetric:
        parts.append("integer zero point")
    return ", ".join(parts)


LABELS["quantization"] = quantization_label


def settings(spec: Spec, which: str) -> tuple[str, int, str, bool]:
    """(format, bits, axis, rotated) of the keys (which='k') or values ('v')."""
    if which == "k":
        return spec.key_format, spec.key_bits, spec.key_axis, spec.rotate in ("keys", "keys-values")
    return spec.value_format, spec.value_bits, spec.value_axis, spec.rotate == "keys-values"


def is_quantized(spec: Spec, which: str) -> bool:
    fmt, bits, _, _ = settings(spec, which)
    return fmt != "int" or bits < FULL_BITS


def quantized_tokens(x, spec: Spec, which: str, residual: int) -> int:
    """How many leading tokens of x (U, T, D) the spec quantizes in K (which="k") or V: all but the last
    `residual`; none where it leaves this tensor at 16 bits. numpy or torch x alike."""
    return max(0, x.shape[-2] - residual) if is_quantized(spec, which) else 0


def uses_formats(spec: Spec) -> bool:
    """Whether the spec needs this module's path (anything beyond the integer kernel's settings)."""
    return (
        spec.key_format != "int" or spec.value_format != "int" or spec.rotate != "none" or spec.residual_mode != "kivi"
    )


def flush_point(spec: Spec, p: int, context_len: int) -> int:
    """residual_mode 'hf': the first position of the full-precision window at query position p
    (p + 1, nothing exact, inside the prompt: the prompt is quantized whole)."""
    if p < context_len:
        return p + 1
    r = max(1, spec.residual)
    return context_len + ((p - context_len) // r) * r


def residual_at(spec: Spec, kept_positions: np.ndarray, p: int, context_len: int) -> int:
    """How many of the kept tokens (positions (..., m), sorted) stay at full precision at query p.

    kivi: the last `residual`. hf: those at or after the flush point (the fewest over KV heads
    when eviction gave the heads different tokens).
    """
    m = kept_positions.shape[-1]
    if spec.residual_mode == "kivi":
        return min(spec.residual, m)
    start = flush_point(spec, p, context_len)
    counts = (np.asarray(kept_positions) >= start).sum(axis=-1)
    return int(np.min(counts)) if np.ndim(counts) else int(counts)


def quantize_values(x: np.ndarray, fmt: str, fp8_scale: str = "head", static_scale: float | None = None) -> np.ndarray:
    """Quantize-dequantize every token of x (U, T, D) in an FP8 / FP4 / llama.cpp format (one tensor: U heads);
    static_scale: FP8's fixed scale under fp8_scale "static" (None: 1.0)."""
    if fmt in ("e4m3", "e5m2"):
        return fp8_quantize(x, fmt, fp8_scale, static_scale)
    if fmt == "nvfp4":
        return nvfp4_quantize(x)
    if fmt == "mxfp4":
        return mxfp4_quantize(x)
    if fmt in GGML_FORMATS:
        return ggml_quantize(x, fmt)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def quantize_tensor(
    x: np.ndarray, spec: Spec, which: str, residual: int, static_scale: float | None = None
) -> np.ndarray:
    """K_hat (or V_hat) of the kept tokens x (U, T, D) of one layer's U KV heads.

    The last `residual` tokens come back unchanged; the others are rotated (if the spec
    rotates this tensor), quantized in the spec's format and rotated back. static_scale: the
    layer's fixed FP8 scale (`layer_static_scale`); None with fp8_calibrate: calibrated from x itself.
    """
    fmt, bits, axis, rotated = settings(spec, which)
    n_quant = quantized_tokens(x, spec, which, residual)
    if n_quant == 0:
        return x
    head = x[..., :n_quant, :]
    xr = rotate(head) if rotated else head
    if fmt == "int":
        q = integer.quantize(xr, bits, axis, **integer.grouping(spec, residual=0))
    else:
        if static_scale is None and spec.fp8_calibrate and fmt in ("e4m3", "e5m2"):
            static_scale = calibrate(xr, fmt)
        q = quantize_values(xr, fmt, spec.fp8_scale, static_scale)
    out = np.array(x, copy=True)
    out[..., :n_quant, :] = unrotate(q) if rotated else q
    return out


def tensor_bytes(spec: Spec, which: str, n_tokens: int, dim: int, kv_heads: int, residual: int) -> CacheBytes:
    """Bytes of one KV head's K (or V) cache of n_tokens, `residual` of them at 16 bits."""
    fmt, bits, axis, _ = settings(spec, which)
    if fmt == "int":
        return integer.tensor_bytes(n_tokens, dim, bits, axis, **integer.grouping(spec, residual))
    n_quant = max(0, n_tokens - residual)
    if fmt in ("e4m3", "e5m2"):
        payload, scales = fp8_bytes(n_quant, dim, spec.fp8_scale, kv_heads)
    elif fmt == "nvfp4":
        payload, scales = nvfp4_bytes(n_quant, dim, kv_heads)
    elif fmt in GGML_FORMATS:
        payload, scales = ggml_bytes(n_quant, dim, fmt)
    else:
        payload, scales = mxfp4_bytes(n_quant, dim)
    return CacheBytes(payload=payload, overhead=scales, residual=(n_tokens - n_quant) * dim * 2.0)


def layer_static_scale(spec: Spec, which: str, context: np.ndarray) -> float | None:
    """The fixed FP8 scale of one layer's K (which="k") or V calibrated on that layer's context K or V
    (U, C, D), in the rotated basis where the spec rotates it; None where there is none to calibrate
    (not fp8_calibrate, not FP8: quantize_tensor then uses 1.0 or its own scales)."""
    fmt, _, _, rotated = settings(spec, which)
    if not spec.fp8_calibrate or spec.fp8_scale != "static" or fmt not in ("e4m3", "e5m2"):
        return None
    return calibrate(rotate(context) if rotated else context, fmt)


def spec_residual_for_memory(spec: Spec, kept: int, n_tokens: int, context_len: int) -> int:
    """Full-precision tokens of a cache of `kept` tokens when n_tokens have arrived (the newest is n_tokens - 1)."""
    if spec.residual_mode == "kivi":
        return min(spec.residual, kept)
    return min(kept, n_tokens - flush_point(spec, n_tokens - 1, context_len))


# --- presets -----------------------------------------------------------------------------

# transformers QuantizedCache defaults: nbits 4, q_group_size 64, residual_length 128
HF_RESIDUAL_LENGTH = 128
HF_GROUP = 64


def hf_quantized_cache(
    nbits: int = 4, residual_length: int = HF_RESIDUAL_LENGTH, q_group_size: int = HF_GROUP, **changes
) -> Spec:
    """transformers' QuantizedCache (quanto backend, its defaults axis_key = axis_value = 0) as a Spec.

    quanto's MaxOptimizer + affine quantizer on groups of q_group_size consecutive values of the
    (batch, heads, tokens, head_dim) cache: with head_dim a multiple of the group, one group is
    q_group_size channels of one token, for keys and values alike;
        s = (max - min) / (2^b - 1),  q = clamp(round((x - min) / s), 0, 2^b - 1),  x_hat = q s + min
    i.e. min-max with a float offset. The full-precision window is flushed every residual_length
    tokens (residual_mode "hf").

    How it differs from KIVI: KIVI quantizes keys per *channel* (groups of 32 tokens of one
    channel, because keys have outlier channels) and values per token, and keeps a sliding
    window of the last 128 tokens exact; HF quantizes keys per *token* too, quantizes the whole
    prompt at once, and its exact window grows from 0 to residual_length - 1 and empties.
    """
    if nbits not in (2, 4):
        raise ValueError(f"QuantizedCache's quanto backend takes nbits 2 or 4, got {nbits}")
    return Spec(
        key_bits=nbits,
        value_bits=nbits,
        key_axis="token",
        value_axis="token",
        group_size=q_group_size,
        residual=residual_length,
        residual_mode="hf",
        zero_point="float",
        partial="quantize",
        **changes,
    )


# --- what rotation does to one head's keys ---------------------------------------------------


def rotation_effect(k: np.ndarray, bits: int = 2, group: int = 32) -> dict:
    """One head's keys k (tokens, D) before and after rotation: how outlying the largest channel
    is (its max |k| over the median channel's) and the relative error of per-token `bits`-bit
    keys in groups of `group` channels, ||K_hat - K|| / ||K||, quantized as they are or rotated first."""
    k = np.asarray(k, dtype=np.float64)
    kr = rotate(k)
    spec = Spec(key_bits=bits, key_axis="token", group_size=group, partial="quantize")

    def peak(x):
        amax = np.abs(x).max(axis=0)
        return float(amax.max() / max(np.median(amax), 1e-30))

    norm = max(float(np.linalg.norm(k)), 1e-30)
    plain = quantize_tensor(k[None], spec, "k", 0)[0]
    rotated = quantize_tensor(k[None], spec.with_(rotate="keys"), "k", 0)[0]
    return {
        "peak_before": peak(k),
        "peak_after": peak(kr),
        "error_before": float(np.linalg.norm(plain - k)) / norm,
        "error_after": float(np.linalg.norm(rotated - k)) / norm,
    }
