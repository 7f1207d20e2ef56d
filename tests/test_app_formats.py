"""AppTest: the cache formats in the Advanced controls and the URL, the HF QuantizedCache preset,
FP8 / FP4 points on Trade-offs, and the keys-before-and-after-rotation heatmap."""

import json
from pathlib import Path

import pytest
from apptest_util import (
    lab_quality,
    lab_run_metrics,
    numbers,
    plotly_charts,
    plotly_values,
    run_app,
    share_one_model_load,
    unfold,
)

from kvviz.app.compression import ADVANCED
from kvviz import Spec, View, compare
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
TRADEOFFS = str(ROOT / "pages" / "1_trade-offs.py")
LAB = str(ROOT / "pages" / "3_model-lab.py")
SMALL = {"source": "synthetic", "context": "128", "steps": "4"}


def test_url_formats_reach_the_engine_exactly():
    at = run_app(
        APP, 120, opened=(ADVANCED,), **SMALL, key_fmt="nvfp4", value_fmt="e4m3", fp8_scale="token", rotate="keys"
    )
    assert at.selectbox(key="key_fmt").value == "nvfp4" and at.selectbox(key="value_fmt").value == "e4m3"
    assert at.radio(key="fp8_scale").value == "token" and at.radio(key="rotate").value == "keys"
    spec = Spec(sink=4, recent=8, heavy=2, key_format="nvfp4", value_format="e4m3", fp8_scale="token", rotate="keys")
    want = compare(make_synthetic(SyntheticSpec(context=128, steps=4)), spec, View(ensemble="heads")).metrics
    got = numbers(at)
    assert got["tv_distance"] == want["tv_distance"] and got["kv_bytes"] == want["kv_bytes"]
    assert any("NVFP4" in c.value and "Hadamard" in c.value for c in at.caption)


def test_format_controls_and_bad_url_values():
    at = run_app(APP, 120, opened=(ADVANCED,), **SMALL, key_fmt="fp6")
    assert at.selectbox(key="key_fmt").value == "int"
    assert any("key_fmt=fp6" in w.value for w in at.warning)
    at.selectbox(key="key_fmt").set_value("e4m3").run()
    assert not at.exception
    assert not at.radio(key="fp8_scale").disabled
    assert at.query_params["key_fmt"] in ("e4m3", ["e4m3"])


def test_hf_preset_sets_per_token_groups_and_the_flush():
    at = run_app(APP, 120, opened=(ADVANCED,), **SMALL, sink="0", recent="0", heavy="0")
    at.button(key="preset_HF QuantizedCache 4-bit").click().run()
    assert not at.exception
    assert at.radio(key="key_axis").value == "token" and at.radio(key="res_mode").value == "hf"
    assert at.selectbox(key="group").value == 64
    from kvviz.quant.formats import hf_quantized_cache

    n = numbers(at)
    t = make_synthetic(SyntheticSpec(context=128, steps=4))
    spec = hf_quantized_cache(4)  # its fields: test_formats; against transformers: test_hf_quantized_cache
    assert n["tv_distance"] == compare(t, spec, View(ensemble="heads")).metrics["tv_distance"]


def test_rotation_heatmap_expander():
    at = unfold(run_app(APP, 120, opened=(ADVANCED,), **SMALL), "_rotation_open")
    fig = json.loads(next(c for c in plotly_charts(at) if "after the Hadamard rotation" in c.proto.spec).proto.spec)
    heatmaps = [t for t in fig["data"] if t["type"] == "heatmap"]
    assert len(heatmaps) == 2 and heatmaps[0]["z"]["shape"] == "64, 132"  # channels down, tokens 0..131 across
    text = next(m.value for m in at.markdown if "2-bit per-token key error" in m.value)
    before, after = (float(x) for x in text.rsplit(": ", 1)[1].split(" → "))
    assert after < before  # the synthetic keys have outlier channels


def test_tradeoffs_gets_fp8_and_fp4_points():
    at = run_app(TRADEOFFS, 180, **SMALL, methods="h2o", sweep_bits="16", sweep_formats="e4m3,nvfp4")
    assert not at.error and not at.exception
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    names = [t.get("name") for t in fig["data"]]
    assert "FP8 E4M3" in names and "NVFP4" in names
    fp8 = [t for t in fig["data"] if t.get("customdata") and t["customdata"][0][3] == "e4m3"]
    assert fp8 and {row[0] for t in fp8 for row in t["customdata"]} == {"h2o", "full"}


@pytest.mark.model
def test_model_lab_runs_a_serving_format(monkeypatch):
    """Model lab with NVFP4 keys, FP8 values and rotated keys from the URL: the page's perplexity
    is kvviz.decode.quality.evaluate's under the same Spec (the real-model decode path)."""
    load_once = share_one_model_load(monkeypatch)  # the page and this test share one load
    at = run_app(
        LAB,
        300,
        sink="0",
        recent="0",
        heavy="0",
        key_fmt="nvfp4",
        value_fmt="e4m3",
        rotate="keys",
        lab_prompt="40",
        lab_cont="8",
        lab_greedy="0",
    )
    shown = lab_run_metrics(at)
    q = lab_quality(load_once, Spec(key_format="nvfp4", value_format="e4m3", rotate="keys"), 40, 8)
    assert shown["Perplexity (compressed)"] == f"{q.perplexity:.2f}"
    assert "NVFP4" in "".join(m.value for m in at.markdown)


def test_tradeoffs_and_its_link_offer_every_serving_format_llama_cpp_included():
    """The page's format pills and the link read the quantizers' own table (kvviz.quant.formats): llama.cpp's
    q8_0 and q4_0 are offered, survive the link both ways and get points; the full-cache point of each costs
    exactly its block bytes (q8_0: 34, q4_0: 18 bytes per 32 values, against 64 at 16 bits)."""
    from kvviz.links import PARAMS, defaults, encode_query, parse_query
    from kvviz.plots.style import FORMAT_NAMES
    from kvviz.quant.formats import FORMAT_BITS, FORMATS, SERVING_FORMATS

    assert SERVING_FORMATS == tuple(f for f in FORMATS if f != "int")
    assert set(FORMAT_BITS) == set(SERVING_FORMATS)  # every format has the width its sweep points show
    assert {"q8_0", "q4_0"} <= set(PARAMS["sweep_formats"].choices)
    query = encode_query({**defaults(), "sweep_formats": ("q8_0", "q4_0")})
    assert query == "sweep_formats=q8_0%2Cq4_0"
    values, notes = parse_query(query)
    assert values["sweep_formats"] == ("q8_0", "q4_0") and notes == []

    at = run_app(TRADEOFFS, 180, **SMALL, methods="h2o", sweep_bits="16", sweep_formats="q8_0,q4_0")
    assert not at.error and not at.warning
    assert list(at.pills(key="sweep_formats").options) == [FORMAT_NAMES[f] for f in SERVING_FORMATS]
    assert at.pills(key="sweep_formats").value == ["q8_0", "q4_0"]
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    names = [t.get("name") for t in fig["data"]]
    assert "llama.cpp q8_0" in names and "llama.cpp q4_0" in names
    full = {
        row[3]: x
        for t in fig["data"]
        if t.get("customdata")
        for row, x in zip(t["customdata"], plotly_values(t["x"]))
        if row[0] == "full"
    }
    assert full["q8_0"] == 34 / 64 and full["q4_0"] == 18 / 64
