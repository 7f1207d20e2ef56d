"""Quantization: the error bound, monotonicity in bits, KIVI's axis choice, memory counts."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvviz.quant import kv_bytes_per_token, quant_step, quantize, quantize_kept, tensor_bytes

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)
# A matrix of up to 40 tokens x 16 channels at 1-8 bits, either axis, groups of 1-40: the error bound's inputs
MATRIX_BITS_AXIS_GROUP = dict(
    x=arrays(np.float64, st.tuples(st.integers(1, 40), st.integers(1, 16)), elements=finite),
    bits=st.integers(1, 8),
    axis=st.sampled_from(["channel", "token"]),
    group=st.integers(1, 40),
)


@given(**MATRIX_BITS_AXIS_GROUP)
def test_error_at_most_half_a_step(x, bits, axis, group):
    x_hat = quantize(x, bits, axis, group)
    s = quant_step(x, bits, axis, group)
    assert np.all(np.abs(x - x_hat) <= s / 2 + 1e-9 * (1 + np.abs(x)))


@given(x=arrays(np.float64, st.tuples(st.integers(2, 40), st.integers(2, 16)), elements=finite), bits=st.integers(2, 8))
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
    err = {
        (b, axis): np.abs(quantize(keys, b, axis, 32) - keys).mean() for b in (2, 4) for axis in ("channel", "token")
    }
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
    # 2 bits with G=32 costs about 3 bits a value (docs/definitions.md: b + 32/G)
    b = tensor_bytes(3200, 64, 2, "token", 32, 0, False)
    assert b.total * 8 / (3200 * 64) == pytest.approx(3.0)


def test_llama2_7b_bytes_per_token():
    assert kv_bytes_per_token(32, 32, 128) == 0.5 * 2**20  # 0.5 MB a token


def _groups(n_quant, dim, axis, group, partial):
    """The index of every quantization group among the first n_quant tokens of a (tokens, dim) matrix."""
    if axis == "channel":
        end = n_quant - n_quant % group if partial == "full" else n_quant
        return [(slice(t, min(t + group, end)), c) for c in range(dim) for t in range(0, end, group)]
    group = min(group, dim)
    end = dim - dim % group if partial == "full" else dim
    return [(t, slice(c, min(c + group, end))) for t in range(n_quant) for c in range(0, end, group)]


def _reference(x, bits, axis, group, residual, symmetric, zero_point="float", partial="full"):
    """The docs/definitions.md formulas, one group at a time with plain loops."""
    out = x.copy()
    for where in _groups(max(0, x.shape[0] - residual), x.shape[1], axis, group, partial):
        g = x[where]
        if symmetric:
            s = np.abs(g).max() / (2 ** (bits - 1) - 1)
            out[where] = s * np.clip(np.round(g / s), -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if s else g
            continue
        s = (g.max() - g.min()) / (2**bits - 1)
        if s == 0:
            continue
        if zero_point == "float":  # KIVI: x_hat = q * s + min
            out[where] = np.clip(np.round((g - g.min()) / s), 0, 2**bits - 1) * s + g.min()
        else:  # integer zero point: x_hat = s * (q - z)
            z = np.round(-g.min() / s)
            out[where] = s * (np.clip(np.round(g / s) + z, 0, 2**bits - 1) - z)
    return out


# A wrong KIVI offset (an integer zero point where the float offset belongs) once failed one random
# run of this test and passed the next: these groups tell the two forms apart at 2 and 3 bits.
KIVI_OFFSET_CASE = np.array([[-2.55, 0.7], [1.34, -0.3], [0.2, 0.11], [-1.0, 2.9], [0.5, -1.7]])
KIVI_OFFSET_GROUPS = dict(x=KIVI_OFFSET_CASE, group=2, symmetric=False)  # asymmetric groups of 2


@given(
    x=arrays(np.float64, st.tuples(st.integers(1, 37), st.integers(1, 20)), elements=finite),
    bits=st.integers(2, 8),
    axis=st.sampled_from(["channel", "token"]),
    group=st.integers(1, 12),
    residual=st.integers(0, 5),
    symmetric=st.booleans(),
    zero_point=st.sampled_from(["float", "int"]),
    partial=st.sampled_from(["full", "quantize"]),
)
@example(**KIVI_OFFSET_GROUPS, bits=2, axis="channel", residual=0, zero_point="float", partial="full")
@example(**KIVI_OFFSET_GROUPS, bits=3, axis="token", residual=1, zero_point="float", partial="quantize")
@example(**KIVI_OFFSET_GROUPS, bits=2, axis="token", residual=0, zero_point="int", partial="full")
def test_matches_reference_formulas(x, bits, axis, group, residual, symmetric, zero_point, partial):
    got = quantize(x, bits, axis, group, residual, symmetric, zero_point=zero_point, partial=partial)
    want = _reference(x, bits, axis, group, residual, symmetric, zero_point, partial)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


def test_kivi_float_offset_stays_inside_the_data_where_an_integer_zero_point_does_not():
    """A 1-bit group spanning [-2.55, 1.34]: KIVI's x_hat = q s + min decodes to the ends of
    the range; a rounded integer zero point decodes to {-3.89, 0}, outside the data."""
    x = np.array([[-2.55], [1.34], [0.2], [-1.0]])
    kivi = quantize(x, 1, "channel", 4)
    np.testing.assert_allclose(np.unique(kivi), [-2.55, 1.34])
    integer = quantize(x, 1, "channel", 4, zero_point="int")
    np.testing.assert_allclose(np.unique(integer), [-3.89, 0.0])


@given(**MATRIX_BITS_AXIS_GROUP)
def test_float_offset_reconstructs_inside_each_group(x, bits, axis, group):
    """x_hat in [min, max] of its group (KIVI's form), checked through the step bound and the range."""
    x_hat = quantize(x, bits, axis, group, partial="quantize")
    lo, hi = x.min(axis=0 if axis == "channel" else 1), x.max(axis=0 if axis == "channel" else 1)
    if (axis == "channel" and x.shape[0] <= group) or (axis == "token" and x.shape[1] <= group):
        tol = 1e-9 * (1 + np.abs(x).max())
        lo_b, hi_b = (lo[None, :], hi[None, :]) if axis == "channel" else (lo[:, None], hi[:, None])
        assert np.all(x_hat >= lo_b - tol) and np.all(x_hat <= hi_b + tol)


def test_float_offset_error_is_below_the_integer_zero_point_error():
    x = np.random.default_rng(5).standard_normal((512, 64)) + 0.37
    for bits in (2, 3, 4):
        kivi = np.abs(quantize(x, bits, "token", 32) - x).mean()
        integer = np.abs(quantize(x, bits, "token", 32, zero_point="int") - x).mean()
        assert kivi < integer


def test_partial_trailing_groups_stay_in_full_precision_and_cost_16_bits():
    x = np.random.default_rng(6).standard_normal((70, 64))
    x_hat = quantize(x, 2, "channel", 32)  # 2 full groups of 32 tokens, then 6 tokens
    np.testing.assert_array_equal(x_hat[64:], x[64:])
    # the two full groups are quantized: every element moves by at most half its group's step s,
    # s = (max - min) / 3 of its 32 tokens of one channel, and a 2-bit grid moves most of them
    s = (x[:64].reshape(2, 32, 64).max(axis=1) - x[:64].reshape(2, 32, 64).min(axis=1)) / 3  # (2, 64)
    err = np.abs(x_hat[:64] - x[:64]).reshape(2, 32, 64)
    assert np.all(err <= s[:, None, :] / 2 + 1e-12)
    assert np.mean(err > 1e-12) > 0.9
    short = quantize(x, 2, "channel", 32, partial="quantize")
    assert np.abs(short[64:] - x[64:]).max() > 0
    b = tensor_bytes(70, 64, 2, "channel", 32, 0, False)
    assert b.payload == 64 * 64 * 2 / 8 and b.partial == 6 * 64 * 2 and b.overhead == 2 * 64 * 4
    b = tensor_bytes(70, 64, 2, "channel", 32, 0, False, partial="quantize")
    assert b.partial == 0 and b.payload == 70 * 64 * 2 / 8 and b.overhead == 3 * 64 * 4
    # per-token groups of 48 channels on a 64-channel head: the last 16 channels stay exact
    y = quantize(x, 2, "token", 48)
    np.testing.assert_array_equal(y[:, 48:], x[:, 48:])
    assert tensor_bytes(10, 64, 2, "token", 48, 0, False).partial == 10 * 16 * 2


def test_each_zero_point_form_reports_its_own_bytes():
    """KIVI stores a 16-bit float offset per group; an integer zero point needs only b bits."""
    kivi = tensor_bytes(64, 64, 2, "channel", 32, 0, False)
    integer = tensor_bytes(64, 64, 2, "channel", 32, 0, False, zero_point="int")
    symmetric = tensor_bytes(64, 64, 2, "channel", 32, 0, True)
    groups = 2 * 64
    assert kivi.overhead == groups * (16 + 16) / 8
    assert integer.overhead == groups * (16 + 2) / 8
    assert symmetric.overhead == groups * 16 / 8


@given(
    seed=st.integers(0, 10_000),
    bits=st.integers(1, 8),
    axis=st.sampled_from(["channel", "token"]),
    group=st.integers(1, 40),
    residual=st.integers(0, 12),
    symmetric=st.booleans(),
    n_kept=st.integers(1, 60),
)
def test_kept_tokens_read_in_place_equal_quantizing_a_gathered_copy(
    seed, bits, axis, group, residual, symmetric, n_kept
):
    """quantize_kept reads the cache at the kept positions; the result must be what
    quantizing the compacted (gathered) cache gives, and delta=True must give x_hat - x."""
    if symmetric and bits < 2:
        bits = 2
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((3, 80, 16)).astype(np.float32)
    cache[:, :, 5] *= 30  # an outlier channel
    heads = rng.integers(0, 3, size=4)
    positions = np.sort(np.stack([rng.choice(80, n_kept, replace=False) for _ in heads]), axis=1)
    gathered = cache[heads[:, None], positions]  # (4, n_kept, 16)
    x_hat = quantize_kept(cache, heads, positions, bits, axis, group, residual, symmetric)
    np.testing.assert_array_equal(x_hat, quantize(gathered, bits, axis, group, residual, symmetric))
    delta = quantize_kept(cache, heads, positions, bits, axis, group, residual, symmetric, delta=True)
    np.testing.assert_array_equal(delta, x_hat - gathered)
    if residual:
        assert np.all(delta[:, max(0, n_kept - residual) :] == 0)  # the residual window is exact


@given(
    x=arrays(
        np.float32,
        st.tuples(st.integers(1, 37), st.integers(1, 20)),
        elements=st.floats(-1e3, 1e3, allow_nan=False, width=32),
    ),
    bits=st.integers(2, 8),
    axis=st.sampled_from(["channel", "token"]),
    group=st.integers(1, 12),
    symmetric=st.booleans(),
)
def test_float32_cache_follows_the_formulas_in_float32(x, bits, axis, group, symmetric):
    """A float32 cache (every real trace) is quantized in float32 arithmetic, step for step
    as the formulas of docs/definitions.md evaluated by numpy on float32 values."""
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = _reference(x, bits, axis, group, 0, symmetric)
    assert expected.dtype == np.float32
    np.testing.assert_array_equal(quantize(x, bits, axis, group, 0, symmetric), expected)


def test_half_precision_cache_is_quantized_in_float32():
    x = np.random.default_rng(3).standard_normal((2, 40, 8)).astype(np.float16)
    got = quantize(x, 3, "channel", 8)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, quantize(x.astype(np.float32), 3, "channel", 8).astype(np.float16))


