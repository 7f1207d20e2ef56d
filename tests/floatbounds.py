"""Tolerances derived from float32 error bounds, for tests that compare two float32 computations.

Two float32 results of the same formula made by different BLAS calls (other shapes, other kernels, other
summation orders: OpenBLAS picks its kernel by processor and by OPENBLAS_CORETYPE) agree only to float32's
precision, never bit for bit. A test that claims accuracy compares against a float64 reference with a
tolerance from the bounds below; a test that claims bit-identity compares the same code path on both sides.

The bounds are the classical ones (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3):
a dot product of n terms summed in float32 in any order is off by at most gamma_n * sum |x_i y_i|,
gamma_n = n u / (1 - n u), u = 2^-24 the unit roundoff.
"""

import numpy as np

U32 = float(np.finfo(np.float32).eps) / 2  # unit roundoff of float32, 2^-24


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n: the relative error bound of n floating-point operations in sequence."""
    return n * u / (1 - n * u)


def logit_error_bound(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Largest error of a float32 logit q.k / sqrt(d), any summation order: gamma_d * |q|.|k| / sqrt(d)
    (plus one rounding of the scale). q: (..., d), k: (n, d) -> (..., n)."""
    d = q.shape[-1]
    q64, k64 = np.abs(q.astype(np.float64)), np.abs(k.astype(np.float64))
    return gamma(d + 2) * (q64 @ k64.T) / np.sqrt(d)


def softmax_rtol(logit_error: float, n: int) -> float:
    """Relative bound on a float32 softmax probability whose logits are each off by at most
    `logit_error`: exp(2 e) - 1 from the shifted logits (its own and the row's through the normaliser),
    plus the exp, the n-term float32 sum and the division."""
    return float(np.expm1(2 * logit_error) + gamma(n + 3))
