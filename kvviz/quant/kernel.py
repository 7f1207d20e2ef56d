"""The fused quantize-dequantize kernel behind kvviz.quant (compiled by numba, cached on disk).

Per group: one pass finds min / max, a second writes x_hat (or x_hat - x), in one of three
forms (kvviz.quant states the formulas): KIVI's float offset x_hat = q * s + min, an
integer zero point x_hat = s * (q - z), or symmetric x_hat = s * q.
The kept tokens are read straight from the (kv_heads, positions, head_dim) cache at their
positions, so evicting and quantizing never materialise a gathered copy. Arithmetic runs
in the cache's own dtype, in the order of the formulas of docs/definitions.md, so the result equals
the same formulas evaluated with numpy.

Loops are written so LLVM vectorises them: the innermost loop runs along contiguous memory.
Per-token groups of the common sizes (CONSTANT_GROUPS) have a kernel each, the size a constant (a
constant trip count is what lets LLVM unroll and vectorise a group's min / max and round trip);
every other size shares one kernel that takes it as an argument (group 24 over 8 x 1,024 x 128
float32: ~2.5 ms against ~2.1 ms with its own kernel, for one compile instead of one per size). Both
run as two passes: every group's step first, then the round trip along each row.
Imported lazily: paths that never quantize skip numba.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

# error_model="numpy": x / 0 gives inf instead of raising, so loops with a division can be
# vectorised; a group with s == 0 (stored exactly) selects x itself instead.
kernel = njit(cache=True, nogil=True, error_model="numpy")


@kernel
def _scale(lo, hi, top, symmetric, offset):
    """Step s and z of one group from its min and max (s == 0: stored exactly).

    z is the float offset (the group's min) with `offset`, else the integer zero point
    round(-min / s); symmetric groups have z = 0.
    """
    if symmetric:
        return max(abs(lo), abs(hi)) / top, top - top
    s = (hi - lo) / top
    if offset:
        return s, lo
    return s, np.rint(-lo / s)


@kernel
def _round_trip(x, s, z, code_lo, top, offset):
    """Float offset: x_hat = clamp(round((x - z) / s), 0, top) * s + z.
    Zero point / symmetric: x_hat = s * (clamp(round(x / s) + z, code_lo, top) - z).
    x itself where s == 0."""
    if offset:
        code = min(max(np.rint((x - z) / s), code_lo), top)
        return x if s == 0 else code * s + z
    code = min(max(np.rint(x / s) + z, code_lo), top)
    return x if s == 0 else s * (code - z)


@kernel
def _by_channel(x, at, n_quant, group, top, symmetric, offset, code_lo, delta, out, lo, hi, s, z):
    """Groups of `group` consecutive kept tokens, one per channel (KIVI's keys)."""
    for t0 in range(0, n_quant, group):
        t1 = min(t0 + group, n_quant)
        lo[:] = x[at[t0]]
        hi[:] = x[at[t0]]
        for t in range(t0 + 1, t1):
            row = x[at[t]]
            for d in range(len(row)):
                lo[d] = min(lo[d], row[d])
                hi[d] = max(hi[d], row[d])
        for d in range(len(lo)):
            s[d], z[d] = _scale(lo[d], hi[d], top, symmetric, offset)
        for t in range(t0, t1):
            row = x[at[t]]
            o = out[t]
            if delta:
                for d in range(len(row)):
                    o[d] = _round_trip(row[d], s[d], z[d], code_lo, top, offset) - row[d]
            else:
                for d in range(len(row)):
                    o[d] = _round_trip(row[d], s[d], z[d], code_lo, top, offset)


@kernel
def _residual(x, at, n_quant, delta, out):
    """Tokens from n_quant on (the full-precision residual) stay exact: x itself, or 0 as x_hat - x."""
    for t in range(n_quant, len(at)):
        if delta:
            out[t] = 0
        else:
            out[t] = x[at[t]]


@kernel
def _quantize_by_channel(cache, heads, positions, n_quant, group, top, symmetric, offset, delta, out):
    """Per-channel groups (KIVI's keys) of every row u: out[u] from cache[heads[u]] at positions[u]."""
    D = cache.shape[2]
    code_lo = -top if symmetric else top - top
    lo = np.empty(D, dtype=cache.dtype)
    hi = np.empty_like(lo)
    s = np.empty_like(lo)
    z = np.empty_like(lo)
    for u in range(len(heads)):
        x, at = cache[heads[u]], positions[u]  # (P, D), (T,)
        _by_channel(x, at, n_quant, group, top, symmetric, offset, code_lo, delta, out[u], lo, hi, s, z)
        _residual(x, at, n_quant, delta, out[u])


# Group sizes compiled as constants of their own kernel (the presets', the formats', KIVI's); any other
# size runs one kernel that takes it as an argument. Each compiled kernel costs ~0.9 s the first time
# (numba caches it on disk): a kernel per size compiled ~30 of them in a fresh checkout's test run.
CONSTANT_GROUPS = frozenset({16, 32, 64, 128})


def _by_token(group: int):
    """The per-token kernel for group size G (KIVI's values): groups of G consecutive channels of one
    token; channels from d_quant on (a partial trailing group kept in full precision) stay exact. Call it
    with G as its last argument.

    For a size in CONSTANT_GROUPS, G is a constant of the compiled code, so a full group's loops have a
    known trip count (unrolled, vectorised); the results are the same either way (min, max and each
    element's own round trip: no sum whose order could change). The work runs in two passes over the
    tokens: every group's step, then every round trip (fused per group, the min / max chains of
    successive groups could not overlap: 3x slower).
    """
    return _token_kernel(group if group in CONSTANT_GROUPS else 0)


@lru_cache(maxsize=None)
def _token_kernel(constant: int):
    """The per-token kernel with its group size a constant (`constant` > 0) or its last argument (0)."""

    @kernel
    def quantize_by_token(cache, heads, positions, n_quant, d_quant, top, symmetric, offset, delta, out, size):
        group = constant if constant > 0 else size  # a constant once compiled, where `constant` is one
        D = cache.shape[2]
        code_lo = -top if symmetric else top - top
        # full groups; then a short one up to d_quant
        n_full = d_quant // group
        n_groups = n_full + (n_full * group < d_quant)
        s = np.empty((n_quant, n_groups), dtype=cache.dtype)
        z = np.empty_like(s)
        for u in range(len(heads)):
            x = cache[heads[u]]  # (P, D)
            at = positions[u]  # (T,)
            for t in range(n_quant):  # pass 1: the steps
                row = x[at[t]]
                for g in range(n_groups):
                    c0 = g * group
                    c1 = c0 + group if g < n_full else d_quant
                    lo = row[c0]
                    hi = row[c0]
                    # constant trip count: unrolled, vectorised
                    if g < n_full:
                        for d in range(c0 + 1, c0 + group):
                            lo = min(lo, row[d])
                            hi = max(hi, row[d])
                    else:
                        for d in range(c0 + 1, c1):
                            lo = min(lo, row[d])
                            hi = max(hi, row[d])
                    s[t, g], z[t, g] = _scale(lo, hi, top, symmetric, offset)
            for t in range(n_quant):  # pass 2: the round trips
                row = x[at[t]]
                o = out[u, t]
                for g in range(n_full):
                    c0 = g * group
                    s_g, z_g = s[t, g], z[t, g]
                    if delta:
                        for d in range(c0, c0 + group):
                            o[d] = _round_trip(row[d], s_g, z_g, code_lo, top, offset) - row[d]
                    else:
                        for d in range(c0, c0 + group):
                            o[d] = _round_trip(row[d], s_g, z_g, code_lo, top, offset)
                if n_groups > n_full:
                    s_g, z_g = s[t, n_full], z[t, n_full]
                    for d in range(n_full * group, d_quant):
                        r = _round_trip(row[d], s_g, z_g, code_lo, top, offset)
                        o[d] = r - row[d] if delta else r
                for d in range(d_quant, D):
                    o[d] = 0 if delta else row[d]
            _residual(x, at, n_quant, delta, out[u])

    return quantize_by_token


def fake_quantize(cache, heads, positions, n_quant, by_channel, group, d_quant, top, symmetric, offset, delta, out):
    """Write the dequantized kept tokens into out (U, T, D).

    cache (S, P, D): K or V of one layer; row u of the result holds cache[heads[u]] at
    positions[u] (U, T). The first n_quant tokens of each row are quantized in groups of
    `group`, by channel or by token (the first d_quant channels); the rest (the residual
    window, a partial group kept in full precision) stay exact. `top` is the largest code,
    2^b - 1 (asymmetric) or 2^(b-1) - 1 (symmetric), in the cache's dtype; `offset` picks
    KIVI's float offset over the integer zero point. With `delta` the result is x_hat - x
    (exactly zero where nothing changed).
    """
    if by_channel:
        _quantize_by_channel(cache, heads, positions, n_quant, group, top, symmetric, offset, delta, out)
    else:
        _by_token(int(group))(cache, heads, positions, n_quant, d_quant, top, symmetric, offset, delta, out, int(group))
