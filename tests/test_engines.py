"""What serving engines do: llama.cpp's q8_0 / q4_0 K/V formats bit for bit against gguf's
reference, vLLM's static FP8 scales (1.0 or calibrated) and what they saturate, and the cache at its peak."""

import dataclasses
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvviz import Spec, View, compare, links
from kvviz.analysis.ledger import budget_ledger
from kvviz.analysis.readout import fp8_clipping, fp8_clipping_note, memory_peak_text
from kvviz.cli import main
from kvviz.memory import memory_for
from kvviz.quant import formats as qformats
from kvviz.quant import ggml
from kvviz.quant.fp8 import calibrate, clipped
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

GGUF = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}


def awkward(shape, seed=0) -> np.ndarray:
    """Heavy-tailed values with the cases a rounding rule decides: an all-zero block, exact halves (roundf
    takes them away from zero, numpy's round to even), two values tied for the largest |x| with opposite
    signs (q4_0 keeps the first), and fp16-subnormal scales."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.lognormal(0, 2, shape)).astype(np.float32)
    x[0, 0, :32] = 0
    x[0, 1, :32] = np.arange(32) - 15.5  # q8_0: d = 16.5 / 127 ... and halves for q4_0
    x[0, 2, :32] = np.float32(127) * np.float32(0.5) / np.float32(127)
    x[0, 2, 0] = 127  # d = 1: every 0.5 is a tie
    x[0, 3, :32] = 0.0
    x[0, 3, 4], x[0, 3, 9] = 7.0, -7.0  # a tie for the largest |x|
    x[1, 0, :32] *= 1e-7  # scales below fp16's normal range
    return x


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_round_trip_is_gguf_bit_for_bit(fmt):
    x = awkward((3, 40, 64))
    assert np.array_equal(ggml.encode(x, fmt), quantize(x, GGUF[fmt]))  # the bytes
    want = dequantize(quantize(x, GGUF[fmt]), GGUF[fmt])
    got = ggml.ggml_quantize(x, fmt)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(ggml.decode(ggml.encode(x, fmt), fmt).view(np.uint32), want.view(np.uint32))
    half = x.astype(np.float16)  # an fp16 cache: cast to float32 first, as gguf
    assert np.array_equal(
        ggml.ggml_quantize(half, fmt).astype(np.float32),
        dequantize(quantize(half, GGUF[fmt]), GGUF[fmt]).astype(np.float16).astype(np.float32),
    )


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_head_dim_off_the_block_is_padded_with_zeros(fmt):
    x = awkward((2, 5, 48), seed=1)
    padded = np.concatenate([x, np.zeros((2, 5, 16), np.float32)], axis=-1)
    want = dequantize(quantize(padded, GGUF[fmt]), GGUF[fmt])[..., :48]
    assert np.array_equal(ggml.ggml_quantize(x, fmt).view(np.uint32), want.view(np.uint32))
    assert ggml.ggml_bytes(5, 48, fmt) == ggml.ggml_bytes(5, 64, fmt)  # two whole blocks a token


def test_block_bytes_are_llama_cpps():
    assert ggml.BLOCK_BYTES == {"q8_0": 34, "q4_0": 18}
    for fmt, per_block in ggml.BLOCK_BYTES.items():
        payload, scales = ggml.ggml_bytes(10, 64, fmt)
        assert scales == 10 * 2 * 2 and payload + scales == 10 * 2 * per_block
    b = qformats.tensor_bytes(Spec(key_format="q4_0"), "k", 10, 64, 1, residual=3)
    assert (b.payload, b.overhead, b.residual) == (7 * 2 * 16, 7 * 2 * 2, 3 * 64 * 2)


def test_compare_reports_llama_cpp_bytes_and_q8_loses_less(capsys):
    def run(k, v):
        assert main(["compare", "--key-format", k, "--value-format", v, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["metrics"]

    m = run("q4_0", "q8_0")
    values = m["kv_bytes_full"] / 4  # K (or V) values: 2 bytes each, half the full cache
    assert m["key_bytes"] == values / 32 * 18 and m["value_bytes"] == values / 32 * 34
    assert m["kv_bytes"] == values / 32 * (18 + 34)
    q8, q4 = run("q8_0", "q8_0"), run("q4_0", "q4_0")
    assert q8["tv_distance"] < q4["tv_distance"] and q8["output_rel_error"] < q4["output_rel_error"]
    assert 0 < q8["tv_distance"]


# --- static FP8 --------------------------------------------------------------------------------

SMALL = SyntheticSpec(context=96, steps=4, layers=2, q_heads=4, kv_heads=2, head_dim=64, outlier_channels=2)
STATIC = Spec(key_format="e4m3", value_format="e4m3", fp8_scale="static")


@pytest.fixture(scope="module")
def outlier_trace():
    """The synthetic keys with one channel of layer 0 pushed to ±600 in every third token: a key outlier
    channel past E4M3's 448."""
    t = make_synthetic(SMALL)
    k = np.array(t.k, copy=True)
    k[0, :, ::3, 5] = np.where(k[0, :, ::3, 5] < 0, -600.0, 600.0)
    return dataclasses.replace(t, k=k)


