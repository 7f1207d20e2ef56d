"""AppTest (streamlit.testing.v1) for every page: labels, directions, exact numbers, URL state, presets, errors."""

import json
import re
from pathlib import Path

import pytest
from apptest_util import numbers, plotly_charts, plotly_values, run_app, unfold
from streamlit.testing.v1 import AppTest

from kvviz import Spec, View, compare
from kvviz.sources.handbook import handbook_trace
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.app.compression import ADVANCED
from kvviz.app.store import STORE
from kvviz.app.cards import card_values
from kvviz.analysis.frames import concentration

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
TRADEOFFS = str(ROOT / "pages" / "1_trade-offs.py")
CONCENTRATION = str(ROOT / "pages" / "2_concentration.py")
# a small synthetic pattern keeps these tests quick
SMALL = {"source": "synthetic", "context": "128", "steps": "4"}


def run(path=APP, **params) -> AppTest:
    return run_app(path, 120, **params)


def cards(at) -> dict:
    return {m.label: m.value for m in at.metric}


def warnings(at) -> str:
    return "\n".join(w.value for w in at.warning)


def set_and_run(at, key, value) -> AppTest:
    widget = at.select_slider(key=key) if key == "bits" else at.slider(key=key)
    widget.set_value(value)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# --- explorer -------------------------------------------------------------------------------


def test_four_sliders_with_exact_labels_in_sidebar():
    at = run()
    sliders = {s.label for s in at.sidebar.slider} | {s.label for s in at.sidebar.select_slider}
    assert {"Sink tokens", "Recent window", "Heavy-hitter budget", "Quantization bits"} <= sliders
    headers = [h.value for h in at.sidebar.header]
    assert headers == ["Source", "Compression", "View"]


def test_default_view_is_the_handbook_example():
    at = run()
    assert at.slider(key="sink").value == 4 and at.slider(key="recent").value == 8
    assert at.slider(key="heavy").value == 2 and at.select_slider(key="bits").value == 16
    assert any("0-3, 15, 28, 56-63" in m.value for m in at.markdown)
    assert cards(at)["Attention mass retained"] == "62.9%"
    assert cards(at)["Tokens kept"] == "14 / 64"
    assert any("no later queries" in i.value for i in at.info)  # Comparison.notes is shown
    captions = " ".join(c.value for c in at.caption)
    assert "keys realised from the handbook's logits" in captions


