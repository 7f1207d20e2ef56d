"""FP8 / FP4 cache formats, Hadamard rotation and their byte counts (kvviz.quant.formats).

Exactness where the formats define it: every representable value round-trips, rounding is
to nearest with ties to even, scales never overflow. Rotation: orthonormal, so unquantized
attention is unchanged; on keys with outlier channels it helps per-token quantization.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvviz.attention import softmax
from kvviz.engine import compare, memory_for
from kvviz.quant.formats import (flush_point, quantize_tensor, quantize_values, residual_at, tensor_bytes,
                                 uses_formats)
from kvviz.quant.fp8 import fp8_quantize, fp8_scales
from kvviz.quant.minifloat import E2M1, E4M3, E5M2, e8m0_exponent
from kvviz.quant.mxfp4 import mxfp4_exponents, mxfp4_quantize
from kvviz.quant.nvfp4 import nvfp4_quantize, nvfp4_scales
from kvviz.quant.rotation import hadamard, rotate, unrotate
from kvviz.sources import SyntheticSpec, make_synthetic
from kvviz.spec import Spec, SpecError, View

FORMATS = [E4M3, E5M2, E2M1]


# --- the codec -------------------------------------------------------------------------------

def test_value_tables_match_the_specs():
    """Counts, largest and smallest magnitudes as the OCP specs give them."""
    e4, e5, e2 = (f.values() for f in FORMATS)
    assert len(e4) == 253 and e4.max() == 448 and e4[e4 > 0].min() == 2.0 ** -9    # 256 - 2 NaN - (-0)
    assert len(e5) == 247 and e5.max() == 57344 and e5[e5 > 0].min() == 2.0 ** -16  # 256 - 2 inf - 6 NaN - (-0)
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


@given(x=st.lists(st.floats(-1e5, 1e5, allow_nan=False), min_size=1, max_size=50),
       which=st.sampled_from(range(3)))
def test_rounding_is_to_the_nearest_value(x, which):
    fmt = FORMATS[which]
    x = np.array(x)
    v = fmt.values()
    best = np.abs(x[:, None] - v[None, :]).min(axis=1)
    assert np.all(np.abs(fmt.round(x) - x) <= best * (1 + 1e-12))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_saturates_never_inf(fmt):
    big = np.array([fmt.max_value * 1.01, 1e300, np.inf, -np.inf, -1e300])
    assert np.array_equal(fmt.round(big), [fmt.max_value, fmt.max_value, fmt.max_value, -fmt.max_value,
                                           -fmt.max_value])


# --- the formats with their scales -------------------------------------------------------------

def test_fp8_round_trips_its_values_at_unit_scale():
    for name, fmt in (("e4m3", E4M3), ("e5m2", E5M2)):
        v = fmt.values().reshape(1, -1, 1)          # amax = max value: the scale is exactly 1
        assert np.array_equal(fp8_quantize(v, name, "tensor"), v)


def test_nvfp4_round_trips_every_block_scale_and_value():
    e2 = E2M1.values()
    scales = E4M3.values()[E4M3.values() > 0]
    block = np.concatenate([e2, [6.0]])                                        # 16 values, amax 6
    x = np.stack([448 * block] + [s * block for s in scales])[None]          # s_t = 1; block i has s_b = s_i
    s_t, s_b = nvfp4_scales(x)
    assert s_t == 1 and np.array_equal(s_b[0, 1:, 0, 0], scales)
    assert np.array_equal(nvfp4_quantize(x.reshape(1, 1, -1)), x.reshape(1, 1, -1))


def test_mxfp4_round_trips_every_value_at_power_of_two_scales():
    e2 = E2M1.values()
    block = np.concatenate([e2, [6.0] * 17])                                   # 32 values, amax 6
    exps = np.arange(-100, 101, 7)
    x = np.stack([np.ldexp(block, int(e)) for e in exps])[None]               # (1, blocks, 32)
    assert np.array_equal(mxfp4_exponents(x.reshape(1, 1, -1))[0, 0, :, 0], exps)
    assert np.array_equal(mxfp4_quantize(x.reshape(1, 1, -1)), x.reshape(1, 1, -1))


@given(log_amax=st.floats(-40, 37), seed=st.integers(0, 2 ** 16), scale=st.sampled_from(["tensor", "head", "token"]))
def test_scales_never_overflow(log_amax, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 5, 64)) * 10.0 ** log_amax).astype(np.float32)
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
    x = rng.standard_normal((2, 6, 8)) * np.array([1.0, 100.0])[:, None, None]   # head 1 is 100x larger
    err_tensor = np.abs(fp8_quantize(x, "e4m3", "tensor") - x)[0].max()
    err_head = np.abs(fp8_quantize(x, "e4m3", "head") - x)[0].max()
    assert err_head < err_tensor          # head 0's own scale resolves it better than the shared one
    # relative error per value at most half an ulp of E4M3 (2^-4) for normal values
    x1 = rng.uniform(1, 2, (1, 4, 8)) * np.array([1, -1])[None, None, [0, 1] * 4]
    rel = np.abs(fp8_quantize(x1, "e4m3", "token") - x1) / np.abs(x1)
    assert rel.max() <= 2.0 ** -4 + 1e-12


# --- bytes --------------------------------------------------------------------------------------

def test_bytes_per_format():
    n, d = 100, 64
    fp8 = tensor_bytes(Spec(key_format="e4m3"), "k", n, d, kv_heads=3, residual=0)
    assert fp8.payload == n * d and fp8.overhead == 4             # one FP32 scale for the head
    assert tensor_bytes(Spec(key_format="e4m3", fp8_scale="token"), "k", n, d, 3, 0).overhead == 4 * n
    assert tensor_bytes(Spec(key_format="e4m3", fp8_scale="tensor"), "k", n, d, 4, 0).overhead == 1
    nv = tensor_bytes(Spec(key_format="nvfp4"), "k", n, d, kv_heads=2, residual=10)
    assert nv.payload == 90 * d / 2 and nv.overhead == 90 * 4 + 2 and nv.residual == 10 * d * 2
    mx = tensor_bytes(Spec(key_format="mxfp4"), "k", n, d, kv_heads=2, residual=0)
    assert mx.payload == n * d / 2 and mx.overhead == n * 2
    assert tensor_bytes(Spec(key_format="e4m3", rotate="keys-values"), "k", n, d, 3, 0) == fp8   # rotation is free


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
    assert flush_point(s, 10, c) == 11                         # inside the prompt: all quantized
    for j in range(30):
        p = c + j
        assert residual_at(s, np.arange(p + 1), p, c) == j % 8 + 1
    assert residual_at(Spec(residual=5), np.arange(50), 49, c) == 5   # kivi: the last `residual`


# --- rotation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 8, 64, 96, 128])
def test_hadamard_is_orthonormal(d):
    h = hadamard(d)
    assert np.allclose(h @ h.T, np.eye(d), atol=1e-12)
    x = np.random.default_rng(d).standard_normal((3, d))
    assert np.allclose(unrotate(rotate(x)), x, atol=1e-12)


def test_rotation_leaves_unquantized_attention_unchanged():
    t = make_synthetic(SyntheticSpec(context=96, steps=4, layers=1, q_heads=4, kv_heads=2, head_dim=64))
    q, k = t.q[0].astype(np.float64), t.k[0].astype(np.float64)           # keys with outlier channels
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
    x[..., 5] += 30                                                           # an outlier channel
    for fmt in ("int", "e4m3", "e5m2", "nvfp4", "mxfp4"):
        for axis in ("channel", "token"):
            spec = Spec(key_format=fmt, key_bits=4, key_axis=axis, group_size=16, rotate="keys")
            out = quantize_tensor(x, spec, "k", residual=8)
            assert out.dtype == x.dtype and out.shape == x.shape
            assert np.array_equal(out[:, -8:], x[:, -8:])                    # the residual stays exact
            y = rotate(x[:, :-8])                                             # the rotated basis
            q = quantize_tensor(y, spec.with_(rotate="none"), "k", residual=0)
            np.testing.assert_allclose(out[:, :-8], unrotate(q), rtol=0, atol=1e-4)   # composition
            rounding = q.astype(np.float64) - y                               # the error where it is made
            err = out[:, :-8].astype(np.float64) - x[:, :-8]
            np.testing.assert_allclose(np.linalg.norm(err, axis=-1), np.linalg.norm(rounding, axis=-1),
                                       rtol=1e-4, atol=1e-4)                 # orthonormal: norms kept
            bound = _rounding_bound(y.astype(np.float64), spec, "k")
            assert np.all(np.abs(rounding) <= bound * (1 + 1e-5) + 1e-5), (fmt, axis)
            assert np.abs(rounding).max() > 0, (fmt, axis)                   # 4 bits / FP8 / FP4 round something


def test_rotation_helps_per_token_keys_with_outlier_channels():
    """The synthetic source has 4 key outlier channels: per-token key groups put each outlier in a
    group with ordinary channels, whose values then round to the group minimum. Rotated first, the
    outliers are spread over all channels and per-token keys lose less (mean TV over heads, both
    layers, two steps): at 2 bits (0.87 -> 0.72 here) and far more at 3 bits (0.82 -> 0.29)."""
    t = make_synthetic(SyntheticSpec(context=256, steps=4, layers=2, q_heads=4, kv_heads=2, head_dim=64))

    def tv(bits, rot):
        spec = Spec(key_bits=bits, key_axis="token", group_size=32, rotate=rot)
        return float(np.mean([compare(t, spec, View(layer=layer, step=step, ensemble="heads", ensemble_size=4))
                              .metrics_mean["tv_distance"] for layer in (0, 1) for step in (0, 3)]))

    assert tv(2, "keys") < 0.9 * tv(2, "none")
    assert tv(3, "keys") < 0.5 * tv(3, "none")


def test_fp8_beats_fp4_beats_2bit_per_token_on_attention():
    t = make_synthetic(SyntheticSpec(context=128, steps=2, layers=1, q_heads=2, kv_heads=1, head_dim=64))
    view = View(ensemble="heads", ensemble_size=2)
    tv = {name: compare(t, spec, view).metrics_mean["tv_distance"] for name, spec in {
        "e4m3": Spec(key_format="e4m3"), "nvfp4": Spec(key_format="nvfp4"),
        "int2-token": Spec(key_bits=2, key_axis="token")}.items()}
    assert 0 < tv["e4m3"] < tv["nvfp4"] < tv["int2-token"], tv


# --- command line ---------------------------------------------------------------------------------

def test_cli_formats(capsys):
    import json

    from kvviz.cli import main

    base = ["compare", "--source", "synthetic", "--context", "64", "--steps", "2", "--layers", "1", "--json"]
    assert main(base + ["--key-format", "e4m3", "--value-format", "nvfp4", "--fp8-scale", "token",
                        "--rotate", "keys"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["spec"]["key_format"], out["spec"]["value_format"], out["spec"]["fp8_scale"],
            out["spec"]["rotate"]) == ("e4m3", "nvfp4", "token", "keys")
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
