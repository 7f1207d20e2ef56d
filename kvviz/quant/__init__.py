"""K/V cache quantization: integer min-max groups (KIVI), FP8, NVFP4 / MXFP4, Hadamard rotation.

One format a module:
    integer    KIVI-style group-wise min-max (the numba kernel), its bytes, kivi_residual
    minifloat  the generic round-to-nearest-even small-float codec (E4M3, E5M2, E2M1, E8M0)
    fp8        FP8 E4M3 / E5M2 with per-tensor, per-head or per-token FP32 scales
    nvfp4      E2M1 blocks of 16, E4M3 block scale, FP32 tensor scale
    mxfp4      E2M1 blocks of 32, E8M0 block scale (OCP MX)
    rotation   the orthonormal Hadamard rotation of the head dimension
    formats    the registry and a Spec's quantizer / byte count (rotation, residual modes)
    kept       what a compressed cache stores of its kept tokens (evict, then quantize), for kvviz.rows
    kernel     the fused numba quantize-dequantize kernel behind `integer`

May import: the core (spec, trace); numba only in `kernel`, compiled on first use.
Everything `kvviz.quant` exported before it became a package is still importable from here.
"""

from kvviz.quant.base import CacheBytes, kv_bytes_per_token
from kvviz.quant.integer import (
    KIVI_GROUP,
    KIVI_RESIDUAL,
    SCALE_BITS,
    ZERO_BITS,
    _blocks,
    _scale,
    compile_kernel,
    kivi_residual,
    quant_step,
    quantize,
    quantize_kept,
    quantized_extent,
    tensor_bytes,
)

__all__ = [
    "CacheBytes",
    "KIVI_GROUP",
    "KIVI_RESIDUAL",
    "SCALE_BITS",
    "ZERO_BITS",
    "_blocks",
    "_scale",
    "compile_kernel",
    "kivi_residual",
    "kv_bytes_per_token",
    "quant_step",
    "quantize",
    "quantize_kept",
    "quantized_extent",
    "tensor_bytes",
]