def test_shown_numbers_equal_kvviz_compare():
    at = run(sink=2, recent=6, heavy=5, bits=4, ensemble="none")  # the app quantizes short groups
    expected = compare(
        handbook_trace(), Spec(sink=2, recent=6, heavy=5, key_bits=4, value_bits=4, partial="quantize"), View()
    )
    shown = numbers(at)
    for k, v in expected.metrics.items():
        assert shown[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert cards(at) == card_values(expected.metrics)


def test_synthetic_numbers_equal_kvviz_compare_for_layer_and_head():
    at = run(**SMALL, layers=2, sink=4, recent=16, heavy=8, layer=1, head=3, ensemble="heads")
    t = make_synthetic(SyntheticSpec(context=128, steps=4, layers=2))
    expected = compare(t, Spec(sink=4, recent=16, heavy=8), View(layer=1, head=3, ensemble="heads"))
    shown = numbers(at)
    assert shown["mass_retained"] == pytest.approx(expected.metrics["mass_retained"], rel=1e-12)
    assert shown["tv_distance"] == pytest.approx(expected.metrics["tv_distance"], rel=1e-12)
    assert any("layer 1, query head 3 (KV head 1)" in c.value for c in at.caption)


def test_more_bits_means_less_error():
    at = run(**SMALL, sink=0, recent=0, heavy=0)
    errors = []
    for bits in (2, 4, 8):
        set_and_run(at, "bits", bits)
        errors.append((numbers(at)["tv_distance"], numbers(at)["output_rel_error"]))
    tv, out = zip(*errors)
    assert tv[0] > tv[1] > tv[2] > 0 and out[0] > out[1] > out[2] > 0
    set_and_run(at, "bits", 16)
    assert numbers(at)["tv_distance"] == 0.0


def test_larger_budget_retains_more_mass():
    at = run()
    masses = []
    for heavy in (0, 2, 10, 30):
        set_and_run(at, "heavy", heavy)
        masses.append(numbers(at)["mass_retained"])
    assert masses == sorted(masses) and masses[0] < masses[-1]
    set_and_run(at, "recent", 20)
    assert numbers(at)["mass_retained"] >= masses[-1]


def test_query_params_round_trip():
    params = {
        "source": "synthetic",
        "context": "128",
        "steps": "4",
        "sink": "3",
        "recent": "30",
        "heavy": "7",
        "bits": "4",
        "scorer": "tova",
        "layer": "1",
        "bars": "ci95",
        "ensemble": "steps",
    }
    at = run(opened=(ADVANCED,), **params)
    assert dict(at.query_params) == params
    assert at.slider(key="recent").value == 30 and at.selectbox(key="scorer").value == "tova"
    assert not warnings(at)
    # a widget change lands in the URL; going back to the default removes it
    set_and_run(at, "sink", 5)
    assert at.query_params["sink"] == "5"
    set_and_run(at, "sink", 4)
    assert "sink" not in at.query_params and "recent" in at.query_params


def test_out_of_range_link_is_clamped_with_a_notice():
    at = run(sink="-5", bits="11", layer="9", heavy="abc", nonsense="1")
    w = warnings(at)
    assert "`sink=-5` is out of range (at least 0); clamped to 0." in w  # no made-up top of the range
    assert "`bits=11` is not one of" in w
    assert "Layer 9 is out of range (0-0); clamped to 0." in w
    assert "`heavy=abc` is not a number" in w
    assert "`nonsense` is not a kvviz setting" in w
    assert at.slider(key="sink").value == 0 and at.select_slider(key="bits").value == 16
    assert at.number_input(key="layer").value == 0
    assert at.query_params.get("layer") is None  # the URL now holds the clamped state


def test_advanced_folded_draws_nothing_and_keeps_its_settings():
    """Advanced is folded until opened (its widgets cost every move while drawn): folded, a link's Advanced
    settings still reach the numbers exactly, and its token counts are still clamped to the trace; a value
    chosen while it was open survives folding it and a move."""
    at = run(scorer="tova", bits="4", key_axis="token", residual="9999", ensemble="none")
    assert "scorer" not in [b.key for b in at.selectbox] and not at.sidebar.expander[0].children
    assert "Residual (last tokens kept at 16 bits) 9999 is out of range (0-64); clamped to 64." in warnings(at)
    spec = Spec(sink=4, recent=8, heavy=2, scorer="tova", key_bits=4, value_bits=4, key_axis="token", residual=64)
    want = compare(handbook_trace(), spec, View()).metrics
    assert numbers(at)["tv_distance"] == want["tv_distance"]
    unfold(at, ADVANCED)
    assert at.selectbox(key="scorer").value == "tova" and at.number_input(key="residual").value == 64
    at.selectbox(key="scorer").set_value("snapkv").run()
    at.session_state[ADVANCED] = False
    set_and_run(at, "heavy", 5)
    assert "scorer" not in [b.key for b in at.selectbox] and at.query_params["scorer"] == "snapkv"
    assert unfold(at, ADVANCED).selectbox(key="scorer").value == "snapkv"


def test_presets_apply():
    at = run()
    at.button(key="preset_StreamingLLM").click().run()
    assert at.slider(key="sink").value == 4 and at.slider(key="heavy").value == 0
    assert at.session_state[STORE]["scorer"] == "streaming"  # set while Advanced is folded ...
    assert unfold(at, ADVANCED).selectbox(key="scorer").value == "streaming"  # ... and shown once opened
    at.button(key="preset_KIVI 2-bit").click().run()
    assert at.select_slider(key="bits").value == 2
    assert cards(at)["Attention mass retained"] == "100.0%" and numbers(at)["tv_distance"] > 0
    at.button(key="preset_H2O 10%+10%").click().run()
    assert (at.slider(key="recent").value, at.slider(key="heavy").value) == (7, 7)
    at.button(key="preset_Aggressive 25% + 2-bit").click().run()
    s, r, h = (at.slider(key=k).value for k in ("sink", "recent", "heavy"))
    assert s + r + h == 16 and at.select_slider(key="bits").value == 2
    at.button(key="preset_Handbook example").click().run()
    assert cards(at)["Attention mass retained"] == "62.9%"
    assert not at.exception


def test_impossible_combinations_show_messages_not_tracebacks():
    at = run(symmetric="1", bits="1")
    assert at.error and "symmetric" in at.error[0].value.lower() and "2 or more" in at.error[0].value
    at = run(source="synthetic", context="128", q_heads="3", kv_heads="2")
    assert at.error and "multiple of KV heads" in at.error[0].value
    at = run(sink="4", recent="8", heavy="60")
    assert "larger than the 52 tokens left" in warnings(at)
    at = run(sink="40", recent="30", heavy="0")
    assert "nothing is evicted" in warnings(at)


def test_separate_key_and_value_bits():
    at = run(**SMALL, sink=0, recent=0, heavy=0, split=1, key_bits=16, value_bits=2)
    n = numbers(at)
    assert n["tv_distance"] == 0.0 and n["output_rel_error"] > 0  # values only: attention unchanged
    assert at.select_slider(key="bits").disabled


def test_error_bars_choice_changes_the_chart():
    at = run(ensemble="seeds", qmodel="noise", sigma="0.5", sink="0", recent="0", heavy="0")
    std_title = plotly_charts(at)[1].proto.spec
    at.radio(key="bars").set_value("ci95").run()
    ci_title = plotly_charts(at)[1].proto.spec
    assert "95% t-interval for the mean" in ci_title and "1 sample std" in std_title
    assert "N = 8 rows" in ci_title and "8 random seeds" in ci_title
    at.radio(key="bars").set_value("range").run()
    assert "range (min" in plotly_charts(at)[1].proto.spec
    assert "logit-noise" in " ".join(c.value for c in at.caption)


def test_long_sequences_are_binned():
    at = run(source="synthetic", context="1024", steps="2", sink="4", recent="64", heavy="64")
    assert any("bins of up to" in c.value for c in at.caption)
    spec = plotly_charts(at)[0].proto.spec
    assert "bins of" in spec and spec.count('"x"') < 20  # a handful of traces, not a bar per token


# --- pages ---------------------------------------------------------------------------------------


def test_tradeoffs_presenting_draws_the_chart_first_in_projector_type():
    """Presentation mode on the Trade-offs page: the chart above its controls, every text of it at 18 px,
    its legend beside the plot; the table, downloads and explanations are left out."""
    at = run(TRADEOFFS, present="1")

    def walk(node):  # the page's elements top to bottom, containers opened
        yield node
        for child in (getattr(node, "children", None) or {}).values():
            yield from walk(child)

    order = [
        "chart" if e.type in ("plotly_chart", "bidi_component") else e.key
        for e in walk(at.main)
        if e.type in ("plotly_chart", "bidi_component", "radio")
    ]
    assert order.index("chart") < order.index("metric"), order
    fig = json.loads(plotly_charts(at)[0].proto.spec)["layout"]
    assert fig["font"]["size"] == 18 and fig["xaxis"]["tickfont"]["size"] == fig["yaxis"]["tickfont"]["size"] == 18
    assert fig["legend"]["orientation"] == "v" and fig["legend"]["x"] > 1
    assert not at.dataframe and not at.get("download_button") and not at.main.caption


def test_concentration_presenting_puts_the_curve_under_its_sliders_in_projector_type():
    at = run(str(Path(APP).parent / "pages" / "2_concentration.py"), present="1")
    layout = json.loads(plotly_charts(at)[0].proto.spec)["layout"]
    assert layout["font"]["size"] == 18 and layout["xaxis"]["tickfont"]["size"] == 18
    assert layout["title"]["text"].startswith("How concentrated is attention?")
    assert [m.label for m in at.metric][0] == "Top 10% of tokens hold" and not at.main.caption


def test_tradeoffs_page():
    at = run(TRADEOFFS, methods="h2o,streaming,oracle", sweep_bits="16,2")
    assert not at.error
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    legend = [t["name"] for t in fig["data"] if t.get("showlegend", True) and t.get("name")]
    # one legend entry per method, the bit widths once as markers, not one entry per (method, bits)
    assert {
        "H2O",
        "StreamingLLM",
        "Oracle (the bound)",
        "16-bit (off)",
        "2-bit",
        "Pareto frontier (real policies)",
    } <= set(legend)
    assert legend.count("H2O") == 1 and not any("·" in n for n in legend)
    oracle = [t for t in fig["data"] if t.get("legendgroup") == "oracle"]
    assert all(t["line"]["dash"] == "dot" for t in oracle)
    assert any(n.startswith("current:") for n in legend) and not any("TOVA" in n for n in legend)
    at.radio(key="metric").set_value("kl").run()
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    assert fig["layout"]["yaxis"]["title"]["text"] == "KL(compressed ‖ original), nats — lower is better"
    at.radio(key="metric").set_value("js").run()
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    assert fig["layout"]["yaxis"]["title"]["text"].startswith("Jensen–Shannon")
    at.radio(key="metric").set_value("mass").run()
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    assert fig["layout"]["yaxis"]["title"]["text"].endswith("higher is better")
    assert fig["layout"]["xaxis"]["type"] == "log" and "logx" not in at.query_params  # log by default
    at.checkbox(key="logx").uncheck().run()
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    assert fig["layout"]["xaxis"].get("type", "linear") == "linear" and at.query_params["logx"] == "0"
    table = at.dataframe[0].value
    assert "budget" in table.columns and "oracle" not in set(table["method"])  # the bound is not a frontier point
    # the sweep uses the explorer's sliders too
    assert {"Sink tokens", "Recent window", "Heavy-hitter budget"} <= {s.label for s in at.sidebar.slider}


def test_tradeoffs_needs_a_method():
    at = run(TRADEOFFS)
    at.pills(key="methods").set_value([]).run()
    assert "Pick at least one method" in warnings(at)


def test_concentration_page_numbers():
    at = run(CONCENTRATION, **SMALL, window="8", sink="1")
    c = concentration(make_synthetic(SyntheticSpec(context=128, steps=4)), sink=1, window=8)
    shown = cards(at)
    assert shown["Top 10% of tokens hold"] == f"{100 * c.top10.mean():.1f}%"
    assert shown["Sink share (first 1)"] == f"{100 * c.sink_share.mean():.1f}%"
    assert shown["Locality (last 8)"] == f"{100 * c.locality.mean():.1f}%"
    assert len(plotly_charts(at)) == 4
    assert "80-90%" in plotly_charts(at)[0].proto.spec


def test_concentration_uses_the_sidebar_sinks_and_no_single_cell_maps():
    """The handbook: its 4 sinks (the Compression sliders' count), and numbers instead of 1 x 1 heatmaps."""
    at = run(CONCENTRATION)
    c = concentration(handbook_trace(), sink=4, window=16)
    assert cards(at)["Sink share (first 4)"] == f"{100 * c.sink_share.mean():.1f}%"
    assert len(plotly_charts(at)) == 1 and "Entropy" in cards(at)


def test_navigation_keeps_settings():
    at = run(sink=2)
    at.switch_page("pages/1_trade-offs.py").run()
    assert at.slider(key="sink").value == 2 and at.query_params["sink"] == "2"
    at.switch_page("pages/2_concentration.py").run()
    assert not at.exception and at.query_params["sink"] == "2"


# --- real-text traces: token grid and the layer x head overview ----------------------------------


def test_trace_file_shows_token_grid_and_overview_jump(tmp_path, monkeypatch):
    from kvviz.sources import save_trace
    from kvviz.trace import trace_with

    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path))
    syn = make_synthetic(SyntheticSpec(context=48, steps=4, layers=2, q_heads=4, kv_heads=2))
    words = [f"w{i}" if i % 5 else "<the>" for i in range(syn.n_positions)]
    save_trace(
        trace_with(syn, tokens=tuple(words), meta={"source": "model", "model": "test"}), tmp_path / "text.safetensors"
    )
    at = run(source="file", sink=2, recent=4, heavy=4)
    grid = [h.proto.body for h in at.get("html") if "<style>" not in h.proto.body]
    assert len(grid) == 1 and "&lt;the&gt;" in grid[0] and grid[0].count("line-through") == syn.n_positions - 10
    # the overview knows which head loses most, and one click takes the View there
    unfold(at, "_overview_open")
    button = next(b for b in at.button if b.label.startswith("Jump to the head"))
    button.click().run()
    assert not at.exception
    layer, head = (int(x) for x in button.label.rsplit("layer ", 1)[1].split(", head "))
    assert at.number_input(key="layer").value == layer and at.number_input(key="head").value == head
    from kvviz.engine import head_grid

    grid = head_grid(syn, Spec(sink=2, recent=4, heavy=4))
    assert grid[layer, head] == grid.max()


