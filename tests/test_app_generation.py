"""AppTest for the Model lab and Decode timeline pages: they load without a model, say what
they show, and the numbers on screen are the ones the core computes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from apptest_util import lab_quality, lab_run_metrics, plotly_charts, run_app, share_one_model_load
from streamlit.testing.v1 import AppTest

from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.spec import Spec
from kvviz.analysis.timeline import timeline

ROOT = Path(__file__).resolve().parents[1]
LAB = str(ROOT / "pages" / "3_model-lab.py")
TIMELINE = str(ROOT / "pages" / "4_decode-timeline.py")
SMALL_SHIFT = {
    "source": "synthetic",
    "context": "128",
    "steps": "16",
    "topic_shift": "8",
    "sink": "4",
    "recent": "8",
    "heavy": "8",
}


def run(path, **params) -> AppTest:
    return run_app(path, 300, **params)


# --- Decode timeline ----------------------------------------------------------------------------


def test_timeline_default_shows_the_demo_and_says_so():
    at = run(TIMELINE)
    assert any("no decode steps" in i.value for i in at.info)
    labels = [m.label for m in at.metric]
    assert labels == ["H2O mean regret", "TOVA mean regret", "StreamingLLM mean regret", "Oracle (bound) mean regret"]
    values = [float(m.value) for m in at.metric]
    assert values[3] == min(values)  # the oracle is the bound


def test_timeline_numbers_are_the_cores():
    at = run(TIMELINE, **SMALL_SHIFT)
    trace = make_synthetic(SyntheticSpec(context=128, steps=16, topic_shift=8.0))
    tl = timeline(trace, Spec(sink=4, recent=8, heavy=8), layer=0, kv_head=0, max_steps=256)
    shown = {m.label: m.value for m in at.metric}
    assert shown["H2O mean regret"] == f"{tl.policies['h2o'].regret_mean:.3f}"
    assert shown["Oracle (bound) mean regret"] == f"{tl.policies['oracle'].regret_mean:.3f}"
    assert any("Topic shift at position" in c.value for c in at.caption)
    # the step (the chart's slider reports it; a link carries it) drives the per-step table and the chart
    at = run(TIMELINE, **SMALL_SHIFT, tl_step="12")
    assert any("**Step 12**: query at position 140" in md.value for md in at.markdown)
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    assert fig["layout"]["sliders"][0]["active"] == 12 and fig["layout"]["title"]["text"].startswith("Step 12:")
    table = at.dataframe[0].value
    assert list(table["regret at this step"]) == [round(float(tl.policies[n].regret[12]), 4) for n in tl.policies]
    assert list(table["tokens held"]) == [20] * 4


def test_timeline_layer_and_head_are_used():
    at = run(TIMELINE, **SMALL_SHIFT)
    at.number_input(key="tl_layer").set_value(1).run()
    at.number_input(key="tl_kv_head").set_value(1).run()
    assert not at.exception
    trace = make_synthetic(SyntheticSpec(context=128, steps=16, topic_shift=8.0))
    tl = timeline(trace, Spec(sink=4, recent=8, heavy=8), layer=1, kv_head=1)
    assert {m.label: m.value for m in at.metric}["TOVA mean regret"] == f"{tl.policies['tova'].regret_mean:.3f}"
    assert any("layer 1, KV head 1" in md.value for md in at.markdown)


def test_timeline_plays_in_the_browser_and_no_budget():
    """Play is in the figure: one frame per decode step, a play button and a step slider."""
    import json

    at = run(TIMELINE, **SMALL_SHIFT)
    charts = plotly_charts(at)
    assert len(charts) == 1
    fig = json.loads(charts[0].proto.spec)
    assert len(fig["frames"]) == 16 and [f["name"] for f in fig["frames"]] == [str(s) for s in range(16)]
    assert fig["layout"]["updatemenus"][0]["buttons"][0]["method"] == "animate"
    assert len(fig["layout"]["sliders"][0]["steps"]) == 16
    assert json.loads(plotly_charts(at)[0].proto.spec)["frames"][5]["layout"]["title"]["text"].startswith("Step 5:")
    # and what reports the slider's step back (a browser test moves it)
    assert [b.key for b in at.get("bidi_component")] == ["tl_animation", "_tl_step_report"]
    at = run(TIMELINE, **{**SMALL_SHIFT, "sink": 0, "recent": 0, "heavy": 0})
    assert any("Eviction is off" in w.value for w in at.warning)


def test_timeline_presents_its_maps_first_with_the_step_controls_above_them():
    """Presentation mode: the page's controls in the sidebar, the chart first; the chart is the policies' maps
    (each step's regrets in its title), Play and the step slider above them, its text at 16 px or more."""
    at = run(TIMELINE, **SMALL_SHIFT, present="1")
    assert {"tl_layer", "tl_kv_head", "tl_need"} <= {w.key for w in at.sidebar.number_input}
    assert "tl_policies" in {w.key for w in at.sidebar.button_group}
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    layout = fig["layout"]
    assert [t["type"] for t in fig["data"][:4]] == ["heatmap"] * 4  # no regret line chart
    assert layout["updatemenus"][0]["y"] > 1 and layout["sliders"][0]["y"] > 1  # above the maps
    assert min(layout[a]["tickfont"]["size"] for a in layout if a.startswith(("xaxis", "yaxis"))) >= 16
    assert fig["frames"][3]["layout"]["title"]["text"].startswith("Step 3<br>regret: H2O")
    at = run(TIMELINE, **SMALL_SHIFT)  # not presenting: as before
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    assert fig["data"][0]["type"] == "scatter" and fig["layout"]["updatemenus"][0]["y"] < 0


# --- Model lab ---------------------------------------------------------------------------------------


def test_model_lab_loads_no_model_until_run(monkeypatch, tmp_path):
    import kvviz.models

    monkeypatch.setenv("KVVIZ_LAB_DIR", str(tmp_path))  # no stored default run (another test may have made one)

    def refuse(*a, **k):
        raise AssertionError("the Model lab loaded a model without a click")

    monkeypatch.setattr(kvviz.models, "load_model", refuse)
    at = run(LAB)
    from kvviz.app.presets import PRESETS

    assert [b.label for b in at.button] == [*PRESETS, "Run the model"]
    assert any("press **Run the model**" in i.value for i in at.info)
    assert any("capped" in c.value for c in at.caption)
    # the boxes' ranges are in their help, and a number typed outside is clamped with a notice
    assert "Range 8-512" in at.number_input(key="lab_prompt").help
    assert "Range 2-128" in at.number_input(key="lab_cont").help
    at.number_input(key="lab_prompt").set_value(99999).run()
    assert at.number_input(key="lab_prompt").value == 512
    assert any("clamped to 512" in w.value for w in [*at.warning, *at.info, *at.markdown, *at.caption])


def test_model_lab_refuses_the_noise_model():
    at = run(LAB, qmodel="noise")
    assert any("logit-noise model" in e.value for e in at.error)


@pytest.mark.model
def test_model_lab_run_shows_the_cores_numbers(monkeypatch):
    load_once = share_one_model_load(monkeypatch)  # the page and this test share one load
    from kvviz.decode import lab

    runs = []
    real_run = lab.run
    monkeypatch.setattr(lab, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
    at = run(LAB, sink=4, recent=12, heavy=0, scorer="streaming")
    shown = lab_run_metrics(at, prompt=48, cont=10, greedy=6)
    q = lab_quality(load_once, Spec(sink=4, recent=12, scorer="streaming"), 48, 10)
    assert shown["Perplexity (compressed)"] == f"{q.perplexity:.2f}"
    assert shown["Perplexity (full cache)"] == f"{q.perplexity_full:.2f}"
    assert shown["Next-token KL"] == f"{q.kl_mean:.3f}"
    assert plotly_charts(at)
    assert len(runs) == 1  # the click ran the model once
    # a rerun with the same settings shows the cached result without running again
    at.run()
    assert not at.exception and {m.label: m.value for m in at.metric} == shown
    assert len(runs) == 1  # the model did not run again
    assert at.button(key="lab_run").label == "Run again (live)"
    assert np.isfinite(q.kl_max)
    # Presentation mode: the same result, its KL strip first and larger, the run's settings folded below it
    at.checkbox(key="present").check().run()
    assert not at.exception and len(runs) == 1 and {m.label: m.value for m in at.metric} == shown
    charts = plotly_charts(at)
    assert charts[0].proto.id.endswith("lab_kl_strip") and charts[1].proto.id.endswith("lab_nll")
    assert json.loads(charts[0].proto.spec)["layout"]["xaxis"]["tickfont"]["size"] >= 16
    folded = next(e for e in at.expander if e.label == "Text and run settings")
    assert folded.number_input(key="lab_prompt").value == 48


def test_model_lab_presets_size_budgets_to_the_prompt():
    at = run(LAB)
    at.number_input(key="lab_prompt").set_value(200).run()
    at.button(key="preset_StreamingLLM").click().run()
    assert not at.exception
    assert (at.slider(key="sink").value, at.slider(key="recent").value, at.slider(key="heavy").value) == (4, 36, 0)
    assert "streaming sink 4 recent 36 heavy 0" in "".join(m.value for m in at.markdown)


# --- every control shown is used, and page settings live in the URL -----------------------


def test_timeline_on_the_handbook_uses_the_sidebar_budget_and_hides_what_it_does_not_use():
    """The handbook has no decode steps: the demo runs with the sidebar's 4 + 8 + 2, not a
    budget of its own, and the bits / Advanced controls (unused here) are not shown."""
    at = run(TIMELINE)
    assert at.slider(key="sink").value == 4 and at.slider(key="recent").value == 8
    assert list(at.dataframe[0].value["tokens held"]) == [14] * 4
    assert not [s for s in at.sidebar.select_slider if s.key == "bits"]
    assert not [e for e in at.sidebar.expander if e.label == "Advanced"]
    assert any("only the budget sliders" in c.value for c in at.sidebar.caption)
    at.slider(key="heavy").set_value(10).run()
    assert list(at.dataframe[0].value["tokens held"]) == [22] * 4


def test_timeline_settings_round_trip_through_the_url():
    params = {
        **SMALL_SHIFT,
        "tl_layer": "1",
        "tl_kv_head": "1",
        "tl_policies": "h2o,oracle",
        "tl_need": "0.05",
        "tl_step": "7",
    }
    at = run(TIMELINE, **params)
    defaults = {"sink", "recent"}  # 4 and 8 are the defaults: not written
    assert dict(at.query_params) == {k: v for k, v in params.items() if k not in defaults}
    assert [m.label for m in at.metric] == ["H2O mean regret", "Oracle (bound) mean regret"]
    assert any("**Step 7**" in md.value for md in at.markdown)
    at = run(TIMELINE, **{**params, "tl_step": "99"})  # past the last step: clamped, with the notice
    assert any("Decode step 99 is out of range (0-15); clamped to 15." in w.value for w in at.warning)
    assert any("**Step 15**" in md.value for md in at.markdown) and at.query_params["tl_step"] == "15"


def test_model_lab_settings_round_trip_through_the_url(monkeypatch):
    import kvviz.models

    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    params = {
        "lab_text": "bakery",
        "lab_prompt": "64",
        "lab_cont": "20",
        "lab_greedy": "8",
        "lab_rerotate": "1",
        "sink": "4",
        "recent": "16",
        "scorer": "streaming",
        "heavy": "0",
    }
    at = run(LAB, **params)
    assert dict(at.query_params) == {k: v for k, v in params.items() if k != "sink"}  # 4 is the default
    assert at.number_input(key="lab_prompt").value == 64 and at.checkbox(key="lab_rerotate").value
    assert any("re-rotated to their cache slots" in md.value for md in at.markdown)
    at.number_input(key="lab_cont").set_value(30).run()
    assert at.query_params["lab_cont"] == "30"


def test_timeline_tells_a_tokens_history():
    at = run(TIMELINE, **{**SMALL_SHIFT, "topic_shift": "12"})
    box = at.selectbox(key="tl_token")
    trace = make_synthetic(SyntheticSpec(context=128, steps=16, topic_shift=12.0))
    tl = timeline(trace, Spec(sink=4, recent=8, heavy=8), layer=0, kv_head=0)
    token = box.value
    assert any(tl.policies["h2o"].history(token, tl.positions, tl.context_len) in md.value for md in at.markdown)


def test_model_lab_offers_this_machines_devices_and_an_out_of_memory_run_is_one_line(monkeypatch, tmp_path):
    """The device box lists what torch sees here (cpu, then cuda:N / mps); the dtype chosen reaches the
    model load and the link (the device does not: another machine may lack it); a run out of GPU memory is
    one error line saying what to lower, no traceback."""
    import torch

    import kvviz.app.sources
    from kvviz.decode.place import available_devices

    monkeypatch.setenv("KVVIZ_LAB_DIR", str(tmp_path))
    asked = []

    def out_of_memory(name, device="cpu", dtype="float32", progress=None):
        asked.append((name, device, dtype))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(kvviz.app.sources, "shared_model", out_of_memory)
    at = run(LAB)
    assert list(at.selectbox(key="lab_device").options) == available_devices()
    at.selectbox(key="lab_dtype").set_value("bfloat16").run()
    assert at.query_params["lab_dtype"] == "bfloat16" and "lab_device" not in at.query_params  # dtype linked
    at.button(key="lab_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert asked == [("bundled", "cpu", "bfloat16")]
    (err,) = [e.value for e in at.error]
    assert err.startswith("The run stopped: out of GPU memory: lower the token counts") and "\n" not in err
    # the run's box says it stopped, and its Cancel button went with it
    assert [b.label for b in at.button if b.key == "lab_cancel"] == []
    assert [b.label for b in at.main if b.type == "status"] == ["The run stopped"]


@pytest.mark.parametrize("prompt", [None, 512], ids=["the default prompt", "a longer prompt"])
def test_model_lab_bakery_story_runs_where_its_text_is_shorter_than_the_prompt(monkeypatch, prompt):
    """The Bakery story (177 tokens) against the page's default 206-token prompt, or a link's 512: the run
    shortens the prompt to what the text holds (labsettings.fit_to_text) and says so in the page's words."""
    from kvviz.decode import labsettings

    share_one_model_load(monkeypatch)
    params = {"lab_text": "bakery", "lab_cont": 8, "lab_greedy": 4} | ({"lab_prompt": prompt} if prompt else {})
    at = run(LAB, **params)
    asked = prompt or labsettings.DEFAULT_PROMPT
    at.button(key="lab_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == []
    assert at.metric[0].label == "Perplexity (compressed)"
    (note,) = [i.value for i in at.info if "too few for a" in i.value]
    n = int(note.split("This text has ")[1].split(" tokens")[0])
    assert f"too few for a {asked}-token prompt: its first {n - 8} were the prompt and the next 8 were scored" in note
    assert "--" not in note  # no command-line flag in the browser
    assert [b.label for b in at.button if b.key == "lab_cancel"] == []


def _real_model_sidebar():
    import streamlit as st

    from kvviz.app.sources import real_model_source

    real_model_source(st.sidebar)


def test_real_model_source_offers_this_machines_devices(monkeypatch, tmp_path):
    """The Real model source (the Decode timeline's real-model mode) offers the same device and dtype boxes;
    the capture it would make is keyed by them (a bfloat16 capture is not the float32 one)."""
    from kvviz.app.sources import CaptureSettings
    from kvviz.decode.place import available_devices

    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path))
    at = AppTest.from_function(_real_model_sidebar, default_timeout=60).run()
    assert not at.exception
    assert list(at.sidebar.selectbox(key="rm_device").options) == available_devices()
    assert [o.split()[0] for o in at.sidebar.selectbox(key="rm_dtype").options] == ["float32", "bfloat16", "float16"]
    plain = CaptureSettings("bundled", "text", 4, 64)
    assert CaptureSettings("bundled", "text", 4, 64, dtype="bfloat16").key() != plain.key()
    assert CaptureSettings("bundled", "text", 4, 64, dtype="float32", device="cpu").key() == plain.key()


def test_model_lab_budgets_in_percent_are_shares_of_the_prompt():
    """The Model lab's sliders range over its longest run (640 tokens), but a budget typed in % is a share
    of the prompt, the cache at the compression point: 50% of a 206-token prompt is 103 tokens."""
    at = run(LAB, budget_unit="%")
    assert "% of the 206 prompt tokens" in at.radio(key="budget_unit").options  # as the radio reads
    at.number_input(key="_box_heavy").set_value(50.0).run()
    assert at.slider(key="heavy").value == 103 and at.query_params["heavy"] == "103"
    at = run(LAB, budget_unit="%", lab_prompt="128")
    assert "% of the 128 prompt tokens" in at.radio(key="budget_unit").options
    at.number_input(key="_box_heavy").set_value(25.0).run()
    assert at.slider(key="heavy").value == 32