def test_kivi_residual_keeps_128_exact_and_leaves_one_group_to_quantize_on_a_short_cache():
    from kvviz.quant import KIVI_GROUP, KIVI_RESIDUAL, kivi_residual

    assert (KIVI_RESIDUAL, KIVI_GROUP) == (128, 32)
    assert [kivi_residual(n) for n in (0, 20, 32, 33, 64, 159, 160, 161, 4096)] == [0, 0, 0, 1, 32, 127, 128, 128, 128]


def _reference_step(x, bits, axis, group, symmetric, partial="full"):
    """docs/definitions.md's scale per element of x (tokens, dim), one group at a time: s = (max - min) / (2^b - 1)
    (symmetric: max|x| / (2^(b-1) - 1)) of the group the element falls in, 0 where it stays exact."""
    out = np.zeros(x.shape)
    for where in _groups(x.shape[0], x.shape[1], axis, group, partial):
        g = x[where]
        out[where] = np.abs(g).max() / (2 ** (bits - 1) - 1) if symmetric else (g.max() - g.min()) / (2**bits - 1)
    return out


def _ramp(*shape: int) -> np.ndarray:
    """0, 1, 2, ... to the power 1.5 in `shape`: every group of it has its own min, max and scale."""
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) ** 1.5


# groups of 3 channels at 2 bits, asymmetric, a short last group quantized too
CHANNELS_3_AT_2_BITS = dict(bits=2, axis="channel", group=3, symmetric=False, partial="quantize")


