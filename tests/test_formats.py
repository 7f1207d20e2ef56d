"""FP8 / FP4 cache formats, Hadamard rotation and their byte counts (kvviz.quant.formats).

Exactness where the formats define it: every representable value round-trips, rounding is
to nearest with ties to even, scales never overflow. Rotation: orthonormal, so unquantized
attention is unchanged; on keys with outlier channels it helps per-token quantization.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvviz.attention import softmax
from kvviz.engine import compare, memory_for
from kvviz.quant.base import CacheBytes
from kvviz.quant.formats import flush_point, quantize_tensor, quantize_values, residual_at, tensor_bytes, uses_formats
from kvviz.quant.fp8 import fp8_quantize, fp8_scales
from kvviz.quant.minifloat import E2M1, E4M3, E5M2, e8m0_exponent
from kvviz.quant.mxfp4 import mxfp4_exponents, mxfp4_quantize
from kvviz.quant.nvfp4 import nvfp4_quantize, nvfp4_scales
from kvviz.quant.rotation import hadamard, rotate, unrotate
from kvviz.sources import SyntheticSpec, make_synthetic
from kvviz.spec import Spec, SpecError, View

from test_quant import _reference as reference_quantize  # docs/definitions.md's formulas, a group at a time

FORMATS = [E4M3, E5M2, E2M1]


# --- the codec -------------------------------------------------------------------------------


def test_value_tables_match_the_specs():
    """Counts, largest and smallest magnitudes as the OCP specs give them."""
    e4, e5, e2 = (f.values() for f in FORMATS)
    assert len(e4) == 253 and e4.max() == 448 and e4[e4 > 0].min() == 2.0**-9  # 256 - 2 NaN - (-0)
    assert len(e5) == 247 and e5.max() == 57344 and e5[e5 > 0].min() == 2.0**-16  # 256 - 2 inf - 6 NaN - (-0)
    assert list(e2[e2 >= 0]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_representable_value_round_trips(fmt):
    v = fmt.values()
    assert np.array_equal(fmt.round(v), v)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_ties_go_to_the_even_mantissa(fmt):
    v = fmt.values()
    lo, hi = v[:-1], v[1:]
    mid = (lo + hi) / 2
    want = np.where(fmt.mantissa_is_even(hi), hi, lo)
    want = np.where((lo < 0) & (hi <= 0), np.where(fmt.mantissa_is_even(lo), lo, hi), want)
    got = fmt.round(mid)
    assert np.array_equal(np.abs(got), np.abs(want))
    # just off the midpoint: the nearer neighbour
    eps = (hi - lo) * 1e-6
    assert np.array_equal(fmt.round(mid - eps), lo) and np.array_equal(fmt.round(mid + eps), hi)


@given(x=st.lists(st.floats(-1e5, 1e5, allow_nan=False), min_size=1, max_size=50), which=st.sampled_from(range(3)))
def test_rounding_is_to_the_nearest_value(x, which):
    fmt = FORMATS[which]
    x = np.array(x)
    v = fmt.values()
    best = np.abs(x[:, None] - v[None, :]).min(axis=1)
    assert np.all(np.abs(fmt.round(x) - x) <= best * (1 + 1e-12))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_saturates_never_inf(fmt):
    big = np.array([fmt.max_value * 1.01, 1e300, np.inf, -np.inf, -1e300])
    assert np.array_equal(fmt.round(big), [fmt.max_value, fmt.max_value, fmt.max_value, -fmt.max_value, -fmt.max_value])


# --- the formats with their scales -------------------------------------------------------------


def test_fp8_round_trips_its_values_at_unit_scale():
    for name, fmt in (("e4m3", E4M3), ("e5m2", E5M2)):
        v = fmt.values().reshape(1, -1, 1)  # amax = max value: the scale is exactly 1
        assert np.array_equal(fp8_quantize(v, name, "tensor"), v)


def test_nvfp4_round_trips_every_block_scale_and_value():
    e2 = E2M1.values()
    scales = E4M3.values()[E4M3.values() > 0]
    block = np.concatenate([e2, [6.0]])  # 16 values, amax 6
    x = np.stack([448 * block] + [s * block for s in scales])[None]  # s_t = 1; block i has s_b = s_i
    s_t, s_b = nvfp4_scales(x)
    assert s_t == 1 and np.array_equal(s_b[0, 1:, 0, 0], scales)
    assert np.array_equal(nvfp4_quantize(x.reshape(1, 1, -1)), x.reshape(1, 1, -1))


def test_mxfp4_round_trips_every_value_at_power_of_two_scales():
    e2 = E2M1.values()
    block = np.concatenate([e2, [6.0] * 17])  # 32 values, amax 6
    exps = np.arange(-100, 101, 7)
    x = np.stack([np.ldexp(block, int(e)) for e in exps])[None]  # (1, blocks, 32)
    assert np.array_equal(mxfp4_exponents(x.reshape(1, 1, -1))[0, 0, :, 0], exps)
    assert np.array_equal(mxfp4_quantize(x.reshape(1, 1, -1)), x.reshape(1, 1, -1))


@given(log_amax=st.floats(-40, 37), seed=st.integers(0, 2**16), scale=st.sampled_from(["tensor", "head", "token"]))
def test_scales_never_overflow(log_amax, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 5, 64)) * 10.0**log_amax).astype(np.float32)
    for fmt, f in (("e4m3", E4M3), ("e5m2", E5M2)):
        s = fp8_scales(x, f, scale)
        assert np.all(np.isfinite(s)) and np.all(s > 0)
        assert np.all(np.abs(x / s.astype(np.float64)) <= f.max_value * (1 + 1e-6))
        out = fp8_quantize(x, fmt, scale)
        assert np.all(np.isfinite(out))
    s_t, s_b = nvfp4_scales(x)
    assert np.isfinite(s_t) and np.all(s_b <= 448) and np.all(np.isfinite(s_b))
    assert np.all(np.isfinite(nvfp4_quantize(x)))
    exps = mxfp4_exponents(x)
    assert exps.min() >= -127 and exps.max() <= 127
    assert np.all(np.isfinite(mxfp4_quantize(x)))


def test_all_zero_groups_stay_zero():
    z = np.zeros((2, 3, 64), np.float32)
    for fmt in ("e4m3", "e5m2", "nvfp4", "mxfp4"):
        assert np.array_equal(quantize_values(z, fmt), z)
    assert e8m0_exponent(0.0) == -127


def test_fp8_scale_granularity():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 8)) * np.array([1.0, 100.0])[:, None, None]  # head 1 is 100x larger
    err_tensor = np.abs(fp8_quantize(x, "e4m3", "tensor") - x)[0].max()
    err_head = np.abs(fp8_quantize(x, "e4m3", "head") - x)[0].max()
    assert err_head < err_tensor  # head 0's own scale resolves it better than the shared one
    # relative error per value at most half an ulp of E4M3 (2^-4) for normal values
    x1 = rng.uniform(1, 2, (1, 4, 8)) * np.array([1, -1])[None, None, [0, 1] * 4]
    rel = np.abs(fp8_quantize(x1, "e4m3", "token") - x1) / np.abs(x1)
    assert rel.max() <= 2.0**-4 + 1e-12


# --- bytes --------------------------------------------------------------------------------------


def test_bytes_per_format():
    n, d = 100, 64
    fp8 = tensor_bytes(Spec(key_format="e4m3"), "k", n, d, kv_heads=3, residual=0)
    assert fp8.payload == n * d and fp8.overhead == 4  # one FP32 scale for the head
    assert tensor_bytes(Spec(key_format="e4m3", fp8_scale="token"), "k", n, d, 3, 0).overhead == 4 * n
    assert tensor_bytes(Spec(key_format="e4m3", fp8_scale="tensor"), "k", n, d, 4, 0).overhead == 1
    nv = tensor_bytes(Spec(key_format="nvfp4"), "k", n, d, kv_heads=2, residual=10)
    assert nv.payload == 90 * d / 2 and nv.overhead == 90 * 4 + 2 and nv.residual == 10 * d * 2
    mx = tensor_bytes(Spec(key_format="mxfp4"), "k", n, d, kv_heads=2, residual=0)
    assert mx.payload == n * d / 2 and mx.overhead == n * 2
    assert tensor_bytes(Spec(key_format="e4m3", rotate="keys-values"), "k", n, d, 3, 0) == fp8  # rotation is free


def test_memory_ratios_on_a_trace():
    t = make_synthetic(SyntheticSpec(context=128, steps=2, layers=1, q_heads=2, kv_heads=1, head_dim=64))
    n = t.n_positions
    ratio = lambda **kw: memory_for(t, Spec(**kw), n).ratio  # noqa: E731
    assert ratio(key_format="e4m3", value_format="e4m3") == pytest.approx(0.5 + 8 / (n * 64 * 4))
    assert ratio(key_format="nvfp4", value_format="nvfp4") == pytest.approx(4.5 / 16 + 8 / (n * 64 * 4))
    assert ratio(key_format="mxfp4", value_format="mxfp4") == pytest.approx(4.25 / 16)


# --- spec defaults and the HF residual flush ------------------------------------------------------


def test_defaults_take_the_integer_path():
    s = Spec()
    assert (s.key_format, s.value_format, s.rotate, s.residual_mode) == ("int", "int", "none", "kivi")
    assert not uses_formats(s) and not s.quantizes
    assert Spec(key_format="nvfp4").quantizes and Spec(key_format="nvfp4").quantizes_keys
    assert not Spec(key_format="nvfp4").quantizes_values
    with pytest.raises(SpecError, match="key_format"):
        Spec(key_format="fp6")
    with pytest.raises(SpecError, match="rotate"):
        Spec(rotate="queries")


def test_hf_flush_window():
    s = Spec(key_bits=4, residual=8, residual_mode="hf")
    c = 20
    assert flush_point(s, 10, c) == 11  # inside the prompt: all quantized
    for j in range(30):
        p = c + j
        assert residual_at(s, np.arange(p + 1), p, c) == j % 8 + 1
    assert residual_at(Spec(residual=5), np.arange(50), 49, c) == 5  # kivi: the last `residual`


# --- rotation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 8, 64, 96, 128])
def test_hadamard_is_orthonormal(d):
    h = hadamard(d)
    assert np.allclose(h @ h.T, np.eye(d), atol=1e-12)
    x = np.random.default_rng(d).standard_normal((3, d))
    assert np.allclose(unrotate(rotate(x)), x, atol=1e-12)


def test_rotation_leaves_unquantized_attention_unchanged():
    t = make_synthetic(SyntheticSpec(context=96, steps=4, layers=1, q_heads=4, kv_heads=2, head_dim=64))
    q, k = t.q[0].astype(np.float64), t.k[0].astype(np.float64)  # keys with outlier channels
    kk = np.repeat(k, 2, axis=0)
    a = softmax(q @ kk.transpose(0, 2, 1) / 8.0)
    a_rot = softmax(rotate(q) @ rotate(kk).transpose(0, 2, 1) / 8.0)
    assert np.abs(a - a_rot).max() < 1e-6
    # and the engine at full precision with rotation on is the plain engine
    view = View(ensemble="heads", ensemble_size=4)
    base, rot = compare(t, Spec(), view), compare(t, Spec(rotate="keys-values"), view)
    for m0, m1 in zip(base.members, rot.members):
        assert np.abs(m0.compressed - m1.compressed).max() < 1e-6


def _rounding_bound(y: np.ndarray, spec: Spec, which: str) -> np.ndarray:
    """The largest error each element of y (U, T, D) may get from the spec's format, derived from
    the format's definition: half the integer step s/2; half the FP8 quantum at |y| (relative
    2^-(mbits+1), or half the smallest subnormal); for the FP4 formats (E2M1: gaps of at most 2,
    so at most 1 scale unit inside the range) one block scale for NVFP4 (its E4M3-rounded block
    scale can let x / s pass 6 by at most 6 * 2^-4 / (1 - 2^-4) < 1) and two for MXFP4 (amax / 2^X
    lies in [4, 8): saturating at 6 costs at most 2)."""
    from kvviz.quant import integer
    from kvviz.quant.formats import settings
    from kvviz.quant.mxfp4 import MXFP4_BLOCK
    from kvviz.quant.nvfp4 import NVFP4_BLOCK, blocked

    fmt, bits, axis, _ = settings(spec, which)
    d = y.shape[-1]
    if fmt == "int":
        return integer.quant_step(y, bits, axis, spec.group_size, spec.symmetric, spec.partial) / 2
    if fmt in ("e4m3", "e5m2"):
        f = {"e4m3": E4M3, "e5m2": E5M2}[fmt]
        s = fp8_scales(y, f, spec.fp8_scale).astype(np.float64)
        return s * np.maximum(np.abs(y) / s * 2.0 ** -(f.mbits + 1), 2.0 ** (f.min_exponent - f.mbits - 1))
    if fmt == "nvfp4":
        s_t, s_b = nvfp4_scales(y)
        per_block = np.broadcast_to(s_b * float(s_t), blocked(y, NVFP4_BLOCK).shape)
    else:
        per_block = np.broadcast_to(2 * np.ldexp(1.0, mxfp4_exponents(y)), blocked(y, MXFP4_BLOCK).shape)
    return per_block.reshape(*y.shape[:-1], -1)[..., :d]


def test_rotation_composes_with_every_format_and_axis():
    """K_hat = Q(K R) R^T for every format: the quantizer of the rotated keys, rotated back; the residual
    is exact; R is orthonormal, so each token's error is exactly its rounding error in the rotated basis,
    which stays within the format's own bound (_rounding_bound)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 40, 64)).astype(np.float32)
    x[..., 5] += 30  # an outlier channel
    for fmt in ("int", "e4m3", "e5m2", "nvfp4", "mxfp4"):
        for axis in ("channel", "token"):
            spec = Spec(key_format=fmt, key_bits=4, key_axis=axis, group_size=16, rotate="keys")
            out = quantize_tensor(x, spec, "k", residual=8)
            assert out.dtype == x.dtype and out.shape == x.shape
            assert np.array_equal(out[:, -8:], x[:, -8:])  # the residual stays exact
            y = rotate(x[:, :-8])  # the rotated basis
            q = quantize_tensor(y, spec.with_(rotate="none"), "k", residual=0)
            np.testing.assert_allclose(out[:, :-8], unrotate(q), rtol=0, atol=1e-4)  # composition
            rounding = q.astype(np.float64) - y  # the error where it is made
            err = out[:, :-8].astype(np.float64) - x[:, :-8]
            np.testing.assert_allclose(
                np.linalg.norm(err, axis=-1), np.linalg.norm(rounding, axis=-1), rtol=1e-4, atol=1e-4
            )  # orthonormal: norms kept
            bound = _rounding_bound(y.astype(np.float64), spec, "k")
            assert np.all(np.abs(rounding) <= bound * (1 + 1e-5) + 1e-5), (fmt, axis)
            assert np.abs(rounding).max() > 0, (fmt, axis)  # 4 bits / FP8 / FP4 round something


