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

The serving formats (FP8 with any scale, static included; NVFP4, MXFP4; llama.cpp's q8_0 / q4_0; the
Hadamard rotation) have twins below too.
The CPU float32 path keeps the numba kernel (kvviz.quant.kernel), which reuses each token's quantized
value across steps; this one quantizes the kept set afresh at each step (what the reuse equals).
torch is imported lazily.
"""

from __future__ import annotations

from kvviz.quant.integer import grouping, quantized_extent
from kvviz.spec import FULL_BITS


def quantize_torch(
    x,
    bits: int,
    axis: str = "token",
    group_size: int = 32,
    residual: int = 0,
    symmetric: bool = False,
    zero_point: str = "float",
    partial: str = "full",
):
    """Quantize then dequantize x (..., tokens, dim), float32 on any device; the last `residual`
    tokens (and a trailing short group with partial="full") unchanged."""

    if bits >= FULL_BITS or x.shape[-2] <= residual:
        return x
    x = x.float()
    n_tokens, dim = x.shape[-2:]
    n_quant, d_quant, group = quantized_extent(n_tokens, dim, axis, group_size, residual, partial)
    out = x.clone()
    if n_quant == 0 or d_quant == 0:
        return out
    top = float(2 ** (bits - 1) - 1 if symmetric else 2**bits - 1)
    offset = zero_point == "float" and not symmetric
    lead = x.shape[:-2]
    if axis == "channel":  # groups of G consecutive tokens of one channel
        full = n_quant - n_quant % group
        blocks = [(slice(0, full), (full // group, group, dim), -2)] if full else []
        if full < n_quant:
            blocks.append((slice(full, n_quant), (1, n_quant - full, dim), -2))
        for rows, shape, reduce in blocks:
            xb = x[..., rows, :].reshape(*lead, *shape)
            out[..., rows, :] = _round_trip(xb, reduce, top, symmetric, offset).reshape(*lead, -1, dim)
        return out
    full = d_quant - d_quant % group  # token axis: G consecutive channels of one token
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


# --- the serving formats (kvviz.quant.formats): FP8, NVFP4, MXFP4, Hadamard rotation ------------------
# Their reference rounds in float64 (kvviz.quant.minifloat); these twins do the same float64 operations
# with torch (frexp / ldexp / round half to even are exact), so they equal it bit for bit wherever the
# rotation is off. A rotation is one float32 matrix product whose summation order is the BLAS's own:
# rotated values agree to float32 rounding, and a value on a rounding boundary may then land one
# quantization step away (the tolerance tests/test_decode_devices.py states). MPS has no float64:
# callers keep the host path there (float64_ok).


def float64_ok(device) -> bool:
    import torch

    return torch.device(device).type != "mps"


def _minifloat_round(x, fmt):
    """kvviz.quant.minifloat.Minifloat.round in torch float64: nearest, ties to even, saturating."""
    import torch

    a = torch.clamp(x.abs(), max=fmt.max_value)
    _, ex = torch.frexp(a)
    e = torch.clamp(ex - 1, min=fmt.min_exponent)
    quantum = torch.ldexp(torch.ones_like(a), (e - fmt.mbits).to(a.dtype))
    y = torch.clamp(torch.round(a / quantum) * quantum, max=fmt.max_value)
    return torch.copysign(y, x)


def _fp32_at_least(x64):
    """kvviz.quant.fp8.fp32_at_least: float64 -> float32, rounded up where float32 cannot hold it."""
    import torch

    s = x64.float()
    return torch.where(s.double() < x64, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def _fp8(x, fmt_name: str, scale: str, calibrate: bool = False):
    """kvviz.quant.fp8.fp8_quantize; scale "static": vLLM's fixed scale, 1.0 or (calibrate) amax / max of x
    itself, as kvviz.quant.formats.quantize_tensor calibrates it (kvviz.quant.fp8.calibrate)."""
    import torch

    from kvviz.quant.fp8 import FP8, UNCALIBRATED

    f = FP8[fmt_name]
    a = x.abs()
    if scale == "static" and not calibrate:
        amax = None
    elif scale in ("tensor", "static"):
        amax = a.amax().reshape(1, 1, 1) if x.numel() else a.new_zeros(1, 1, 1)
    elif scale == "head":
        amax = a.amax(dim=(1, 2), keepdim=True)
    else:
        amax = a.amax(dim=2, keepdim=True)
    if amax is None:
        s = torch.full((1, 1, 1), UNCALIBRATED, dtype=torch.float64, device=x.device)
    else:
        s = torch.where(amax > 0, _fp32_at_least(amax.double() / f.max_value), torch.ones_like(amax)).double()
    return (_minifloat_round(x.double() / s, f) * s).to(x.dtype)


def _blocked(x, block: int):
    import torch

    pad = -x.shape[-1] % block
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, block)


def _nvfp4(x, block: int = 16):
    import torch

    from kvviz.quant.minifloat import E2M1, E4M3

    amax_t = float(x.abs().amax()) if x.numel() else 0.0
    s_t = (
        float(_fp32_at_least(torch.tensor(amax_t / (E4M3.max_value * E2M1.max_value), dtype=torch.float64)))
        if amax_t > 0
        else 1.0
    )
    xb = _blocked(x, block)
    s = _minifloat_round(xb.abs().amax(dim=-1, keepdim=True).double() / (E2M1.max_value * s_t), E4M3) * s_t
    safe = torch.where(s > 0, s, torch.ones_like(s))
    out = torch.where(s > 0, _minifloat_round(xb.double() / safe, E2M1) * s, torch.zeros_like(s))
    return out.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].to(x.dtype)


def _mxfp4(x, block: int = 32):
    import torch

    from kvviz.quant.minifloat import E2M1, E8M0_MAX_EXP, E8M0_MIN_EXP

    xb = _blocked(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).double()
    _, ex = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))
    e = torch.clamp(torch.where(amax > 0, ex - 1, torch.full_like(ex, E8M0_MIN_EXP)), E8M0_MIN_EXP, E8M0_MAX_EXP)
    e = torch.clamp(e - 2, E8M0_MIN_EXP, E8M0_MAX_EXP)
    s = torch.ldexp(torch.ones_like(amax), e.double())
    out = _minifloat_round(xb.double() / s, E2M1) * s
    return out.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].to(x.dtype)


def _hadamard(dim: int, like):
    import torch

    from kvviz.quant.rotation import hadamard

    # a copy: hadamard's is read-only
    return torch.tensor(hadamard(dim), dtype=like.dtype, device=like.device)


# --- llama.cpp's q8_0 / q4_0 (kvviz.quant.ggml) --------------------------------------------------------
# The reference's float32 operations one for one: the block amax (exact), d = amax / 127 (q8_0) or
# m / -8 (q4_0, exact), the reciprocal 1 / d, x * (1 / d), C's roundf (q8_0) or trunc(. + 8.5) (q4_0), d
# rounded to fp16 (nearest even) and (q - 8) * fp16(d) (exact: an integer of 8 bits times 11). Every one is
# a single correctly rounded IEEE operation in torch's eager kernels on a CPU and, in torch's default CUDA
# build (no fast math: IEEE division and reciprocal), on a GPU; the division and the reciprocal take
# tensors, never a CPU scalar, which CUDA would turn into a multiplication by its reciprocal. So the result
# equals the numpy reference bit for bit (tests/test_decode_devices.py checks it on every device present;
# off the CPU it allows one step d of the block, the bound a differently rounded 1 / d could move a value).


def _roundf(x):
    """C's roundf (halves away from zero), as kvviz.quant.ggml._roundf computes it."""
    import torch

    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _ggml(x, fmt: str):
    """kvviz.quant.ggml.ggml_quantize in torch: x (..., D) float32 in blocks of 32 channels, each with an
    fp16 scale; a padded last block (zeros change no scale)."""
    import torch

    from kvviz.quant.ggml import BLOCK

    b = _blocked(x, BLOCK)  # (..., nb, 32)
    if fmt == "q8_0":
        d = b.abs().amax(dim=-1) / torch.tensor(127.0, device=x.device)  # (..., nb)
    else:
        i = b.abs().argmax(dim=-1, keepdim=True)  # the first largest |x|
        d = torch.gather(b, -1, i)[..., 0] / torch.tensor(-8.0, device=x.device)
    inv = torch.where(d == 0, torch.zeros_like(d), torch.reciprocal(d))[..., None]
    if fmt == "q8_0":
        q = _roundf(b * inv).to(torch.int16).float()  # as the reference's int8 codes: no -0.0
    else:
        q = torch.clamp(torch.trunc(b * inv + 8.5), 0, 15) - 8
    out = q * d.half().float()[..., None]
    return out.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].to(x.dtype)