@given(
    x=arrays(
        np.float64,
        st.lists(st.integers(1, 2), max_size=2).flatmap(
            lambda lead: st.tuples(*map(st.just, lead), st.integers(1, 37), st.integers(1, 20))
        ),
        elements=finite,
    ),
    bits=st.integers(2, 8),
    axis=st.sampled_from(["channel", "token"]),
    group=st.integers(1, 12),
    symmetric=st.booleans(),
    partial=st.sampled_from(["full", "quantize"]),
)
@example(x=_ramp(2, 7, 5), **CHANNELS_3_AT_2_BITS)
@example(x=_ramp(2, 7, 5), bits=3, axis="token", group=2, symmetric=True, partial="quantize")
@example(x=_ramp(7, 5), **CHANNELS_3_AT_2_BITS)
@example(x=_ramp(2, 2, 7, 5), **CHANNELS_3_AT_2_BITS)
# a short last group of two tokens: its min and max run over both
@example(x=_ramp(8, 5), **CHANNELS_3_AT_2_BITS)
def test_quant_step_is_each_groups_scale(x, bits, axis, group, symmetric, partial):
    """quant_step gives, per element, exactly the scale s of its group (the bound |x - x_hat| <= s/2 is
    only as strong as s is exact), for a single (tokens, dim) matrix and for every leading (layer / head)
    index on its own."""
    got = quant_step(x, bits, axis, group, symmetric, partial)
    assert got.shape == x.shape
    for i in np.ndindex(x.shape[:-2]):
        np.testing.assert_allclose(
            got[i], _reference_step(x[i], bits, axis, group, symmetric, partial), rtol=1e-14, atol=0
        )