def test_rotation_helps_per_token_keys_with_outlier_channels():
    """The synthetic source has 4 key outlier channels: per-token key groups put each outlier in a
    group with ordinary channels, whose values then round to the group minimum. Rotated first, the
    outliers are spread over all channels and per-token keys lose less (mean TV over heads, both
    layers, two steps): at 2 bits (0.87 -> 0.72 here) and far more at 3 bits (0.82 -> 0.29)."""
    t = make_synthetic(SyntheticSpec(context=256, steps=4, layers=2, q_heads=4, kv_heads=2, head_dim=64))

    def tv(bits, rot):
        spec = Spec(key_bits=bits, key_axis="token", group_size=32, rotate=rot)
        return float(
            np.mean(
                [
                    compare(t, spec, View(layer=layer, step=step, ensemble="heads", ensemble_size=4)).metrics_mean[
                        "tv_distance"
                    ]
                    for layer in (0, 1)
                    for step in (0, 3)
                ]
            )
        )

    assert tv(2, "keys") < 0.9 * tv(2, "none")
    assert tv(3, "keys") < 0.5 * tv(3, "none")


def test_fp8_beats_fp4_beats_2bit_per_token_on_attention():
    t = make_synthetic(SyntheticSpec(context=128, steps=2, layers=1, q_heads=2, kv_heads=1, head_dim=64))
    view = View(ensemble="heads", ensemble_size=2)
    tv = {
        name: compare(t, spec, view).metrics_mean["tv_distance"]
        for name, spec in {
            "e4m3": Spec(key_format="e4m3"),
            "nvfp4": Spec(key_format="nvfp4"),
            "int2-token": Spec(key_bits=2, key_axis="token"),
        }.items()
    }
    assert 0 < tv["e4m3"] < tv["nvfp4"] < tv["int2-token"], tv


