"""Quantization: the error bound, monotonicity in bits, KIVI's axis choice, memory counts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvviz.quant import kv_bytes_per_token, quant_step, quantize, quantize_kept, tensor_bytes

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=80, deadline=None)
@given(x=arrays(np.float64, st.tuples(st.integers(1, 40), st.integers(1, 16)), elements=finite),
       bits=st.integers(1, 8), axis=st.sampled_from(["channel", "token"]), group=st.integers(1, 40))
def test_error_at_most_half_a_step(x, bits, axis, group):
    x_hat = quantize(x, bits, axis, group)
    s = quant_step(x, bits, axis, group)
    assert np.all(np.abs(x - x_hat) <= s / 2 + 1e-9 * (1 + np.abs(x)))


@settings(max_examples=40, deadline=None)
@given(x=arrays(np.float64, st.tuples(st.integers(2, 40), st.integers(2, 16)), elements=finite),
       bits=st.integers(2, 8))
def test_symmetric_error_bound(x, bits):
    x_hat = quantize(x, bits, "token", 8, symmetric=True)
    s = quant_step(x, bits, "token", 8, symmetric=True)
    assert np.all(np.abs(x - x_hat) <= s / 2 + 1e-9 * (1 + np.abs(x)))


def test_error_falls_as_bits_rise():
    x = np.random.default_rng(0).standard_normal((256, 64))
    errors = [np.abs(quantize(x, b, "token", 32) - x).mean() for b in range(1, 9)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert quantize(x, 16) is x  # 16 bits = off


def test_residual_tokens_untouched():
    x = np.random.default_rng(1).standard_normal((100, 16))
    x_hat = quantize(x, 2, "channel", 32, residual=10)
    np.testing.assert_array_equal(x_hat[-10:], x[-10:])
    assert np.abs(x_hat[:-10] - x[:-10]).max() > 0


def test_per_channel_beats_per_token_on_outlier_keys():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((512, 64))
    keys[:, [3, 17]] = 20 + rng.standard_normal((512, 2))  # outlier channels, as real keys have
    err = {(b, axis): np.abs(quantize(keys, b, axis, 32) - keys).mean()
           for b in (2, 4) for axis in ("channel", "token")}
    assert err[2, "channel"] < 0.7 * err[2, "token"]
    assert err[4, "channel"] < 0.5 * err[4, "token"]


def test_memory_by_hand():
    # 100 tokens x 64 channels at 4 bits, per-channel groups of 32 tokens, residual 4:
    # 96 quantized tokens -> 3 groups per channel -> 192 groups x (16 + 16) bits overhead.
    b = tensor_bytes(100, 64, 4, "channel", 32, 4, False)
    assert b.payload == 96 * 64 * 4 / 8
    assert b.overhead == 192 * 4
    assert b.residual == 4 * 64 * 2
    # per-token groups of 32 channels, symmetric: 2 groups a token, 16-bit scale only
    b = tensor_bytes(10, 64, 2, "token", 32, 0, True)
    assert (b.payload, b.overhead, b.residual) == (10 * 64 * 2 / 8, 20 * 2, 0)
    assert tensor_bytes(10, 64, 16, "token", 32, 0, False).total == 10 * 64 * 2
    # 2 bits with G=32 costs about 3 bits a value (DESIGN: b + 32/G)
    b = tensor_bytes(3200, 64, 2, "token", 32, 0, False)
    assert b.total * 8 / (3200 * 64) == pytest.approx(3.0)


def test_llama2_7b_bytes_per_token():
    assert kv_bytes_per_token(32, 32, 128) == 0.5 * 2**20  # 0.5 MB a token


def _reference(x, bits, axis, group, residual, symmetric):
    """The DESIGN.md formulas, one group at a time with plain loops."""
    out = x.copy()
    n_quant = max(0, x.shape[0] - residual)
    cells = ([[(slice(t, min(t + group, n_quant)), c) for t in range(0, n_quant, group)] for c in range(x.shape[1])]
             if axis == "channel" else
             [[(t, slice(c, min(c + group, x.shape[1]))) for c in range(0, x.shape[1], group)] for t in range(n_quant)])
    for row in cells:
        for where in row:
            g = x[where]
            if symmetric:
                s = np.abs(g).max() / (2 ** (bits - 1) - 1)
                out[where] = s * np.clip(np.round(g / s), -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if s else g
            else:
                s = (g.max() - g.min()) / (2 ** bits - 1)
                if s == 0:
                    continue
                z = np.round(-g.min() / s)
                out[where] = s * (np.clip(np.round(g / s) + z, 0, 2 ** bits - 1) - z)
    return out


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float64, st.tuples(st.integers(1, 37), st.integers(1, 20)), elements=finite),
       bits=st.integers(2, 8), axis=st.sampled_from(["channel", "token"]), group=st.integers(1, 12),
       residual=st.integers(0, 5), symmetric=st.booleans())
def test_matches_reference_formulas(x, bits, axis, group, residual, symmetric):
    n_quant = max(0, x.shape[0] - residual)
    g = min(group, n_quant if axis == "channel" else x.shape[1]) if n_quant else group
    np.testing.assert_allclose(quantize(x, bits, axis, group, residual, symmetric),
                               _reference(x, bits, axis, g, residual, symmetric), rtol=1e-12, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.integers(1, 8), axis=st.sampled_from(["channel", "token"]),
       group=st.integers(1, 40), residual=st.integers(0, 12), symmetric=st.booleans(),
       n_kept=st.integers(1, 60))
def test_kept_tokens_read_in_place_equal_quantizing_a_gathered_copy(seed, bits, axis, group, residual,
                                                                    symmetric, n_kept):
    """quantize_kept reads the cache at the kept positions; the result must be what
    quantizing the compacted (gathered) cache gives, and delta=True must give x_hat - x."""
    if symmetric and bits < 2:
        bits = 2
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((3, 80, 16)).astype(np.float32)
    cache[:, :, 5] *= 30                                        # an outlier channel
    heads = rng.integers(0, 3, size=4)
    positions = np.sort(np.stack([rng.choice(80, n_kept, replace=False) for _ in heads]), axis=1)
    gathered = cache[heads[:, None], positions]                 # (4, n_kept, 16)
    x_hat = quantize_kept(cache, heads, positions, bits, axis, group, residual, symmetric)
    np.testing.assert_array_equal(x_hat, quantize(gathered, bits, axis, group, residual, symmetric))
    delta = quantize_kept(cache, heads, positions, bits, axis, group, residual, symmetric, delta=True)
    np.testing.assert_array_equal(delta, x_hat - gathered)
    if residual:
        assert np.all(delta[:, max(0, n_kept - residual):] == 0)  # the residual window is exact


@settings(max_examples=40, deadline=None)
@given(x=arrays(np.float32, st.tuples(st.integers(1, 37), st.integers(1, 20)),
                elements=st.floats(-1e3, 1e3, allow_nan=False, width=32)),
       bits=st.integers(2, 8), axis=st.sampled_from(["channel", "token"]), group=st.integers(1, 12),
       symmetric=st.booleans())
def test_float32_cache_follows_the_formulas_in_float32(x, bits, axis, group, symmetric):
    """A float32 cache (every real trace) is quantized in float32 arithmetic, step for step
    as the DESIGN formulas evaluated by numpy on float32 values."""
    g = min(group, x.shape[0] if axis == "channel" else x.shape[1])
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = _reference(x, bits, axis, g, 0, symmetric)
    assert expected.dtype == np.float32
    np.testing.assert_array_equal(quantize(x, bits, axis, group, 0, symmetric), expected)



def test_half_precision_cache_is_quantized_in_float32():
    x = np.random.default_rng(3).standard_normal((2, 40, 8)).astype(np.float16)
    got = quantize(x, 3, "channel", 8)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, quantize(x.astype(np.float32), 3, "channel", 8).astype(np.float16))
