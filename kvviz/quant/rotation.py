"""Orthonormal Hadamard rotation of the head dimension (QuaRot / SpinQuant / TurboQuant-style).

H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] (Sylvester), normalised by 1/sqrt(n): H is symmetric
and orthonormal (H H^T = I). A head dimension that is not a power of two gets the block-diagonal
matrix of the largest power-of-two Hadamard that divides it (still orthonormal).

Rows are tokens: a key k (row vector) is stored rotated, k' = k R with R = H. Queries get the same
R, so q' . k' = q R R^T k^T = q . k: unquantized attention is unchanged. Quantizing k' instead of
k spreads an outlier channel over every channel (a lone channel of size c becomes D channels of
size c / sqrt(D)), which is what per-token groups need. The dequantized key in the original basis
is k_hat = Q(k R) R^T; values rotated the same way are undone on the output (o = a V_hat R^T).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvviz.settings import Setting, declare

ROTATIONS = ("none", "keys", "keys-values")
declare(
    Setting(
        "rotate",
        "choice",
        "none",
        choices=ROTATIONS,
        quantizes=True,
        label="Hadamard rotation before quantizing",
        option_labels={"none": "off", "keys": "keys (+ queries)", "keys-values": "keys and values"},
        help="An orthonormal Hadamard rotation of the head dimension spreads outlier channels over all "
        "channels (QuaRot / SpinQuant). Queries get the same rotation, so q·k is unchanged before "
        "quantization; rotated values are rotated back on the output. Works with every format and "
        "axis.",
    )
)


def _largest_power_of_two_dividing(n: int) -> int:
    return n & -n


@lru_cache(maxsize=16)
def hadamard(dim: int) -> np.ndarray:
    """The (dim, dim) orthonormal rotation kvviz applies (float64, read-only)."""
    if dim < 1:
        raise ValueError(f"the head dimension must be at least 1, got {dim}")
    n = _largest_power_of_two_dividing(dim)
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(n)
    out = np.kron(np.eye(dim // n), h)
    out.setflags(write=False)
    return out


def rotate(x: np.ndarray) -> np.ndarray:
    """x (..., dim) expressed in the rotated basis: x R (same dtype as x)."""
    r = hadamard(x.shape[-1]).astype(x.dtype if x.dtype in (np.float32, np.float64) else np.float64)
    return x @ r


def unrotate(x: np.ndarray) -> np.ndarray:
    """Back to the original basis: x R^T (R is symmetric, so this is x R)."""
    r = hadamard(x.shape[-1]).T.astype(x.dtype if x.dtype in (np.float32, np.float64) else np.float64)
    return x @ r