# --- command line ---------------------------------------------------------------------------------


def test_cli_formats(capsys):
    import json

    from cli_util import SYNTHETIC_64

    from kvviz.cli import main

    base = ["compare", *SYNTHETIC_64, "--steps", "2", "--layers", "1", "--json"]
    assert (
        main(base + ["--key-format", "e4m3", "--value-format", "nvfp4", "--fp8-scale", "token", "--rotate", "keys"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert (
        out["spec"]["key_format"],
        out["spec"]["value_format"],
        out["spec"]["fp8_scale"],
        out["spec"]["rotate"],
    ) == ("e4m3", "nvfp4", "token", "keys")
    assert 0 < out["metrics"]["tv_distance"] and out["metrics"]["memory_ratio"] < 0.5
    assert main(base + ["--quant-preset", "hf-qc-4bit"]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert (spec["key_axis"], spec["group_size"], spec["residual"], spec["residual_mode"]) == ("token", 64, 128, "hf")
    assert main(base + ["--residual-mode", "hf", "--residual", "4", "--bits", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["spec"]["residual_mode"], out["spec"]["residual"], out["spec"]["key_bits"]) == ("hf", 4, 4)
    t = make_synthetic(SyntheticSpec(context=64, steps=2, layers=1))
    want = compare(t, Spec(residual_mode="hf", residual=4, key_bits=4, value_bits=4)).metrics["tv_distance"]
    assert out["metrics"]["tv_distance"] == pytest.approx(want, rel=1e-12) and want > 0


def test_rotation_figure_and_effect():
    from kvviz.plots.quant import key_rotation_figure
    from kvviz.quant.formats import rotation_effect

    t = make_synthetic(SyntheticSpec(context=64, steps=2, layers=1, q_heads=2, kv_heads=1, head_dim=64))
    k = t.k[0, 0].astype(np.float64)
    effect = rotation_effect(k)
    assert effect["peak_after"] < effect["peak_before"] and effect["error_after"] < effect["error_before"]
    fig = key_rotation_figure(k[10:], rotate(k[10:]), t.tokens[10:], first_position=10)
    before, after = fig.data
    assert before.z.shape == (64, len(k) - 10) and before.x[0] == 10
    assert np.allclose(after.z, rotate(k[10:]).T) and before.zmin == -before.zmax == after.zmin


# --- the quantizer a spec routes to, checked against the formulas (mutation testing) ----


def _reference_tensor(x, spec, which, residual, rotated):
    """K_hat (or V_hat) of x (U, T, D) from docs/definitions.md alone: per head, the plain-loop integer
    quantizer of the first T - residual tokens, in the Hadamard basis when `rotated`."""
    bits = spec.key_bits if which == "k" else spec.value_bits
    axis = spec.key_axis if which == "k" else spec.value_axis
    x = x.astype(np.float64)
    y = rotate(x) if rotated else x
    q = np.stack(
        [
            reference_quantize(h, bits, axis, spec.group_size, residual, spec.symmetric, spec.zero_point, spec.partial)
            for h in y
        ]
    )
    if rotated:  # only the quantized tokens were rotated; the residual ones are x itself
        n = max(0, x.shape[1] - residual)
        q[:, :n] = unrotate(q[:, :n])
        q[:, n:] = x[:, n:]
    return q


@pytest.mark.parametrize("rotate_", ["none", "keys", "keys-values"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_integer_tensor_is_the_design_formulas_with_every_setting(rotate_, which):
    """quantize_tensor on the integer format equals the plain-loop quantizer of docs/definitions.md for every
    setting the spec carries (bits, axis, group, symmetric, integer zero point, partial groups), for
    any residual (none, all but one token, all of them, more than there are), keys rotated under
    rotate 'keys' / 'keys-values' and values only under 'keys-values'."""
    rng = np.random.default_rng(25)
    x = rng.standard_normal((2, 13, 12))
    x[..., 3] += 6.0  # an outlier channel
    rotated = rotate_ == "keys-values" or (which == "k" and rotate_ == "keys")
    settings_ = [
        dict(bits=3, axis="channel", group_size=4),  # 13 tokens: a partial group kept
        dict(bits=2, axis="token", group_size=5),  # 12 channels: 5 + 5 + 2 left
        dict(bits=4, axis="channel", group_size=4, partial="quantize"),
        dict(bits=2, axis="token", group_size=5, partial="quantize"),
        dict(bits=3, axis="token", group_size=6, symmetric=True),
        dict(bits=2, axis="channel", group_size=3, zero_point="int"),
    ]
    for s in settings_:
        bits, axis, rest = s.pop("bits"), s.pop("axis"), s
        spec = Spec(
            **{f"{'key' if which == 'k' else 'value'}_bits": bits, f"{'key' if which == 'k' else 'value'}_axis": axis},
            rotate=rotate_,
            **rest,
        )
        for residual in (0, 2, 12, 13, 20):
            got = quantize_tensor(x, spec, which, residual)
            want = _reference_tensor(x, spec, which, residual, rotated)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=f"{s} {bits} {axis} r={residual}")
            assert np.array_equal(got[:, 13 - min(residual, 13) :], x[:, 13 - min(residual, 13) :])  # residual exact
            if residual == 0:
                assert not np.array_equal(got[:, 0], x[:, 0])  # the first token is quantized


def test_a_tensor_at_full_precision_comes_back_as_it_is():
    """16-bit integer keys / values are not quantized, rotation on or off: x itself, not a rotated and
    rotated-back copy (which is x only up to rounding)."""
    x = np.random.default_rng(1).standard_normal((2, 9, 64)).astype(np.float32)
    for which in ("k", "v"):
        for rot in ("none", "keys", "keys-values"):
            out = quantize_tensor(x, Spec(rotate=rot, residual=0), which, 0)
            assert np.array_equal(out, x), (which, rot)
    assert not np.array_equal(unrotate(rotate(x)), x)  # the round trip is not exact


def test_fp8_scale_per_token_reaches_the_quantizer():
    """fp8_scale 'token' gives each token its own FP32 scale: tokens of magnitudes 1 down to 1e-6 in one
    head all keep E4M3's relative error of at most 2^-4 (half an ulp of 3 mantissa bits, normal
    values); one scale for the head pushes the small tokens into the subnormals (larger error)."""
    rng = np.random.default_rng(4)
    x = rng.uniform(1, 2, (1, 7, 16)) * (10.0 ** -np.arange(7))[None, :, None]
    x *= np.where(np.arange(16) % 2, -1, 1)

    def rel(scale):
        return np.abs(quantize_tensor(x, Spec(key_format="e4m3", fp8_scale=scale), "k", 0) - x) / np.abs(x)

    assert rel("token").max() <= 2.0**-4 + 1e-12
    assert rel("head").max() > 2.0**-4


def test_unknown_format_names_the_choices():
    with pytest.raises(
        ValueError, match=r"^unknown format 'fp6'; choose one of int, e4m3, e5m2, nvfp4, mxfp4, q8_0, q4_0$"
    ):
        quantize_values(np.zeros((1, 2, 16)), "fp6")


def test_integer_bytes_through_the_formats_path():
    """The integer format's bytes when the spec goes through the formats path (rotation on), by hand from
    docs/definitions.md: b*G bits a group plus a 16-bit scale and a 16-bit float offset (a b-bit integer
    zero point, nothing when symmetric); 100 tokens of 64 channels, 10 residual at 16 bits."""
    n, d = 100, 64

    def b(which="k", **kw):
        return tensor_bytes(Spec(rotate="keys-values", **kw), which, n, d, kv_heads=3, residual=10)

    # per channel, groups of 32 tokens: 90 quantized tokens = 2 whole groups (64 tokens) + 26 kept at 16 bits
    got = b(key_bits=2, key_axis="channel", group_size=32)
    assert got == CacheBytes(payload=64 * 64 * 2 / 8, overhead=2 * 64 * 4, residual=10 * 64 * 2, partial=26 * 64 * 2)
    got = b(key_bits=2, key_axis="channel", group_size=32, partial="quantize")  # 3 groups, the last of 26
    assert got == CacheBytes(payload=90 * 64 * 2 / 8, overhead=3 * 64 * 4, residual=10 * 64 * 2)
    assert b(key_bits=2, key_axis="channel", group_size=32, symmetric=True).overhead == 2 * 64 * 2
    assert b(key_bits=2, key_axis="channel", group_size=32, zero_point="int").overhead == 2 * 64 * (16 + 2) / 8
    # per token, groups of 16 channels: 4 groups a token
    assert b(key_bits=4, key_axis="token", group_size=16) == CacheBytes(
        payload=90 * 64 * 4 / 8, overhead=90 * 4 * 4, residual=10 * 64 * 2
    )
    assert b("v", value_bits=3, value_axis="token", group_size=64) == CacheBytes(
        payload=90 * 64 * 3 / 8, overhead=90 * 4, residual=10 * 64 * 2
    )


def test_fp8_bytes_for_both_fp8_formats_and_an_all_residual_cache():
    """E4M3 and E5M2 both store a byte a value and one FP32 scale a head; a cache shorter than the
    residual window is all at 16 bits, with no payload and no scale."""
    for fmt in ("e4m3", "e5m2"):
        assert tensor_bytes(Spec(key_format=fmt), "k", 100, 64, 3, residual=10) == CacheBytes(
            payload=90 * 64, overhead=4, residual=10 * 64 * 2
        )
        assert tensor_bytes(Spec(key_format=fmt), "k", 5, 64, 3, residual=8) == CacheBytes(
            payload=0, overhead=0, residual=5 * 64 * 2
        )


def test_hf_flush_window_of_one_and_kivi_against_hf():
    """residual 1 (or 0, read as 1) under 'hf': every token is flushed as it arrives, so at every decode step
    only the newest is exact; 'kivi' keeps its last `residual` where HF's window would hold fewer; with
    heads holding different tokens, the fewest exact over the heads."""
    c = 20
    for r in (0, 1):
        s = Spec(key_bits=4, residual=r, residual_mode="hf")
        assert [residual_at(s, np.arange(c + j + 1), c + j, c) for j in range(6)] == [1] * 6
    kivi = Spec(key_bits=4, residual=5)
    assert residual_at(kivi, np.arange(48), 47, c) == 5  # hf's window at p 47 would hold 3 (45..47)
    assert residual_at(kivi.with_(residual_mode="hf"), np.arange(48), 47, c) == 3
    hf = Spec(key_bits=4, residual=8, residual_mode="hf")  # p 30: the window starts at 28
    kept = np.array([[0, 5, 27, 28, 29, 30], [1, 2, 3, 4, 29, 30]])
    assert residual_at(hf, kept, 30, c) == 2  # head 0 has 3 exact, head 1 has 2


def test_residual_for_memory_in_both_modes():
    """The full-precision tokens the memory counts when n tokens have arrived (prompt of 20):
    kivi the last `residual` of the kept; hf the flush window, (n - 21) mod 8 + 1 after the prompt
    and none inside it."""
    from kvviz.quant.formats import spec_residual_for_memory

    c = 20
    kivi = Spec(key_format="e4m3", residual=8)
    assert [spec_residual_for_memory(kivi, kept, 40, c) for kept in (30, 5)] == [8, 5]
    hf = kivi.with_(residual_mode="hf")
    got = [spec_residual_for_memory(hf, 100, n, c) for n in range(5, 45)]
    assert got == [0 if n <= c else (n - c - 1) % 8 + 1 for n in range(5, 45)]
    assert spec_residual_for_memory(hf, 3, 27, c) == 3  # never more than is kept


def test_hf_quantized_cache_preset_is_transformers_defaults():
    """transformers' QuantizedCache defaults (nbits 4, q_group_size 64, residual_length 128, axis 0:
    per-token groups, keys and values alike, every group quantized): a 64-channel token is one group,
    4 * 64 bits + a 16-bit scale + a 16-bit offset = 36 bytes; a 96-channel token is two groups (the
    second of 32 channels, quantized too): 48 + 8 bytes."""
    from kvviz.quant.formats import hf_quantized_cache

    s = hf_quantized_cache()
    assert (s.key_bits, s.value_bits, s.key_axis, s.value_axis, s.group_size, s.residual, s.residual_mode) == (
        4,
        4,
        "token",
        "token",
        64,
        128,
        "hf",
    )
    for which in ("k", "v"):
        assert tensor_bytes(s, which, 200, 64, 3, residual=0) == CacheBytes(
            payload=200 * 32, overhead=200 * 4, residual=0
        )
        assert tensor_bytes(s, which, 10, 96, 3, residual=0) == CacheBytes(payload=10 * 48, overhead=10 * 8, residual=0)
    two = hf_quantized_cache(2, residual_length=16, sink=4)
    assert (two.key_bits, two.value_bits, two.residual, two.sink) == (2, 2, 16, 4)
    with pytest.raises(ValueError, match=r"^QuantizedCache's quanto backend takes nbits 2 or 4, got 3$"):
        hf_quantized_cache(3)


def test_rotation_effect_values_from_the_formulas():
    """rotation_effect by hand: the largest channel's max |k| over the median channel's, before and after
    the Hadamard rotation, and ||K_hat - K|| / ||K|| of 2-bit per-token keys in groups of 32 channels
    (docs/definitions.md's quantizer), quantized as they are or rotated first. Keys stored as float32 and
    small (norm < 1) give the float64 figures of the same keys."""
    from kvviz.quant.formats import rotation_effect

    t = make_synthetic(SyntheticSpec(context=48, steps=2, layers=1, q_heads=2, kv_heads=1, head_dim=64))
    k = t.k[0, 0] * np.float32(1e-3)  # float32, ||k|| < 1
    k64 = k.astype(np.float64)
    assert np.linalg.norm(k64) < 1 and np.median(np.abs(k64).max(axis=0)) < 1

    def peak(x):
        amax = np.abs(x).max(axis=0)
        return amax.max() / np.median(amax)

    plain = reference_quantize(k64, 2, "token", 32, 0, False)
    rotated = unrotate(reference_quantize(rotate(k64), 2, "token", 32, 0, False))
    want = {
        "peak_before": peak(k64),
        "peak_after": peak(rotate(k64)),
        "error_before": np.linalg.norm(plain - k64) / np.linalg.norm(k64),
        "error_after": np.linalg.norm(rotated - k64) / np.linalg.norm(k64),
    }
    got = rotation_effect(k)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=0), name
    assert 0 < got["error_after"] < got["error_before"]
    # 3 bits, groups of 16: other settings, other figures
    got3 = rotation_effect(k, bits=3, group=16)
    plain3 = reference_quantize(k64, 3, "token", 16, 0, False)
    assert got3["error_before"] == pytest.approx(np.linalg.norm(plain3 - k64) / np.linalg.norm(k64), rel=1e-12)
    # a 48-channel head: the last 16-channel group of a 32-channel grouping is quantized too (partial)
    k48 = k64[:, :48]
    part = reference_quantize(k48, 2, "token", 32, 0, False, partial="quantize")
    assert rotation_effect(k48)["error_before"] == pytest.approx(
        np.linalg.norm(part - k48) / np.linalg.norm(k48), rel=1e-12
    )


# --- the codecs' own functions, checked against the specs (mutation testing) -------------


def _sylvester(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix (n a power of two), entries +-1, from its definition entry by
    entry: H[i, j] = (-1)^popcount(i & j)."""
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return (-1.0) ** np.vectorize(lambda v: bin(v).count("1"))(i & j)


@pytest.mark.parametrize("dim", [1, 2, 3, 12, 40, 64, 96])
def test_hadamard_is_the_block_diagonal_sylvester_matrix(dim):
    """hadamard(dim): blocks of the Sylvester matrix of the largest power of two dividing dim (12 -> 4,
    40 -> 8, 96 -> 32), normalised by 1/sqrt of the block size. The cache is cleared first, so the
    matrix is built here, not taken from an earlier test."""
    n = max(2**k for k in range(8) if dim % 2**k == 0)
    block = _sylvester(n) / np.sqrt(n)
    want = np.zeros((dim, dim))
    for b in range(dim // n):
        want[b * n : (b + 1) * n, b * n : (b + 1) * n] = block
    hadamard.cache_clear()
    np.testing.assert_allclose(hadamard(dim), want, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="^the head dimension must be at least 1, got 0$"):
        hadamard(0)


def test_rotate_and_unrotate_keep_float_dtypes_and_read_integers_as_float64():
    """rotate / unrotate return float32 for float32 keys and float64 for float64 ones; integer keys are
    rotated as float64 (R cast to an integer type would be all zeros): x R and x R^T by hand."""
    keys_f64 = np.random.default_rng(7).standard_normal((2, 5, 12))  # (U, T, D), D = 3 blocks of 4
    r = hadamard(12)
    for fn, matrix in ((rotate, r), (unrotate, r.T)):
        assert fn(keys_f64).dtype == np.float64
        np.testing.assert_allclose(fn(keys_f64), keys_f64 @ matrix, rtol=0, atol=1e-12)
        keys_f32 = keys_f64.astype(np.float32)
        assert fn(keys_f32).dtype == np.float32
        np.testing.assert_allclose(fn(keys_f32), keys_f32.astype(np.float64) @ matrix, rtol=0, atol=1e-5)
        keys_int = np.arange(2 * 5 * 12).reshape(2, 5, 12) - 50
        assert fn(keys_int).dtype == np.float64
        np.testing.assert_allclose(fn(keys_int), keys_int @ matrix, rtol=0, atol=1e-12)
        keys_f16 = keys_f64.astype(np.float16)
        assert fn(keys_f16).dtype == np.float64  # not float32 / 64: read as float64
        np.testing.assert_allclose(fn(keys_f16), keys_f16.astype(np.float64) @ matrix, rtol=0, atol=1e-12)


# A plain reference of the OCP formats, from their definitions alone: every finite value of a format with
# `ebits` / `mbits` / `bias` (exponent field 0: subnormals m / 2^mbits * 2^(1 - bias)), up to its largest
# finite value; rounding to the nearest one, ties to the one with an even mantissa m, saturating.
SPEC_FORMATS = {"e4m3": (4, 3, 7, 448.0), "e5m2": (5, 2, 15, 57344.0), "e2m1": (2, 1, 1, 6.0)}


def _spec_table(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(magnitudes >= 0 sorted, whether each has an even mantissa) of the format `name`."""
    ebits, mbits, bias, top = SPEC_FORMATS[name]
    table = {}
    for e in range(2**ebits):
        for m in range(2**mbits):
            v = m / 2**mbits * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
            if v <= top:
                table[v] = m % 2 == 0
    mags = np.array(sorted(table))
    return mags, np.array([table[v] for v in mags])


def _spec_round(x, name: str) -> np.ndarray:
    """x rounded to the format `name` by search in its table: nearest, ties to even, saturating."""
    mags, even = _spec_table(name)
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), mags[-1])
    hi = np.clip(np.searchsorted(mags, a), 1, len(mags) - 1)
    lo = hi - 1
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(even[lo], lo, hi)))
    return np.copysign(mags[pick], x)


def _fp32_up(v: float) -> float:
    """v as an FP32 number, the next one up where FP32 cannot hold v exactly (a scale never rounds down)."""
    s = np.float32(v)
    return float(np.nextafter(s, np.float32(np.inf)) if float(s) < v else s)


def _reference_mxfp4(x: np.ndarray, block: int) -> np.ndarray:
    """OCP MX v1.0 MXFP4, a block at a time: X = floor(log2 amax) - 2 clamped to [-127, 127] (a block of
    zeros stays zeros), x_hat = 2^X round_e2m1(x / 2^X); the last block of a row may be short."""
    out = np.zeros(x.shape)
    for idx in np.ndindex(x.shape[:-1]):
        for start in range(0, x.shape[-1], block):
            v = x[idx][start : start + block].astype(np.float64)
            amax = float(np.abs(v).max())
            if amax == 0:
                continue
            e8m0 = min(max(math.frexp(amax)[1] - 1, -127), 127)  # floor(log2 amax), 8-bit field
            exp = min(max(e8m0 - 2, -127), 127)
            out[idx][start : start + block] = _spec_round(v / 2.0**exp, "e2m1") * 2.0**exp
    return out


def test_mxfp4_is_the_ocp_definition_block_by_block():
    """mxfp4_quantize against the plain reference: several heads and tokens (each token's blocks have their
    own scale), 40 channels (a full block of 32 and a short one of 8, zero-padded), magnitudes from 2^-30 to
    2^10, one token so small (2^-128 < amax < 2^-125) that its exponent is clamped at -127, a block of zeros;
    float32 stays float32; block 16 honoured."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 6, 40)) * 2.0 ** rng.integers(-30, 11, (2, 6, 1))  # (U, T, D)
    x[0, 1] = rng.standard_normal(40) * 2.0**-127  # X clamped at -127
    x[1, 2, 32:] = 0.0  # the short block all zeros
    for block in (32, 16):
        np.testing.assert_array_equal(mxfp4_quantize(x, block), _reference_mxfp4(x, block))
    np.testing.assert_array_equal(mxfp4_quantize(x), _reference_mxfp4(x, 32))
    x32 = x.astype(np.float32)
    got = mxfp4_quantize(x32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _reference_mxfp4(x32, 32).astype(np.float32))
    exps = mxfp4_exponents(x)
    assert exps.shape == (2, 6, 2, 1)  # (U, T, blocks, 1)
    assert exps[0, 1, 0, 0] == -127


def test_e8m0_exponent_is_floor_log2_clamped_to_the_8_bit_field():
    """floor(log2 x) for x > 0, -127 (the smallest code) for x <= 0, and clamped to [-127, 127]."""
    x = np.array([1.0, 1.5, 2.0, 0.75, 2.0**-126, 2.0**-127, 2.0**-200, 5e-324, 2.0**127, 2.0**200, 0.0, -3.0])
    want = [0, 0, 1, -1, -126, -127, -127, -127, 127, 127, -127, -127]
    np.testing.assert_array_equal(e8m0_exponent(x), want)


def test_mxfp4_bytes_count_a_scale_byte_for_a_short_block():
    """Half a byte a value, one E8M0 byte a block; 40 channels are two blocks (32 + 8)."""
    from kvviz.quant.mxfp4 import mxfp4_bytes

    assert mxfp4_bytes(10, 40) == (200.0, 20.0)
    assert mxfp4_bytes(10, 64) == (320.0, 20.0)
    assert mxfp4_bytes(10, 40, block=16) == (200.0, 30.0)


def _reference_fp8(x: np.ndarray, name: str, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(x_hat, the scale of every value) of FP8 `name` with one scale per tensor, KV head or token of x
    (U, T, D): s = amax / the format's largest value, as FP32 rounded up, 1 for a group of zeros;
    x_hat = s * round(x / s)."""
    top = SPEC_FORMATS[name][3]
    groups = {
        "tensor": [(...,)],
        "head": [(u,) for u in range(x.shape[0])],
        "token": [(u, t) for u in range(x.shape[0]) for t in range(x.shape[1])],
    }[scale]
    s = np.ones(x.shape)
    for g in groups:
        amax = float(np.abs(x[g]).max())
        s[g] = _fp32_up(amax / top) if amax > 0 else 1.0
    x = x.astype(np.float64)
    return s * _spec_round(x / s, name), s


def test_fp8_is_the_definition_for_every_scale():
    """fp8_quantize and fp8_scales against the plain reference, for both formats and the three scale
    granularities: values far below 1 (so no group's amax reaches 1), heads 100x apart, a token and a
    whole head of zeros (scale 1); the scales are FP32 and shaped to broadcast against (U, T, D)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 5, 24)) * np.array([1e-3, 1e-5, 1.0])[:, None, None]  # (U, T, D)
    x[0, 2] = 0.0  # a token of zeros
    x[2] = 0.0  # a head of zeros
    shapes = {"tensor": (1, 1, 1), "head": (3, 1, 1), "token": (3, 5, 1)}
    for name in ("e4m3", "e5m2"):
        for scale in ("tensor", "head", "token"):
            want, want_s = _reference_fp8(x, name, scale)
            s = fp8_scales(x, {"e4m3": E4M3, "e5m2": E5M2}[name], scale)
            assert s.dtype == np.float32 and s.shape == shapes[scale], (name, scale)
            np.testing.assert_array_equal(np.broadcast_to(s, x.shape), want_s, err_msg=f"{name} {scale}")
            np.testing.assert_array_equal(fp8_quantize(x, name, scale), want, err_msg=f"{name} {scale}")
        got32 = fp8_quantize(x.astype(np.float32), name, "head")
        assert got32.dtype == np.float32
        np.testing.assert_array_equal(got32, _reference_fp8(x.astype(np.float32), name, "head")[0].astype(np.float32))
        np.testing.assert_array_equal(fp8_quantize(x, name), fp8_quantize(x, name, "head"))  # the default: per head
    assert np.all(fp8_scales(x, E4M3, "head")[2] == 1) and np.all(fp8_scales(x, E4M3, "token")[0, 2] == 1)


def test_fp8_quantizes_a_head_with_no_tokens_and_names_the_scales():
    """No tokens yet: an empty result (the amax of nothing is 0, scale 1), for the scales over many
    values; an unknown scale is refused with the choices named."""
    for scale in ("tensor", "head", "token", "static"):
        assert fp8_quantize(np.zeros((2, 0, 8)), "e4m3", scale).shape == (2, 0, 8)
    with pytest.raises(
        ValueError, match=r"^FP8 scale must be one of \('tensor', 'head', 'token', 'static'\), got 'row'$"
    ):
        fp8_scales(np.ones((1, 2, 8)), E4M3, "row")


def _reference_nvfp4(x: np.ndarray, block: int) -> tuple[float, np.ndarray]:
    """(s_t, x_hat) of NVFP4 on the tensor x (..., D), a block of `block` channels at a time: s_t = amax /
    (448 * 6) as FP32 rounded up (1 for a tensor of zeros), s_b = round_e4m3(amax_block / (6 s_t)),
    x_hat = s_t s_b round_e2m1(x / (s_t s_b)), zeros where s_b underflows to 0."""
    amax = float(np.abs(x).max())
    s_t = _fp32_up(amax / (448 * 6)) if amax > 0 else 1.0
    out = np.zeros(x.shape)
    for idx in np.ndindex(x.shape[:-1]):
        for start in range(0, x.shape[-1], block):
            v = x[idx][start : start + block].astype(np.float64)
            s = float(_spec_round(np.abs(v).max() / (6 * s_t), "e4m3")) * s_t
            out[idx][start : start + block] = s * _spec_round(v / s, "e2m1") if s > 0 else 0.0
    return s_t, out


def test_nvfp4_is_the_two_level_definition():
    """nvfp4_quantize against the plain reference: a tensor whose amax is far below 1, 40 channels (blocks of
    16, 16 and a short 8, zero-padded), blocks of 8 too; one block so small against the tensor that its E4M3
    scale underflows to 0 (zeros, and no division by that 0 is attempted); float32 stays float32; the block
    scales are shaped (U, T, blocks, 1)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 4, 40)) * 2.0 ** rng.integers(-12, -2, (2, 4, 1))  # (U, T, D), amax < 1
    x[1, 3, :16] = 1e-9  # s_b underflows to 0
    with np.errstate(divide="raise", invalid="raise"):
        for block in (16, 8):
            s_t, want = _reference_nvfp4(x, block)
            np.testing.assert_array_equal(nvfp4_quantize(x, block), want, err_msg=f"block {block}")
            assert float(nvfp4_scales(x, block)[0]) == s_t
        assert nvfp4_scales(x)[1].shape == (2, 4, 3, 1) and nvfp4_scales(x)[1][1, 3, 0, 0] == 0
        np.testing.assert_array_equal(nvfp4_quantize(x), _reference_nvfp4(x, 16)[1])
        got32 = nvfp4_quantize(x.astype(np.float32))
        assert got32.dtype == np.float32
        np.testing.assert_array_equal(got32, _reference_nvfp4(x.astype(np.float32), 16)[1].astype(np.float32))
        s_t, s_b = nvfp4_scales(np.zeros((2, 3, 16)))  # a tensor of zeros: s_t 1, every s_b 0
        assert s_t == 1 and s_t.dtype == np.float32 and np.array_equal(s_b, np.zeros((2, 3, 1, 1)))


