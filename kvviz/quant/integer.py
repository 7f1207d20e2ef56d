"""K/V quantization (KIVI-style group-wise min-max) and what a quantized cache costs in bytes.

(The handbook's logit-noise model is applied by the engine: logits + sigma * eps.)

Asymmetric, per group of G values, KIVI's float offset (zero_point="float", the default):
    s = (max - min) / (2^b - 1)
    q = clamp(round((x - min) / s), 0, 2^b - 1);   x_hat = q * s + min
    |x - x_hat| <= s / 2 and x_hat in [min, max]; min is stored as a 16-bit float.
The integer zero point (zero_point="int"), as integer kernels store it:
    z = round(-min / s);  q = clamp(round(x / s) + z, 0, 2^b - 1);   x_hat = s * (q - z)
    slightly larger error (the zero is rounded), and at 1 bit x_hat can leave [min, max];
    z is stored as a b-bit integer.
Symmetric (b >= 2): s = max|x| / (2^(b-1) - 1), q = clamp(round(x / s), -(2^(b-1) - 1), 2^(b-1) - 1),
    x_hat = s * q; no zero point.

Axis "channel": a group is one channel across G consecutive tokens (KIVI keys).
Axis "token":   a group is G consecutive channels of one token (KIVI values); a group
                never exceeds one token, so G is capped at the head dimension.
The last `residual` tokens stay in full precision. A trailing group shorter than G
(the tokens after the last full group of a channel, or the channels after the last full
group of a token) stays in full precision too (partial="full", as KIVI keeps them until a
group fills), or is quantized as a short group (partial="quantize").
"""

from __future__ import annotations

import numpy as np

from kvviz.quant.base import CacheBytes
from kvviz.settings import Setting, declare, rule
from kvviz.spec import FULL_BITS, MAX_BUDGET, SpecError

BITS_OPTIONS = (1, 2, 3, 4, 5, 6, 7, 8, FULL_BITS)  # what the bits sliders offer
# what the group-size menu offers (any 1-4096 is valid)
GROUP_OPTIONS = (8, 16, 32, 64, 128)


def _bits(part: str) -> Setting:
    """The bits of the cached keys or values (`part`): the two settings are alike but for the name."""
    return Setting(
        f"{part}_bits",
        "int",
        FULL_BITS,
        1,
        FULL_BITS,
        quantizes=True,
        options=BITS_OPTIONS,
        label=f"{part.capitalize()} bits",
        help=f"{part} bits (1-8; 16 = not quantized)",
    )


def _axis(part: str, default: str, help: str) -> Setting:
    """Which way the groups of the cached keys or values (`part`) run."""
    return Setting(
        f"{part}_axis",
        "choice",
        default,
        choices=("channel", "token"),
        quantizes=True,
        label=f"{part.capitalize()} groups run along",
        help=help,
    )


declare(
    _bits("key"),
    _bits("value"),
    _axis("key", "channel", "KIVI quantizes keys per channel (keys have outlier channels)."),
    _axis("value", "token", "KIVI quantizes values per token."),
    Setting(
        "group_size",
        "int",
        32,
        1,
        4096,
        url="group",
        quantizes=True,
        options=GROUP_OPTIONS,
        label="Group size (values per scale)",
        help="values that share one scale (and zero point)",
    ),
    Setting(
        "residual",
        "int",
        0,
        0,
        MAX_BUDGET,
        quantizes=True,
        label="Residual (last tokens kept at 16 bits)",
        help="recent tokens kept in full precision (KIVI: 128)",
    ),
    Setting(
        "symmetric",
        "bool",
        False,
        quantizes=True,
        label="Symmetric quantization (no zero point; needs ≥ 2 bits)",
        help="symmetric quantization (no zero point)",
    ),
    Setting(
        "zero_point",
        "choice",
        "float",
        choices=("float", "int"),
        quantizes=True,
        label="Asymmetric zero",
        option_labels={"float": "float offset (KIVI)", "int": "integer zero point"},
        help="KIVI dequantizes x̂ = q·s + min with min kept as a 16-bit float. Integer kernels round a zero "
        "point z = round(−min/s) and store it in b bits: x̂ = s·(q − z), slightly larger error, and at "
        "1 bit x̂ can leave [min, max].",
    ),
    Setting(
        "partial",
        "choice",
        "full",
        choices=("full", "quantize"),
        cli="--partial-groups",
        quantizes=True,
        label="Partial groups (shorter than G)",
        option_labels={"full": "16-bit (KIVI)", "quantize": "quantize"},
        help="Tokens after the last full group of G (per-channel keys) or channels after the last full group "
        "(per-token): KIVI keeps them at full precision until a group fills; counted as 16-bit in the "
        "memory. Or quantize them as a short group.",
    ),
)