def test_the_uncalibrated_preset_saturates_above_448_and_says_how_many(outlier_trace):
    from kvviz.app.presets import preset_values

    spec = links.spec_from_values(preset_values("vLLM FP8 (uncalibrated)", outlier_trace.n_positions))
    assert spec == STATIC.with_(partial="quantize")  # (partial groups: integer formats only)
    t = outlier_trace
    p = int(t.query_positions[t.evaluated_queries[-1]])
    want = int((np.abs(t.k[:, :, : p + 1]) > 448).sum())
    assert want == t.n_kv_heads * len(range(0, p + 1, 3))  # the outlier channel, nothing else
    counts = fp8_clipping(t, spec)
    assert counts["k"]["saturated"] == want and counts["k"]["values"] == t.k[:, :, : p + 1].size
    assert counts["v"]["saturated"] == 0
    k_hat = qformats.quantize_tensor(t.k[0, :, : p + 1], spec, "k", 0)
    assert set(np.unique(k_hat[:, ::3, 5]).tolist()) <= {-448.0, 448.0}  # stored as the format's max
    assert f"{want:,} of the {t.k[:, :, : p + 1].size:,} stored keys saturated" in fp8_clipping_note(counts)


def test_calibrated_scales_are_the_contexts_amax_and_fix_later_tokens(outlier_trace):
    t = outlier_trace
    c = t.context_len
    spec = STATIC.with_(fp8_calibrate=True)
    s = calibrate(t.k[0][:, :c], "e4m3")
    assert s == pytest.approx(600 / 448, rel=1e-7) and np.float32(s) == s
    assert qformats.layer_static_scale(spec, "k", t.k[0][:, :c]) == s
    counts = fp8_clipping(t, spec)
    assert counts["k"]["saturated"] == 0 and counts["k"]["scales"][0] == s
    # a later token past the context's amax saturates: the scale was fixed at the context
    late = np.array(t.k[0, :, c : c + 2], copy=True)
    late[..., 5] = 900.0
    assert clipped(late, "e4m3", "static", s)[0] == late.shape[0] * late.shape[1]
    fresh = qformats.quantize_tensor(late, spec.with_(fp8_scale="head", fp8_calibrate=False), "k", 0)
    assert np.abs(fresh[..., 5]).max() == pytest.approx(900.0, rel=0.07)  # a per-head amax scale does not