def test_nvfp4_bytes_count_a_scale_byte_for_a_short_block_and_nothing_for_no_tokens():
    """Half a byte a value, one E4M3 byte a block (40 channels: 16 + 16 + 8, three blocks) and the FP32
    tensor scale shared by the layer's KV heads; no quantized token, no bytes at all."""
    from kvviz.quant.nvfp4 import nvfp4_bytes

    assert nvfp4_bytes(10, 40, kv_heads=2) == (200.0, 30.0 + 2.0)
    assert nvfp4_bytes(10, 64, kv_heads=4) == (320.0, 40.0 + 1.0)
    assert nvfp4_bytes(0, 64, kv_heads=2) == (0.0, 0.0)


def test_rounding_reads_any_number_as_float64():
    """Minifloat.round and e8m0_exponent take numbers of any type as float64: an int8 -128 (whose np.abs
    overflows in int8) saturates like -128.0, a Python int past int64 like the float it is."""
    ints = np.array([-128, 127, 5, 3, 0], dtype=np.int8)
    np.testing.assert_array_equal(E2M1.round(ints), [-6, 6, 4, 3, 0])
    np.testing.assert_array_equal(E2M1.round(ints), _spec_round(ints.astype(np.float64), "e2m1"))
    assert E4M3.round(2**200) == 448 and E5M2.round(-(2**70)) == -57344
    assert e8m0_exponent(2**200) == 127 and e8m0_exponent(3) == 1