def test_quant_step_defaults_are_those_of_quantize():
    """quant_step(x, b) describes quantize(x, b): per-token groups of 32, asymmetric, a trailing
    group shorter than 32 channels exact (here channels 32..39)."""
    x = np.random.default_rng(10).standard_normal((6, 40))
    np.testing.assert_allclose(quant_step(x, 3), _reference_step(x, 3, "token", 32, False), rtol=1e-14, atol=0)
    assert not quant_step(x, 3)[:, 32:].any()


def test_defaults_are_kivis_per_token_groups_of_32_with_a_float_offset():
    """quantize(x, b) and quantize_kept(cache, heads, positions, b) without options: per-token groups of
    32 channels, no residual, asymmetric with KIVI's float offset (docs/definitions.md), as the formulas give."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((40, 64)) * np.linspace(0.5, 3, 64)
    want = _reference(x, 2, "token", 32, 0, False)
    np.testing.assert_allclose(quantize(x, 2), want, rtol=1e-12, atol=1e-12)
    got = quantize_kept(x[None], np.zeros(1, int), np.arange(40)[None], 2)
    np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)


def test_sixteen_bits_reads_the_kept_tokens_exactly():
    """bits = 16 is 'off': quantize_kept returns the kept rows unchanged, and delta=True exact zeros."""
    cache = np.random.default_rng(8).standard_normal((2, 10, 4))
    heads, positions = np.array([1, 0]), np.array([[0, 3, 9], [2, 5, 6]])
    np.testing.assert_array_equal(quantize_kept(cache, heads, positions, 16), cache[heads[:, None], positions])
    assert not quantize_kept(cache, heads, positions, 16, delta=True).any()


@pytest.mark.parametrize(
    "options",
    [
        dict(symmetric=True),
        dict(delta=True),
        dict(partial="quantize"),
        dict(symmetric=True, delta=True, partial="quantize"),
    ],
)
def test_half_precision_cache_keeps_every_option(options):
    """A float16 cache is computed in float32 with the caller's options, not the defaults."""
    cache = np.random.default_rng(9).standard_normal((2, 23, 8)).astype(np.float16)
    heads, positions = np.array([0, 1]), np.tile(np.arange(0, 23, 2), (2, 1))
    args = (heads, positions, 3, "channel", 5)  # 12 kept tokens: 2 groups of 5, then 2 (partial)
    got = quantize_kept(cache, *args, **options)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, quantize_kept(cache.astype(np.float32), *args, **options).astype(np.float16))


def test_memory_when_everything_is_residual_and_of_short_per_token_groups():
    """A cache shorter than its residual window is all 16-bit residual (no partial group bytes);
    per-token groups of 48 over 64 channels quantized short (partial="quantize"): 2 groups a token."""
    b = tensor_bytes(4, 64, 2, "channel", 32, 10, False)
    assert (b.payload, b.overhead, b.residual, b.partial) == (0, 0, 4 * 64 * 2, 0)
    b = tensor_bytes(10, 64, 2, "token", 48, 0, False, partial="quantize")
    assert (b.payload, b.overhead, b.partial) == (10 * 64 * 2 / 8, 10 * 2 * (16 + 16) / 8, 0)


