"""The integer (KIVI) quantizer in torch, on the cache's device: the twin of kvviz.quant.integer.quantize.

The same formulas in the same order, per element in float32 (kvviz/quant/integer.py states them):
    float offset   s = (max - min) / top,  x_hat = clamp(round((x - min) / s), 0, top) * s + min
    zero point     z = round(-min / s),    x_hat = s * (clamp(round(x / s) + z, 0, top) - z)
    symmetric      s = max|x| / top,       x_hat = s * clamp(round(x / s), -top, top)
round is half to even in both (numpy's rint, torch.round); a group with s == 0 is kept exact. Each
operation is one IEEE float32 operation on either side (no fused multiply-add in torch's eager
kernels nor in the numba kernel), so on a CPU the result equals the numpy reference bit for bit
(tests/test_decode_devices.py). On a GPU the same holds for these elementwise operations; a GPU
division that is not correctly rounded (it is, in torch's default CUDA build) would differ by at most
one step s of a group, the documented bound the test states.

The CPU float32 path keeps the numba kernel (kvviz.quant.kernel), which reuses each token's quantized
value across steps; this one quantizes the kept set afresh at each step (what the reuse equals).
torch is imported lazily.
"""

from __future__ import annotations

from kvviz.quant.integer import quantized_extent
from kvviz.spec import FULL_BITS


def quantize_torch(x, bits: int, axis: str = "token", group_size: int = 32, residual: int = 0,
                   symmetric: bool = False, zero_point: str = "float", partial: str = "full"):
    """Quantize then dequantize x (..., tokens, dim), float32 on any device; the last `residual`
    tokens (and a trailing short group with partial="full") unchanged."""
    import torch

    if bits >= FULL_BITS or x.shape[-2] <= residual:
        return x
    x = x.float()
    n_tokens, dim = x.shape[-2:]
    n_quant, d_quant, group = quantized_extent(n_tokens, dim, axis, group_size, residual, partial)
    out = x.clone()
    if n_quant == 0 or d_quant == 0:
        return out
    top = float(2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1)
    offset = zero_point == "float" and not symmetric
    lead = x.shape[:-2]
    if axis == "channel":                        # groups of G consecutive tokens of one channel
        full = n_quant - n_quant % group
        blocks = [(slice(0, full), (full // group, group, dim), -2)] if full else []
        if full < n_quant:
            blocks.append((slice(full, n_quant), (1, n_quant - full, dim), -2))
        for rows, shape, reduce in blocks:
            xb = x[..., rows, :].reshape(*lead, *shape)
            out[..., rows, :] = _round_trip(xb, reduce, top, symmetric, offset).reshape(*lead, -1, dim)
        return out
    full = d_quant - d_quant % group           # token axis: G consecutive channels of one token
    blocks = [(slice(0, full), (n_quant, full // group, group))] if full else []
    if full < d_quant:
        blocks.append((slice(full, d_quant), (n_quant, 1, d_quant - full)))
    for cols, shape in blocks:
        xb = x[..., :n_quant, cols].reshape(*lead, *shape)
        out[..., :n_quant, cols] = _round_trip(xb, -1, top, symmetric, offset).reshape(*lead, n_quant, -1)
    return out


def _round_trip(xb, reduce: int, top: float, symmetric: bool, offset: bool):
    """x_hat of every group of xb (groups along axis `reduce`), as the numba kernel computes it."""
    import torch

    lo = xb.amin(dim=reduce, keepdim=True)
    hi = xb.amax(dim=reduce, keepdim=True)
    if symmetric:
        s = torch.maximum(lo.abs(), hi.abs()) / top
        z = torch.zeros_like(s)
        code_lo = -top
    else:
        s = (hi - lo) / top
        z = lo if offset else torch.round(-lo / s)
        code_lo = 0.0
    if offset:
        code = torch.clamp(torch.round((xb - z) / s), code_lo, top)
        x_hat = code * s + z
    else:
        code = torch.clamp(torch.round(xb / s) + z, code_lo, top)
        x_hat = s * (code - z)
    return torch.where(s == 0, xb, x_hat)