# --- one rule for defaults, notes that say what a scorer keeps ----------------------------


def test_switching_the_source_keeps_the_last_step_as_a_fresh_link_does():
    """handbook -> synthetic used to land on step 0 (and write step=0); a fresh ?source=synthetic
    link opens on the last step. Both paths now give the same view and the same numbers."""
    at = run()
    at.radio(key="source").set_value("synthetic").run()
    assert not at.exception
    fresh = run(source="synthetic")
    assert at.number_input(key="step").value == fresh.number_input(key="step").value == 31  # 32 steps: 0-31
    assert "step" not in at.query_params
    assert cards(at) == cards(fresh)


def test_scorer_notes_say_what_is_kept():
    at = run(**SMALL, scorer="snapkv", sink="4", recent="23", heavy="24")
    info = " ".join(i.value for i in at.info)
    assert "the last 23 context queries (positions 105–127)" in info and "before position 105" in info
    at = run(**SMALL, scorer="oracle", sink="4", recent="8", heavy="8")
    assert "not for each query head" in " ".join(i.value for i in at.info)
    at = run(**SMALL, scorer="snapkv", sink="4", recent="8", heavy="8", snap_window="16")
    assert any("must fit inside the recent window" in e.value for e in at.error)


def test_new_quantizer_options_reach_the_numbers():
    at = run(bits="2", zero_point="int", partial="quantize", ensemble="none", sink="0", recent="0", heavy="0")
    expected = compare(handbook_trace(), Spec(key_bits=2, value_bits=2, zero_point="int", partial="quantize"), View())
    assert numbers(at)["kl"] == pytest.approx(expected.metrics["kl"], rel=1e-12)
    assert numbers(at)["kv_bytes"] == expected.metrics["kv_bytes"]


