"""A generic small floating-point codec: round to the nearest representable value, ties to even.

A format has `ebits` exponent bits, `mbits` mantissa bits and an exponent `bias`. Normal
values are (1 + m / 2^mbits) * 2^(e - bias); the smallest exponent field (0) holds the
subnormals m / 2^mbits * 2^(1 - bias). `max_value` is the largest finite magnitude: E4M3 in
the OCP 8-bit spec gives up infinities and keeps only S.1111.111 as NaN, so its top is
S.1111.110 = 448; E5M2 keeps IEEE-style infinities (max 57344); E2M1 (FP4) has neither (max 6).

Encoding here is *saturating*: anything beyond max_value becomes +-max_value (the OCP
"satfinite" conversion), never inf or NaN. Rounding is to nearest, ties to the value with
an even mantissa (IEEE 754 roundTiesToEven, as the OCP specs require).

Values are computed exactly in float64: a / 2^(e - mbits) is a power-of-two scaling, so
np.rint (which rounds half to even) sees the exact mantissa.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Minifloat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max_value: float

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal value (the subnormals share its quantum)."""
        return 1 - self.bias

    def round(self, x) -> np.ndarray:
        """x rounded to the nearest representable value (ties to even), saturating at +-max_value."""
        x = np.asarray(x, dtype=np.float64)
        a = np.minimum(np.abs(x), self.max_value)
        _, ex = np.frexp(a)  # a = f * 2^ex, f in [0.5, 1)
        # floor(log2 a), subnormals share the lowest
        e = np.maximum(ex - 1, self.min_exponent)
        quantum = np.ldexp(1.0, e - self.mbits)
        y = np.minimum(np.rint(a / quantum) * quantum, self.max_value)
        return np.copysign(y, x)

    def values(self) -> np.ndarray:
        """Every finite value the format represents (both zeros collapse to 0), sorted."""
        out = set()
        for code in range(2 ** (self.ebits + self.mbits)):
            e, m = code >> self.mbits, code & ((1 << self.mbits) - 1)
            v = (
                (m / 2**self.mbits) * 2.0**self.min_exponent
                if e == 0
                else (1 + m / 2**self.mbits) * 2.0 ** (e - self.bias)
            )
            if v <= self.max_value:
                out.update((v, -v))
        return np.array(sorted(out))

    def mantissa_is_even(self, v) -> np.ndarray:
        """Whether representable values v have an even last mantissa bit (the tie winners)."""
        a = np.abs(np.asarray(v, dtype=np.float64))
        _, ex = np.frexp(a)
        e = np.maximum(ex - 1, self.min_exponent)
        steps = np.rint(a / np.ldexp(1.0, e - self.mbits)).astype(np.int64)
        return steps % 2 == 0


E4M3 = Minifloat("e4m3", ebits=4, mbits=3, bias=7, max_value=448.0)  # OCP FP8, no inf
E5M2 = Minifloat("e5m2", ebits=5, mbits=2, bias=15, max_value=57344.0)  # OCP FP8, IEEE-like
E2M1 = Minifloat("e2m1", ebits=2, mbits=1, bias=1, max_value=6.0)  # OCP FP4 element

E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # E8M0 scale: 2^(code - 127), code 0-254 (255 = NaN)


def e8m0_exponent(x) -> np.ndarray:
    """The E8M0 scale exponent floor(log2 x), clamped to what the 8-bit field can hold."""
    x = np.asarray(x, dtype=np.float64)
    _, ex = np.frexp(np.where(x > 0, x, 1.0))
    return np.clip(np.where(x > 0, ex - 1, E8M0_MIN_EXP), E8M0_MIN_EXP, E8M0_MAX_EXP)