@rule
def check_bits(spec) -> None:
    """1-8 bits, or 16 for none; symmetric groups need 2 (one bit has no sign and magnitude)."""
    for what, bits in (("key", spec.key_bits), ("value", spec.value_bits)):
        if bits == FULL_BITS:
            continue
        low = 2 if spec.symmetric else 1
        if not low <= bits <= 8:
            raise SpecError(
                f"{what} bits must be {low}-8 (or 16 for no quantization), got {bits}"
                + (" — symmetric quantization needs at least 2 bits" if spec.symmetric and bits == 1 else "")
            )


SCALE_BITS = 16
ZERO_BITS = 16
KIVI_RESIDUAL = 128  # KIVI keeps the last 128 tokens at full precision
KIVI_GROUP = 32


def grouping(spec, residual: int | None = None) -> dict:
    """The integer quantizer's keyword arguments that a spec sets: its group size, residual (unless
    `residual` is given), symmetric or not, zero point and partial-group rule."""
    return dict(
        group_size=spec.group_size,
        residual=spec.residual if residual is None else residual,
        symmetric=spec.symmetric,
        zero_point=spec.zero_point,
        partial=spec.partial,
    )


def kivi_residual(n_tokens: int) -> int:
    """KIVI's full-precision residual (128) for a cache of n_tokens, shrunk on a short cache
    so that at least one group of 32 tokens is quantized."""
    return max(0, min(KIVI_RESIDUAL, n_tokens - KIVI_GROUP))