def test_uncalibrated_fp8_flushes_small_values_and_saturation_costs_attention(outlier_trace):
    """A scale below 1 lifts every |x / s|, so calibration (s = amax / 448 < 1 on these small values) never
    flushes more; a saturated key outlier channel moves the attention more than a calibrated cast does."""
    t = make_synthetic(SMALL)
    loose, tight = fp8_clipping(t, STATIC), fp8_clipping(t, STATIC.with_(fp8_calibrate=True))
    assert max(tight["v"]["scales"]) < 1 and tight["v"]["flushed"] <= loose["v"]["flushed"]
    assert loose["v"]["flushed"] > 0
    k = outlier_trace.k[0, :, : outlier_trace.context_len]  # the outlier channel's keys: ±600
    s = qformats.layer_static_scale(STATIC.with_(fp8_calibrate=True), "k", k)
    cast = qformats.quantize_tensor(k, STATIC, "k", 0)[:, ::3, 5]
    calibrated = qformats.quantize_tensor(k, STATIC.with_(fp8_calibrate=True), "k", 0, s)[:, ::3, 5]
    assert np.all(np.abs(cast - k[:, ::3, 5]) == 152)  # 600 -> 448
    assert np.all(np.abs(calibrated - k[:, ::3, 5]) <= 16 * s)  # half E4M3's step near 448, x s
    assert fp8_clipping(t, Spec(key_format="e4m3")) is None  # fresh amax scales: nothing to count


def test_static_scales_cost_one_fp32_per_layer():
    per_head = qformats.tensor_bytes(STATIC, "k", 10, 64, kv_heads=4, residual=0)
    assert per_head.payload == 640 and per_head.overhead == 4 / 4


def test_calibrate_needs_static_scales(capsys):
    assert main(["compare", "--key-format", "e4m3", "--fp8-calibrate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fp8-scale static" in err[0]


def test_new_options_are_link_parameters_and_flags():
    values, notes = links.parse_query("key_fmt=q4_0&value_fmt=q8_0&fp8_scale=static&fp8_cal=1")
    assert notes == []
    spec = links.spec_from_values(values)
    assert (spec.key_format, spec.value_format, spec.fp8_scale, spec.fp8_calibrate) == ("q4_0", "q8_0", "static", True)
    assert "fp8_cal" in links.compression_params()


def test_formats_and_static_scales_are_study_axes(tmp_path):
    from study_util import one_layer_study, study_rows

    study = one_layer_study(
        "engines",
        context=64,
        steps=0,
        grid="""scorers = ["h2o"]
        budgets = [1.0]
        bits = []
        formats = ["q8_0", "q4_0", "e4m3"]
        fp8_scale = ["static"]
        fp8_calibrate = [false, true]""",
    )
    rows = study_rows(study, tmp_path / "s")
    assert len(rows) == 6 and set(rows["format"]) == {"q8_0", "q4_0", "e4m3"}
    assert set(rows["fp8_calibrate"]) == {False, True}
    err = rows.groupby(["format", "fp8_calibrate"])["output_error"].mean()
    assert err["q8_0", False] < err["q4_0", False] and err["q8_0", False] == err["q8_0", True]  # (FP8 only)
    assert err["e4m3", True] != err["e4m3", False]  # the axis reached the FP8 scales


# --- the peak ----------------------------------------------------------------------------------


def test_peak_is_the_full_prefill_beside_the_compressed_cache():
    t = make_synthetic(SMALL)
    per_token = 2 * 2 * t.n_layers * t.n_kv_heads * t.head_dim
    spec = Spec(sink=4, recent=8, heavy=8, scorer="snapkv", key_bits=4, value_bits=4)
    n = t.n_positions
    m = memory_for(t, spec, n)
    assert m.kv_bytes_peak == t.context_len * per_token and m.peak == m.kv_bytes_peak > m.kv_bytes
    ledger = budget_ledger(t, spec)
    assert ledger.totals["prefill_bytes"] == m.kv_bytes_peak
    assert any("at its peak the cache holds" in note for note in ledger.notes())
    full = memory_for(t, Spec(), n)  # nothing compressed: the peak is the cache itself
    assert full.peak == full.kv_bytes == n * per_token
    text = memory_peak_text({"kv_bytes": m.kv_bytes, "kv_bytes_peak": m.peak, "kv_bytes_read": m.bytes_read})
    assert text.startswith("peak ") and "reads" not in text


def test_quest_card_says_what_a_step_reads():
    t = make_synthetic(SMALL)
    c = compare(t, Spec(sink=4, recent=8, heavy=16, scorer="quest", page_size=8), View())
    text = memory_peak_text(c.metrics)
    assert "reads" in text and c.metrics["kv_bytes_read"] < c.metrics["kv_bytes"]