def test_synthetic_presets_set_the_pattern():
    from kvviz.sources.synthetic import PRESETS

    at = run(source="synthetic", context="128")
    at.button(key="synthetic_diffuse").click().run()
    assert at.number_input(key="sink_strength").value == PRESETS["diffuse"].sink_strength
    assert at.query_params["sparsity"] == "1.5"
    at.button(key="synthetic_topic shift").click().run()
    assert at.number_input(key="topic_shift").value == 12.0 and at.number_input(key="steps").value == 48
    at.button(key="synthetic_realistic").click().run()
    assert "sink_strength" not in at.query_params and "topic_shift" not in at.query_params


# --- targets instead of slider hunting --------------------------------------------------


def test_budget_number_boxes_set_counts_or_percentages():
    at = run(source="synthetic", context="512", steps="32")
    at.number_input(key="_box_recent").set_value(240).run()  # one keystroke-free step, not 232 presses
    assert at.slider(key="recent").value == 240 and at.query_params["recent"] == "240"
    at.radio(key="budget_unit").set_value("%").run()
    assert at.number_input(key="_box_recent").value == pytest.approx(100 * 240 / 544, abs=0.05)
    at.number_input(key="_box_heavy").set_value(25.0).run()  # 25% of 544 tokens
    assert at.slider(key="heavy").value == 136
    assert cards(at)["Tokens kept"] == f"{min(544, 4 + 240 + 136)} / 544"


