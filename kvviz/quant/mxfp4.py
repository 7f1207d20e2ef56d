"""MXFP4 (OCP Microscaling v1.0): E2M1 values in blocks of 32 consecutive channels of one
token sharing a power-of-two E8M0 scale.

    X = floor(log2 amax(block)) - 2          2 = the largest exponent of E2M1 (6 = 1.5 * 2^2)
    x_hat = 2^X * round_e2m1(x / 2^X)        nearest, ties to even, saturating at 6 (the spec's rule:
                                             amax / 2^X lies in [4, 8), so the top of a block can clip)

X is clamped to the E8M0 range [-127, 127]: the scale never overflows. Bytes: half a byte per
value and one per block of 32 (4.25 bits a value).
"""

from __future__ import annotations

import numpy as np

from kvviz.quant.minifloat import E2M1, E8M0_MAX_EXP, E8M0_MIN_EXP, e8m0_exponent
from kvviz.quant.nvfp4 import blocked

MXFP4_BLOCK = 32
E2M1_EMAX = 2


def mxfp4_exponents(x: np.ndarray, block: int = MXFP4_BLOCK) -> np.ndarray:
    """Shared exponents X (..., n_blocks, 1) of x (..., D)."""
    amax = np.abs(blocked(x, block)).max(axis=-1, keepdims=True)
    return np.clip(e8m0_exponent(amax) - E2M1_EMAX, E8M0_MIN_EXP, E8M0_MAX_EXP)


def mxfp4_quantize(x: np.ndarray, block: int = MXFP4_BLOCK) -> np.ndarray:
    """Quantize-dequantize x (U, T, D) to MXFP4; same dtype as x."""
    s = np.ldexp(1.0, mxfp4_exponents(x, block))
    out = E2M1.round(blocked(x, block).astype(np.float64) / s) * s
    return out.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].astype(x.dtype)


def mxfp4_bytes(n_quant: int, dim: int, block: int = MXFP4_BLOCK) -> tuple[float, float]:
    return n_quant * dim / 2, n_quant * -(-dim // block) * 1.0