def device_quantizes(spec) -> bool:
    """Whether quantize_tensor_torch implements the spec's formats: every format kvviz has (the integer
    groups, FP8 with any scale, NVFP4, MXFP4, llama.cpp's q8_0 / q4_0, the rotation). A hook for a format
    added later without a twin: the cache then quantizes it on the host (kvviz.quant.formats)."""
    from kvviz.quant.formats import FORMATS

    return {spec.key_format, spec.value_format} <= set(FORMATS)


def quantize_tensor_torch(x, spec, which: str, residual: int):
    """kvviz.quant.formats.quantize_tensor in torch on x's device: x (U, T, D) float32, the last `residual`
    tokens unchanged, the rest rotated (if the spec says so), quantized in the spec's format, rotated back."""
    from kvviz.quant.formats import quantized_tokens, settings

    fmt, bits, axis, rotated = settings(spec, which)
    if not device_quantizes(spec):
        raise ValueError(f"no device quantizer for {fmt}: use the host's (kvviz.quant.formats.quantize_tensor)")
    n_quant = quantized_tokens(x, spec, which, residual)
    if n_quant == 0:
        return x
    head = x[..., :n_quant, :]
    r = _hadamard(x.shape[-1], x) if rotated else None
    xr = head @ r if rotated else head
    if fmt == "int":
        q = quantize_torch(xr, bits, axis, **grouping(spec, residual=0))
    elif fmt in ("e4m3", "e5m2"):
        q = _fp8(xr, fmt, spec.fp8_scale, spec.fp8_calibrate)
    elif fmt == "nvfp4":
        q = _nvfp4(xr)
    elif fmt == "mxfp4":
        q = _mxfp4(xr)
    elif fmt in ("q8_0", "q4_0"):
        q = _ggml(xr, fmt)
    else:
        raise ValueError(f"no device quantizer for format {fmt!r}")
    out = x.clone()
    out[..., :n_quant, :] = q @ r.T if rotated else q
    return out