def test_a_budget_slider_move_wins_over_its_boxs_stale_echo():
    """A superseded run can leave the number box's new value unseen by the browser, which then sends the
    box's old value along with the slider's next move (seen in Chromium: sink 4 -> 5 -> 6 by two quick key
    presses ended at 4). The slider moved, so it wins; a box typed on its own still sets the count."""
    at = run(source="synthetic", context="512", steps="32")
    at.slider(key="sink").set_value(5).run()
    assert at.number_input(key="_box_sink").value == 5
    at.slider(key="sink").set_value(6)
    at.number_input(key="_box_sink").set_value(4)  # the browser's stale copy, sent with the move
    at.run()
    assert at.slider(key="sink").value == 6 and at.number_input(key="_box_sink").value == 6
    assert at.query_params["sink"] == "6"
    at.number_input(key="_box_sink").set_value(9).run()  # typed alone: the box sets the count
    assert at.slider(key="sink").value == 9 and at.query_params["sink"] == "9"


# --- the lesson at a glance ----------------------------------------------------------------


def test_cards_split_the_quantizations_own_error():
    """With eviction on, TV is the evicted mass whatever the bits; the card beside it shows what
    quantization adds, and it grows as the bits fall."""
    tvs, quant = [], []
    for bits in (16, 4, 3, 2):
        at = run(bits=str(bits), ensemble="none", partial="quantize")
        c = cards(at)
        tvs.append(c["TV distance"])
        quant.append(float(c["TV from quantization"]))
        expected = compare(
            handbook_trace(), Spec(sink=4, recent=8, heavy=2, key_bits=bits, value_bits=bits, partial="quantize")
        )
        assert c == card_values(expected.metrics)
    assert quant[0] == 0 and quant[1] < quant[2] < quant[3]


def test_the_bits_reach_the_keys_by_default_and_the_app_says_when_they_cannot():
    """By default the app quantizes a group the kept tokens do not fill, so the bits slider
    changes the handbook example's attention, and the screen says which keys and values it reaches.
    With KIVI's rule (partial groups at 16 bits) 14 kept tokens never fill a per-channel group of 32:
    the app says so and offers the fix instead of letting the bits slider look broken."""
    at = run(bits="2", ensemble="none")
    assert float(cards(at)["TV from quantization"]) > 0 and not at.warning
    assert any(
        "The bits slider quantizes every kept key (groups of 32 along each channel)" in c.value for c in at.caption
    )
    at = run(bits="2", ensemble="none", partial="full")
    assert cards(at)["TV from quantization"] == "0.0000"
    assert any("keys are not quantized" in w.value for w in at.warning)
    at.button(key="_fix_partial").click().run()
    assert "partial" not in at.query_params and float(cards(at)["TV from quantization"]) > 0  # the default again


def test_pin_and_compare_a_against_b():
    at = run(ensemble="none")
    at.button(key="_pin").click().run()
    assert at.query_params["pin"] == "default"
    at.slider(key="heavy").set_value(10).run()
    a = compare(handbook_trace(), Spec(sink=4, recent=8, heavy=2)).metrics
    b = compare(handbook_trace(), Spec(sink=4, recent=8, heavy=10)).metrics
    mass = next(m for m in at.metric if m.label == "Attention mass retained")
    assert mass.proto.delta == f"{100 * (b['mass_retained'] - a['mass_retained']):+.1f} pts"
    spec = json.loads(plotly_charts(at)[0].proto.spec)
    assert any(t.get("name", "").startswith("pinned A") for t in spec["data"])
    assert any("**A:** h2o sink 4 recent 8 heavy 2" in m.value for m in at.markdown)
    # a link with the pin reproduces the comparison
    again = run(heavy="10", pin="default", ensemble="none")
    assert next(m for m in again.metric if m.label == "Attention mass retained").proto.delta == mass.proto.delta
    at.button(key="_unpin").click().run()
    assert "pin" not in at.query_params