def test_quantized_extent_by_hand():
    """(tokens quantized, channels quantized, group): by default (partial="full") a trailing group shorter
    than G stays exact: 70 tokens, groups of 32 tokens -> 64; 64 channels, groups of 48 -> 48; a
    residual of 10 leaves 60 tokens -> 32; G above the head dimension is capped at it (token axis)."""
    from kvviz.quant.integer import quantized_extent

    assert quantized_extent(70, 64, "channel", 32, 0) == (64, 64, 32)
    assert quantized_extent(70, 64, "channel", 32, 10) == (32, 64, 32)
    assert quantized_extent(70, 64, "channel", 32, 0, partial="quantize") == (70, 64, 32)
    assert quantized_extent(70, 64, "token", 48, 0) == (70, 48, 48)
    assert quantized_extent(70, 64, "token", 48, 0, partial="quantize") == (70, 64, 48)
    assert quantized_extent(70, 64, "token", 128, 5) == (65, 64, 64)
    assert quantized_extent(4, 64, "token", 32, 10) == (0, 64, 32)


def _kernel_signatures() -> set[str]:
    """'axis dtype heads positions delta' of every compiled quantization kernel (per-token: KIVI's group)."""
    from kvviz.quant.kernel import _by_token, _quantize_by_channel

    return {
        f"{axis} {sig[0].dtype} {sig[1].dtype} {sig[2].dtype} {sig[8]}"
        for axis, k in (("channel", _quantize_by_channel), ("token", _by_token(32)))
        for sig in k.signatures
    }


def test_compile_kernel_compiles_for_float32_and_float64_caches():
    """The app's warm-up: afterwards the kernel holds a compiled version for each cache dtype, with the
    argument types real calls use (int64 heads and positions, a bool delta), the per-token one in KIVI's
    group size. Checked here (where other tests may have compiled some already) and in a fresh process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvviz.quant import compile_kernel

    compile_kernel()
    for axis in ("channel", "token"):
        assert {f"{axis} float32 int64 int64 bool", f"{axis} float64 int64 int64 bool"} <= _kernel_signatures()
    root = Path(__file__).resolve().parents[1]
    probe = (
        "from kvviz.quant import compile_kernel\n"
        "from kvviz.quant.kernel import _by_token, _quantize_by_channel\n"
        "compile_kernel()\n"
        "for name, k in (('channel', _quantize_by_channel), ('token', _by_token(32))):\n"
        "    for sig in k.signatures:\n"
        "        print(name, sig[0].dtype, sig[1].dtype, sig[2].dtype, sig[8])\n"
        "print('token groups compiled', sorted(g for g in (8, 16, 32, 64) if _by_token(g).signatures))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout
    lines = set(out.splitlines())
    for axis in ("channel", "token"):  # the per-token kernel in KIVI's group size, the one the defaults use
        assert {f"{axis} float32 int64 int64 bool", f"{axis} float64 int64 int64 bool"} <= lines
    assert "token groups compiled [32]" in lines


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_per_token_kernel_gives_the_same_bits_with_its_group_size_a_constant_or_an_argument(dtype):
    """Group sizes outside CONSTANT_GROUPS run one kernel that takes the size as an argument (one compile for
    every such size): for a size both kernels take, their results are equal bit for bit, partial group and
    residual included."""
    from kvviz.quant.kernel import CONSTANT_GROUPS, _by_token, _token_kernel

    rng = np.random.default_rng(7)
    cache = rng.standard_normal((3, 50, 72)).astype(dtype)
    heads, positions = np.array([0, 2]), np.stack([np.arange(0, 50, 2), np.arange(1, 50, 2)])
    for group in sorted(CONSTANT_GROUPS):
        assert _by_token(group) is _token_kernel(group) and _by_token(group) is not _token_kernel(0)
        for symmetric, offset, delta in ((False, True, False), (True, False, True), (False, False, False)):
            top = dtype(7 if symmetric else 15)
            outs = []
            for kernel in (_token_kernel(group), _token_kernel(0)):
                out = np.full((2, 25, 72), np.nan, dtype=dtype)
                kernel(cache, heads, positions, 20, 70, top, symmetric, offset, delta, out, group)
                outs.append(out)
            np.testing.assert_array_equal(outs[0], outs[1])
    assert _by_token(24) is _token_kernel(0)