def _blocks(n_tokens: int, dim: int, axis: str, group: int):
    """The groups of a (..., tokens, dim) array as (token slice, channel slice, shape, reduce axis).

    Each block reshapes to (..., n_groups, G, dim) (channel axis: G consecutive tokens of
    one channel) or (..., tokens, n_groups, G) (token axis: G consecutive channels of one
    token), so min / max reduce along one axis of a view - no transposed copy. A last,
    shorter group is its own block.
    """
    if axis == "channel":
        full = n_tokens - n_tokens % group
        if full:
            yield slice(0, full), slice(None), (full // group, group, dim), -2
        if full < n_tokens:
            yield slice(full, n_tokens), slice(None), (1, n_tokens - full, dim), -2
    else:
        full = dim - dim % group
        if full:
            yield slice(None), slice(0, full), (n_tokens, full // group, group), -1
        if full < dim:
            yield slice(None), slice(full, dim), (n_tokens, 1, dim - full), -1


def _scale(block: np.ndarray, bits: int, symmetric: bool, reduce: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-group scale s and (asymmetric) minimum, shaped to broadcast against `block`."""
    rows, axis = block, reduce
    if reduce == -1:  # numpy reduces a short last axis row by row (slow): put it first
        rows, axis = np.ascontiguousarray(np.moveaxis(block, -1, 0)), 0
    if symmetric:
        hi = np.abs(rows).max(axis=axis)
        return np.expand_dims(hi / (2 ** (bits - 1) - 1), reduce), None
    lo = rows.min(axis=axis)
    scale = (rows.max(axis=axis) - lo) / (2**bits - 1)
    return np.expand_dims(scale, reduce), np.expand_dims(lo, reduce)


def quantized_extent(
    n_tokens: int, dim: int, axis: str, group_size: int, residual: int, partial: str = "full"
) -> tuple[int, int, int]:
    """(tokens quantized, channels quantized, group) of an (n_tokens, dim) cache.

    Tokens after the residual cut and, with partial="full", the tokens (channel axis) or
    channels (token axis) of a trailing group shorter than G stay in full precision.
    """
    n_quant = max(0, n_tokens - residual)
    if axis == "channel":
        group = max(1, group_size)
        if partial == "full":
            n_quant -= n_quant % group
        return n_quant, dim, group
    group = max(1, min(group_size, dim))
    d_quant = dim - dim % group if partial == "full" else dim
    return (n_quant if d_quant else 0), d_quant, group


def quantize(
    x: np.ndarray,
    bits: int,
    axis: str = "token",
    group_size: int = 32,
    residual: int = 0,
    symmetric: bool = False,
    zero_point: str = "float",
    partial: str = "full",
) -> np.ndarray:
    """Quantize then dequantize x of shape (..., tokens, dim).

    The last `residual` tokens are returned unchanged; bits == 16 returns x itself.
    Groups never straddle the quantized / residual boundary.
    """
    if bits >= FULL_BITS or x.shape[-2] <= residual:
        return x
    lead, (n_tokens, dim) = x.shape[:-2], x.shape[-2:]
    rows = np.ascontiguousarray(x).reshape(-1, n_tokens, dim)  # (U, T, D)
    positions = np.broadcast_to(np.arange(n_tokens), (len(rows), n_tokens))
    out = quantize_kept(
        rows,
        np.arange(len(rows)),
        positions,
        bits,
        axis,
        group_size,
        residual,
        symmetric,
        zero_point=zero_point,
        partial=partial,
    )
    return out.reshape(*lead, n_tokens, dim)


def quantize_kept(
    cache: np.ndarray,
    heads: np.ndarray,
    positions: np.ndarray,
    bits: int,
    axis: str = "token",
    group_size: int = 32,
    residual: int = 0,
    symmetric: bool = False,
    delta: bool = False,
    zero_point: str = "float",
    partial: str = "full",
) -> np.ndarray:
    """Quantize-dequantize the kept tokens of a cache, read in place: (U, T, D).

    cache (heads, positions, D) is one layer's K or V; result row u holds
    cache[heads[u], positions[u]] (positions (U, T), in cache order) after evicting
    everything else and quantizing what is kept: groups run over the compacted tokens,
    and the last `residual` of them stay exact. With delta=True the result is
    x_hat - x, exactly zero where nothing changed (what the engine adds to exact logits).
    """
    from kvviz.quant.kernel import fake_quantize  # numba: compiled on first use, cached on disk

    if cache.dtype not in (np.float32, np.float64):  # float16 and friends: compute in float32
        return quantize_kept(
            cache.astype(np.float32),
            heads,
            positions,
            bits,
            axis,
            group_size,
            residual,
            symmetric,
            delta,
            zero_point,
            partial,
        ).astype(cache.dtype)
    cache = np.ascontiguousarray(cache)
    # writable as well: numba compiles the kernel again for a read-only array (a second 0.5-1.6 s compile,
    # on disk once per variant); these two are small, so a read-only one is copied
    positions = np.require(positions, dtype=np.int64, requirements=("C", "W"))
    heads = np.require(heads, dtype=np.int64, requirements=("C", "W"))
    n_tokens, dim = positions.shape[1], cache.shape[-1]
    out = np.empty((len(positions), n_tokens, dim), dtype=cache.dtype)
    if bits >= FULL_BITS:
        out[...] = 0 if delta else cache[heads[:, None], positions]
        return out
    n_quant, d_quant, group = quantized_extent(n_tokens, dim, axis, group_size, residual, partial)
    top = cache.dtype.type(2 ** (bits - 1) - 1 if symmetric else 2**bits - 1)
    fake_quantize(
        cache,
        heads,
        positions,
        n_quant,
        axis == "channel",
        group,
        d_quant,
        top,
        symmetric,
        zero_point == "float" and not symmetric,
        delta,
        out,
    )
    return out


def compile_kernel() -> None:
    """Compile the quantization kernels for float32 and float64 caches, or load them from
    numba's on-disk cache (a few seconds the first time after an install or an edit): groups
    by channel, and by token in KIVI's group size (one of the sizes with a per-token kernel of its own)."""
    for dtype in (np.float32, np.float64):
        cache = np.zeros((1, KIVI_GROUP, KIVI_GROUP), dtype=dtype)
        for axis in ("channel", "token"):
            quantize_kept(cache, np.zeros(1, int), np.arange(KIVI_GROUP)[None], 4, axis, KIVI_GROUP, delta=True)


def quant_step(
    x: np.ndarray, bits: int, axis: str = "token", group_size: int = 32, symmetric: bool = False, partial: str = "full"
) -> np.ndarray:
    """The scale s of the group each element of x (..., tokens, dim) falls in (0 where it stays exact).

    Every dequantized element is within s/2 of the original, the bound the tests check.
    """
    n_quant, d_quant, group = quantized_extent(x.shape[-2], x.shape[-1], axis, group_size, 0, partial)
    out = np.zeros(x.shape, dtype=np.float64)
    lead = x.shape[:-2]
    part = x[..., :n_quant, :d_quant]
    for tokens, channels, shape, reduce in _blocks(n_quant, d_quant, axis, group):
        block = part[..., tokens, channels].reshape(*lead, *shape)
        scale, _ = _scale(block, bits, symmetric, reduce)
        out[..., :n_quant, :d_quant][..., tokens, channels] = np.broadcast_to(scale, block.shape).reshape(
            part[..., tokens, channels].shape
        )
    return out


def tensor_bytes(
    n_tokens: int,
    dim: int,
    bits: int,
    axis: str,
    group_size: int,
    residual: int,
    symmetric: bool,
    zero_point: str = "float",
    partial: str = "full",
) -> CacheBytes:
    """Memory of one (kv head's) K or V cache holding n_tokens tokens.

    A quantized group costs b*G bits plus a 16-bit scale and, asymmetric, its zero: a
    16-bit float offset (KIVI) or a b-bit integer zero point. Residual tokens, partial
    groups kept in full precision and bits == 16 cost 16 bits a value.
    """
    if bits >= FULL_BITS:
        return CacheBytes(0.0, 0.0, n_tokens * dim * 2.0)
    n_before = max(0, n_tokens - residual)
    n_res = n_tokens - n_before
    n_quant, d_quant, group = quantized_extent(n_tokens, dim, axis, group_size, residual, partial)
    values = n_quant * d_quant
    n_groups = d_quant * -(-n_quant // group) if axis == "channel" else n_quant * -(-d_quant // group)
    zero_bits = 0 if symmetric else (ZERO_BITS if zero_point == "float" else bits)
    return CacheBytes(
        payload=values * bits / 8,
        overhead=n_groups * (SCALE_BITS + zero_bits) / 8,
        residual=n_res * dim * 2.0,
        partial=(n_before * dim - values) * 2.0,
    )