def test_locked_y_axis_survives_slider_moves():
    at = run(ensemble="none", bits="3")
    at.toggle(key="_ylock_on").set_value(True).run()
    locked = float(at.query_params["ylock"])
    assert locked > 0
    at.slider(key="heavy").set_value(20).run()
    layout = json.loads(plotly_charts(at)[1].proto.spec)["layout"]
    assert layout["yaxis"]["range"] == [-locked, locked]


def test_a_locked_axis_never_hides_a_bar():
    """Locked at the default view, then sink 1, recent 0, heavy 0: the one kept token's attention (1.0)
    and its error (~0.9) pass both locks; each chart widens to them and says so."""
    at = run(ensemble="none")
    at.toggle(key="_ylock_on").set_value(True).run()
    ylock, alock = float(at.query_params["ylock"]), float(at.query_params["alock"])
    for name, value in (("sink", 1), ("recent", 0), ("heavy", 0)):
        at.slider(key=name).set_value(value).run()
    assert not at.exception and (float(at.query_params["ylock"]), float(at.query_params["alock"])) == (ylock, alock)
    attention, error = (json.loads(c.proto.spec) for c in plotly_charts(at))
    tallest = max(max(plotly_values(t["y"])) for t in attention["data"] if t["type"] == "bar")
    assert tallest > alock and attention["layout"]["yaxis"]["range"][1] >= tallest
    assert f"lock {alock:.3g} widened" in attention["layout"]["title"]["text"]
    lowest = min(min(plotly_values(t["y"])) for t in error["data"] if t["type"] == "bar")
    assert -lowest > ylock and error["layout"]["yaxis"]["range"][0] <= lowest
    assert f"lock ±{ylock:.3g} widened" in error["layout"]["title"]["text"]


def test_solver_applies_the_smallest_budget():
    from kvviz.analysis.solve import solve

    at = run(bits="4", solve_target="0.95", ensemble="none", opened=("_solver_open",))
    at.button(key="_solve").click().run()
    sol = solve(handbook_trace(), Spec(key_bits=4, value_bits=4), target_mass=0.95)
    assert at.slider(key="recent").value == sol.spec.recent and at.slider(key="heavy").value == sol.spec.heavy
    assert any(f"{sol.budget} of 64 tokens" in s.value for s in at.success)
    assert float(cards(at)["Attention mass retained"].rstrip("%")) >= 95.0


def test_presentation_mode_puts_the_main_chart_first_and_folds_the_extras():
    at = run(present="1")  # the attention chart first, then the error chart
    charts = [c.proto.id for c in plotly_charts(at)]
    assert charts[0].endswith("attention_chart") and charts[1].endswith("error_chart")
    assert [m.label for m in at.metric] == ["Attention kept", "Memory saved", "Tokens kept"]
    assert at.toggle(key="_ylock_on").value and float(at.query_params["ylock"]) > 0  # locked by default
    assert any(e.label.startswith("Notes (") for e in at.expander)  # the explanations folded
    assert not [e for e in at.expander if e.label == "All numbers"]
    assert not at.title and any("explorer" in h.value for h in at.subheader)


def test_downloads_are_named_by_their_settings_and_say_what_they_hold():
    from kvviz.app import explorer as ux

    comp = compare(
        handbook_trace(),
        Spec(sink=4, recent=8, heavy=2, key_bits=4, value_bits=4),
        View(ensemble="seeds", ensemble_size=8),
    )
    assert ux.slug(comp.spec, "handbook") == "kvviz-handbook-h2o-s4-r8-h2-k4v4bit"
    assert ux.slug(Spec(), "synthetic") == "kvviz-synthetic-no-eviction-16bit"
    header = ux.settings_header(comp, "handbook example", "http://x/?bits=4", "ci95")
    lines = header.splitlines()
    assert all(line.startswith("# ") for line in lines)
    assert "settings: h2o sink 4 recent 8 heavy 2, K4/V4-bit" in header and "N = 8 rows" in header
    assert "error_ci95_lo/hi: 95% t-interval" in header and "the chart draws: 95% t-interval" in header
    import io

    import pandas as pd
    from kvviz.analysis.frames import token_frame

    csv_text = header + token_frame(comp).to_csv(index=False)
    back = pd.read_csv(io.StringIO(csv_text), comment="#")
    assert len(back) == 64 and "error_ci95_lo" in back.columns
    from kvviz.plots import export

    html = export.figures_html([], "t", metrics=comp.metrics, about=header, link="http://x/?bits=4")
    assert "Open this view in kvviz" in html and "mass_retained" in html and "layer 0, query head 0" in html


