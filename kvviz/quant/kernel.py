"""The fused quantize-dequantize kernel behind kvviz.quant (compiled by numba, cached on disk).

Per group: one pass finds min / max, a second writes x_hat (or x_hat - x), in one of three
forms (kvviz.quant states the formulas): KIVI's float offset x_hat = q * s + min, an
integer zero point x_hat = s * (q - z), or symmetric x_hat = s * q.
The kept tokens are read straight from the (kv_heads, positions, head_dim) cache at their
positions, so evicting and quantizing never materialise a gathered copy. Arithmetic runs
in the cache's own dtype, in the order of the DESIGN.md formulas, so the result equals
the same formulas evaluated with numpy.

Loops are written so LLVM vectorises them: the innermost loop always runs along
contiguous memory with no reduction in it (per-token groups are transposed through a
small block buffer for that). Imported lazily: paths that never quantize skip numba.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# error_model="numpy": x / 0 gives inf instead of raising, so loops with a division can be
# vectorised; a group with s == 0 (stored exactly) selects x itself instead.
kernel = njit(cache=True, nogil=True, error_model="numpy")

BLOCK = 128  # tokens per transposed block on the per-token path (fits the L1 cache at D=64)


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
def _by_token(x, at, n_quant, group, d_quant, top, symmetric, offset, code_lo, delta, out, block, lo, hi, s, z):
    """Groups of `group` consecutive channels of one token (KIVI's values); channels from
    d_quant on (a partial trailing group kept in full precision) pass through unchanged.

    A block of tokens is transposed into block (D, B) so that min / max and the round
    trip run across tokens, not along a short group.
    """
    D, B = block.shape
    for b0 in range(0, n_quant, B):
        nb = min(B, n_quant - b0)
        for b in range(nb):
            row = x[at[b0 + b]]
            for d in range(D):
                block[d, b] = row[d]
        for c0 in range(0, d_quant, group):
            c1 = min(c0 + group, d_quant)
            lo[:nb] = block[c0, :nb]
            hi[:nb] = block[c0, :nb]
            for d in range(c0 + 1, c1):
                for b in range(nb):
                    lo[b] = min(lo[b], block[d, b])
                    hi[b] = max(hi[b], block[d, b])
            for b in range(nb):
                s[b], z[b] = _scale(lo[b], hi[b], top, symmetric, offset)
            for d in range(c0, c1):
                for b in range(nb):
                    block[d, b] = _round_trip(block[d, b], s[b], z[b], code_lo, top, offset)
        for b in range(nb):
            row, o = x[at[b0 + b]], out[b0 + b]
            if delta:
                for d in range(D):
                    o[d] = block[d, b] - row[d]
            else:
                for d in range(D):
                    o[d] = block[d, b]


@kernel
def fake_quantize(cache, heads, positions, n_quant, by_channel, group, d_quant, top, symmetric, offset, delta,
                  out):
    """Write the dequantized kept tokens into out (U, T, D).

    cache (S, P, D): K or V of one layer; row u of the result holds cache[heads[u]] at
    positions[u] (U, T). The first n_quant tokens of each row are quantized in groups of
    `group`, by channel or by token (the first d_quant channels); the rest (the residual
    window, a partial group kept in full precision) stay exact. `top` is the largest code,
    2^b - 1 (asymmetric) or 2^(b-1) - 1 (symmetric), in the cache's dtype; `offset` picks
    KIVI's float offset over the integer zero point. With `delta` the result is x_hat - x
    (exactly zero where nothing changed).
    """
    U, T = positions.shape
    D = cache.shape[2]
    code_lo = -top if symmetric else top - top
    width = D if by_channel else BLOCK
    lo = np.empty(width, dtype=cache.dtype)
    hi = np.empty_like(lo)
    s = np.empty_like(lo)
    z = np.empty_like(lo)
    block = np.empty((D, BLOCK), dtype=cache.dtype)
    for u in range(U):
        x = cache[heads[u]]                                  # (P, D)
        at = positions[u]                                    # (T,)
        if by_channel:
            _by_channel(x, at, n_quant, group, top, symmetric, offset, code_lo, delta, out[u], lo, hi, s, z)
        else:
            _by_token(x, at, n_quant, group, d_quant, top, symmetric, offset, code_lo, delta, out[u], block,
                      lo, hi, s, z)
        for t in range(n_quant, T):                          # the full-precision residual
            if delta:
                out[u, t] = 0
            else:
                out[u, t] = x[at[t]]
