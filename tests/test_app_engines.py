"""AppTest: the serving-engine presets, the static FP8 controls and their note, the peak on the
memory card."""

from pathlib import Path

import numpy as np
from apptest_util import numbers, run_app

from kvviz.app.compression import ADVANCED
from kvviz import Spec, View, compare
from kvviz.analysis.readout import fmt_bytes, fp8_clipping, fp8_clipping_note
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
SMALL = {"source": "synthetic", "context": "128", "steps": "4"}
TRACE = SyntheticSpec(context=128, steps=4)


def memory_card(at):
    return next(m for m in at.metric if m.label == "KV memory")


def test_llama_cpp_preset_sets_q8_0_keys_and_q4_0_values():
    at = run_app(APP, 120, opened=(ADVANCED,), **SMALL)
    at.button(key="preset_llama.cpp q8_0 / q4_0 K/V").click().run()
    assert not at.exception
    assert at.selectbox(key="key_fmt").value == "q8_0" and at.selectbox(key="value_fmt").value == "q4_0"
    assert at.query_params["key_fmt"] in ("q8_0", ["q8_0"])
    spec = Spec(key_format="q8_0", value_format="q4_0")
    want = compare(make_synthetic(TRACE), spec, View(ensemble="heads")).metrics
    got = numbers(at)
    assert got["kv_bytes"] == want["kv_bytes"] == want["key_bytes"] / 34 * (34 + 18)
    assert got["tv_distance"] == want["tv_distance"]
    card = memory_card(at)
    assert card.value == fmt_bytes(want["kv_bytes"]) and f"peak {fmt_bytes(want['kv_bytes_peak'])}" in card.delta


def test_vllm_preset_says_what_saturated_and_calibration_is_a_box():
    at = run_app(APP, 120, opened=(ADVANCED,), **SMALL)
    at.button(key="preset_vLLM FP8 (uncalibrated)").click().run()
    assert not at.exception
    assert at.radio(key="fp8_scale").value == "static"
    spec = Spec(key_format="e4m3", value_format="e4m3", fp8_scale="static")
    note = fp8_clipping_note(fp8_clipping(make_synthetic(TRACE), spec))
    assert note and any(note in i.value for i in at.info)
    box = at.checkbox(key="fp8_cal")
    assert box.value is False
    box.check().run()
    assert not at.exception and at.query_params["fp8_cal"] in ("1", ["1"])
    want = compare(make_synthetic(TRACE), spec.with_(fp8_calibrate=True), View(ensemble="heads")).metrics
    assert numbers(at)["output_rel_error"] == want["output_rel_error"]
    at.radio(key="fp8_scale").set_value("head").run()  # calibration is for static scales: switched off
    assert not at.exception and not at.error
    assert "fp8_cal" not in [c.key for c in at.checkbox]
    assert not any("Static FP8" in i.value for i in at.info)


def test_link_with_static_scales_opens_on_them():
    at = run_app(
        APP, 120, opened=(ADVANCED,), **SMALL, key_fmt="e4m3", value_fmt="e4m3", fp8_scale="static", fp8_cal="1"
    )
    assert at.checkbox(key="fp8_cal").value is True
    spec = Spec(
        sink=4, recent=8, heavy=2, key_format="e4m3", value_format="e4m3", fp8_scale="static", fp8_calibrate=True
    )
    want = compare(make_synthetic(TRACE), spec, View(ensemble="heads")).metrics
    assert np.isclose(numbers(at)["tv_distance"], want["tv_distance"], rtol=0, atol=0)