def test_real_text_opens_on_a_typical_head_and_the_grid_shades_and_separates(tmp_path, monkeypatch):
    from kvviz.sources import save_trace
    from kvviz.trace import trace_with
    from kvviz.app.sidebar import typical_head

    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path))
    syn = make_synthetic(SyntheticSpec(context=48, steps=4, layers=3, q_heads=4, kv_heads=2))
    text = trace_with(syn, tokens=tuple(f"w{i}" for i in range(syn.n_positions)), meta={"source": "model"})
    save_trace(text, tmp_path / "text.safetensors")
    at = run(source="file", sink=2, recent=4, heavy=4)
    layer, head, why = typical_head(text)
    assert (at.number_input(key="layer").value, at.number_input(key="head").value) == (layer, head)
    assert any("median of all 12 heads" in i.value for i in at.info)
    grid = next(h.proto.body for h in at.get("html") if "generated →" in h.proto.body)
    assert grid.index("generated →") < grid.index(">w48<")  # the separator sits before token 48
    assert "heavy hitter" in grid and "kept (no eviction)" not in grid  # only classes that occur
    at.radio(key="grid_shade").set_value("error").run()
    grid = next(h.proto.body for h in at.get("html") if "generated →" in h.proto.body)
    assert "attention lowered by compression" in grid
    # a link that names the head keeps it
    again = run(source="file", sink=2, recent=4, heavy=4, layer=0, head=0)
    assert again.number_input(key="head").value == 0 and not any("median of all" in i.value for i in again.info)


# --- folded means idle ------------------------------------------------------------------


