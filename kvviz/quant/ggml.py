"""llama.cpp's K/V cache formats, q8_0 and q4_0 (`--cache-type-k q8_0`, ollama's OLLAMA_KV_CACHE_TYPE).

Both cut each token's head_dim channels into blocks of 32 consecutive values and store one fp16
scale d per block, as ggml-quants.c defines them (computed in float32, as llama.cpp copies the
float32 K / V rows into its cache):

    q8_0   d = amax / 127,   q = roundf(x / d)            in -127..127,  x_hat = q * fp16(d)
           34 bytes per block: fp16 d + 32 int8
    q4_0   m = the value of largest |x| (its sign kept; the first such value on a tie),
           d = m / -8,       q = min(15, trunc(x / d + 8.5)) in 0..15,  x_hat = (q - 8) * fp16(d)
           18 bytes per block: fp16 d + 32 4-bit values (low nibbles: values 0-15, high: 16-31)

roundf rounds half away from zero; x / d is x times the float32 reciprocal 1 / d, not a division,
and the stored scale is d rounded to fp16 (the quantized values use the unrounded d). A block of
zeros has d = 0 and comes back as zeros. Q4_0 is asymmetric in a way int4 is not: the largest
value maps to -8 * d exactly, the other side reaches at most 7 * d.

A head_dim that is not a multiple of 32 cannot be stored by llama.cpp; here the last block is
padded with zeros (the padding changes no scale) and counted as a whole block of bytes.
`encode` / `decode` give the bytes themselves, laid out as gguf's reference
(`gguf.quants.quantize`) lays them out, so the tests compare them bit for bit.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
GGML_FORMATS = ("q8_0", "q4_0")
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}  # 34 and 18


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (numpy's round takes halves to even)."""
    a = np.abs(x)
    floored = np.floor(a)
    return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def _blocks(x: np.ndarray) -> tuple[np.ndarray, int]:
    """x (..., D) as float32 blocks (..., nb, 32), the last padded with zeros; and D."""
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    pad = -D % BLOCK
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad), np.float32)], axis=-1)
    return x.reshape(*x.shape[:-1], -1, BLOCK), D


def _reciprocal(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def quantize_blocks(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """x (..., D) -> (fp16 scales (..., nb), integer codes (..., nb, 32)): q8_0 in -127..127, q4_0 in 0..15."""
    b, _ = _blocks(x)
    if fmt == "q8_0":
        d = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)  # (..., nb)
        q = _roundf(b * _reciprocal(d)[..., None]).astype(np.int16)
    elif fmt == "q4_0":
        i = np.abs(b).argmax(axis=-1)[..., None]  # first largest |x|
        m = np.take_along_axis(b, i, axis=-1)[..., 0]
        d = (m / np.float32(-8)).astype(np.float32)
        q = np.trunc(b * _reciprocal(d)[..., None] + np.float32(8.5)).astype(np.int16).clip(0, 15)
    else:
        raise ValueError(f"unknown llama.cpp format {fmt!r}; choose one of {', '.join(GGML_FORMATS)}")
    return d.astype(np.float16), q


def dequantize_blocks(d: np.ndarray, q: np.ndarray, fmt: str, dim: int) -> np.ndarray:
    """The float32 values (..., dim) of fp16 scales d (..., nb) and codes q (..., nb, 32)."""
    centred = q.astype(np.float32) - (8 if fmt == "q4_0" else 0)
    x = centred * d.astype(np.float32)[..., None]
    return x.reshape(*x.shape[:-2], -1)[..., :dim]


def ggml_quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """Quantize-dequantize every token of x (..., D) along D in q8_0 / q4_0; same dtype as x."""
    d, q = quantize_blocks(x, fmt)
    return dequantize_blocks(d, q, fmt, x.shape[-1]).astype(np.asarray(x).dtype)


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """The bytes llama.cpp stores for x (..., D): (..., nb * block bytes) uint8, as gguf lays them out."""
    d, q = quantize_blocks(x, fmt)
    scale = d.view(np.uint8).reshape(*d.shape, 2)  # little-endian fp16
    if fmt == "q8_0":
        codes = q.astype(np.int8).view(np.uint8)
    else:
        u = q.astype(np.uint8)
        codes = u[..., : BLOCK // 2] | (u[..., BLOCK // 2 :] << np.uint8(4))
    out = np.concatenate([scale, codes], axis=-1)
    return out.reshape(*out.shape[:-2], -1)


def decode(data: np.ndarray, fmt: str, dim: int | None = None) -> np.ndarray:
    """float32 values (..., D) of llama.cpp's bytes (..., nb * block bytes); dim trims a padded last block."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    blocks = data.reshape(*data.shape[:-1], -1, BLOCK_BYTES[fmt])
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    codes = blocks[..., 2:]
    if fmt == "q8_0":
        q = codes.view(np.int8).astype(np.int16)
    else:
        q = np.concatenate([codes & np.uint8(0x0F), codes >> np.uint8(4)], axis=-1).astype(np.int16)
    n = blocks.shape[-2] * BLOCK
    return dequantize_blocks(d, q, fmt, n if dim is None else dim)


def ggml_bytes(n_quant: int, dim: int, fmt: str) -> tuple[float, float]:
    """(payload, scale bytes) of n_quant tokens of one KV head: per block of 32, 32 (q8_0) or 16 (q4_0)
    bytes of codes and 2 of fp16 scale."""
    blocks = n_quant * -(-dim // BLOCK)
    return float(blocks * (BLOCK_BYTES[fmt] - 2)), float(blocks * 2)


__all__ = ["BLOCK", "BLOCK_BYTES", "GGML_FORMATS", "decode", "encode", "ggml_bytes", "ggml_quantize", "quantize_blocks"]