def test_folded_sections_compute_nothing_until_opened_then_once(monkeypatch):
    """The budget ledger, the rotation heatmap and the layer x head overview compute nothing while their
    expanders are closed; opening one computes it once, and a rerun that changes nothing reuses it."""
    import streamlit as st

    from kvviz.app import formats, ledger, overview

    calls = {"ledger": 0, "rotation": 0, "overview": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(ledger, "budget_ledger", counted("ledger", ledger.budget_ledger))
    monkeypatch.setattr(formats, "rotation_effect", counted("rotation", formats.rotation_effect))
    monkeypatch.setattr(overview, "run_head_grid", counted("overview", overview.run_head_grid))
    st.cache_resource.clear()
    at = run(**SMALL, sink=5, heavy=7)
    at.slider(key="heavy").set_value(9).run()  # a move with everything folded
    assert calls == {"ledger": 0, "rotation": 0, "overview": 0}
    assert not [c for c in plotly_charts(at) if "after the Hadamard rotation" in c.proto.spec]
    assert not at.dataframe  # "All numbers" folded: no table (nor the data grid's scripts) on the page
    assert len(unfold(at, "_numbers_open").dataframe) == 2
    for key, name in (("_ledger_open", "ledger"), ("_rotation_open", "rotation"), ("_overview_open", "overview")):
        unfold(at, key)
        assert calls[name] == 1, (name, calls)
    opened = dict(calls)
    at.run()  # open, nothing changed: cached
    assert calls["ledger"] == opened["ledger"] and calls["rotation"] == opened["rotation"]
    at.slider(key="heavy").set_value(10).run()  # open and a budget move: the ledger follows
    assert calls["ledger"] == opened["ledger"] + 1 and calls["rotation"] == opened["rotation"]


def test_warm_up_runs_once_in_the_background_and_not_at_import():
    """Importing the app starts nothing; warm_up() (every page's head, on the first page view) loads numba, the
    kernel, the
    first move's modules and the Explorer's charts' plotly classes (~700 modules that building the first figure imported
    in the first page run) in one background thread, once per process."""
    import subprocess
    import sys

    code = """
import sys, threading
import kvviz.app.compute as compute
assert not compute._warmed and 'numba' not in sys.modules, 'warmed at import'
assert 'plotly.graph_objs._bar' not in sys.modules and 'kvviz.plots.lesson' not in sys.modules
assert not [t for t in threading.enumerate() if t.name == 'kvviz-warm-up']
first = compute.warm_up()
assert compute.warm_up() is first
assert [t.name for t in threading.enumerate()].count('kvviz-warm-up') <= 1
assert first.wait(300)
assert 'numba' in sys.modules and 'kvviz.analysis.solve' in sys.modules and 'scipy.stats' in sys.modules
assert 'plotly.graph_objs._bar' in sys.modules and 'plotly.graph_objs.bar._error_y' in sys.modules
assert 'kvviz.plots.lesson' in sys.modules
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_explorers_first_run_sends_its_charts_to_draw_after_the_paint_and_folded_sections_wait():
    """A session's first run: the cards are drawn, and each chart comes with its figure, to be drawn in place
    once the browser has painted the page (kvviz.app.livechart), in a frame as tall as the figure -- no
    second run needed. The folded sections (Advanced, the solver) hold no widget until they are opened."""
    from kvviz.app import livechart

    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.metric) == 8
    mounted = at.get("bidi_component")
    assert [b.proto.component_name for b in mounted] == [livechart.NAME] * 2
    charts = plotly_charts(at)
    assert [c.key for c in charts] == ["attention_chart", "error_chart"]
    for chart, component in zip(charts, mounted):
        assert json.loads(component.proto.bytes)["height"] == json.loads(chart.proto.spec)["layout"]["height"]
    assert not [c for c in at.caption if c.value == "Drawing the chart…"]
    assert "scorer" not in [b.key for b in at.selectbox] and "solve_kind" not in [r.key for r in at.radio]
    unfold(unfold(at, ADVANCED), "_solver_open")
    assert "scorer" in [b.key for b in at.selectbox] and "solve_kind" in [r.key for r in at.radio]


def test_without_streamlits_plotly_code_the_explorer_draws_st_plotly_chart(monkeypatch):
    """Where a Streamlit upgrade renames its plotly chunk (kvviz.app.internals.plotly_chunk says None), the
    Explorer's charts are st.plotly_chart's, with the same figures."""
    from kvviz.app import internals

    drawn_in_place = [json.loads(c.proto.spec) for c in plotly_charts(run())]
    monkeypatch.setattr(internals, "plotly_chunk", lambda: None)
    at = run()
    assert not at.get("bidi_component") and len(at.get("plotly_chart")) == 2
    assert [json.loads(c.proto.spec) for c in at.get("plotly_chart")] == drawn_in_place


def test_a_chart_whose_points_can_be_picked_is_drawn_in_place_and_reports_clicks():
    """The Trade-offs chart (a click on a point opens it in the Explorer) is drawn in place like the rest, told
    to report a click; the Explorer's charts are not (a click on a bar reruns nothing)."""
    from kvviz.app import livechart

    def told(at):
        return {
            b.proto.id.split("-", 2)[2]: json.loads(b.proto.bytes)["select"]
            for b in at.get("bidi_component")
            if b.proto.component_name == livechart.NAME
        }

    assert told(run(TRADEOFFS)) == {"tradeoff_chart": True}
    assert told(run()) == {"attention_chart": False, "error_chart": False}


def test_advice_is_never_impossible():
    """A link with sink=1e9 is clamped to the 64 tokens: the warning names the sliders that can bring
    eviction back, never "Lower the Heavy-hitter budget below 0"."""
    from kvviz.analysis.readout import budget_warnings

    at = run(sink="1e9")
    text = warnings(at)
    assert "Lower the Sink tokens or the Recent window" in text and "below 0" not in text
    for sink in range(0, 70):  # every advice that names a number names one the slider can reach
        for w in budget_warnings(Spec(sink=sink, recent=8, heavy=60), 64):
            for n in re.findall(r"below (-?\d+)", w):
                assert int(n) >= 1, w


def test_all_budgets_at_zero_say_that_they_turn_eviction_off():
    """Every slider at 0 keeps every token while sink 1 alone keeps one: the page says why, beside the
    numbers, and says nothing of it once any budget is set."""
    at = run(sink="0", recent="0", heavy="0", bits="16", ensemble="none")
    (note,) = [i.value for i in at.info if "turns eviction off" in i.value]
    assert "every token is kept" in note and "nothing is compressed" in note
    assert cards(at)["Tokens kept"].startswith("64")
    at = run(sink="0", recent="0", heavy="0", bits="4", ensemble="none")
    (note,) = [i.value for i in at.info if "turns eviction off" in i.value]
    assert "nothing is compressed" not in note
    at = run(sink="1", recent="0", heavy="0", bits="16", ensemble="none")
    assert not [i for i in at.info if "turns eviction off" in i.value]
    assert cards(at)["Tokens kept"].startswith("1")


def test_a_number_typed_out_of_range_is_clamped_with_the_notice_a_link_gets():
    """The boxes have no browser-side min / max (which kept 99999999 in a red box and sent nothing): the
    typed number reaches the app, which clamps it and says so, as it does for a link."""
    at = run()
    at.number_input(key="_box_sink").set_value(99999999).run()
    assert at.slider(key="sink").value == 64 and at.query_params["sink"] == "64"
    assert "Sink tokens 99999999 is out of range (0-64); clamped to 64 tokens." in warnings(at)
    at.number_input(key="_box_sink").set_value(-5).run()
    assert at.slider(key="sink").value == 0 and "clamped to 0 tokens" in warnings(at)
    at = run(path=str(Path(APP).parent / "pages" / "3_model-lab.py"))
    box = next(n for n in at.number_input if n.label.startswith("Prompt tokens"))
    box.set_value(99999).run()
    box = next(n for n in at.number_input if n.label.startswith("Prompt tokens"))
    assert box.value == 512 and "is out of range (8-512); clamped to 512." in warnings(at)
