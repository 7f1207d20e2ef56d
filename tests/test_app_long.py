"""A long row in the Explorer: the charts' token range (boxes, paging buttons, the whole
row again), in the link; and the token grid's pages."""

import json
from pathlib import Path

import numpy as np
from apptest_util import plotly_charts, plotly_values, run_app

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
LONG = dict(source="synthetic", context="1024", steps="0", layers="1", q_heads="2", kv_heads="1")


def chart_x(at, i: int) -> list:
    """The x values of the page's i-th chart, as the browser gets them (plotly's binary arrays decoded)."""
    fig = json.loads(plotly_charts(at)[i].proto.spec)
    return sorted({int(x) for t in fig["data"] for x in plotly_values(t.get("x", []))})


def store(at) -> dict:
    return at.session_state["_kvviz_state"]


def test_the_range_boxes_zoom_the_charts_to_single_tokens_and_page_by_its_width():
    at = run_app(APP, **LONG)
    assert at.number_input(key="zoom_from").value == 0 and at.number_input(key="zoom_to").value == 1023
    assert any("bins of up to 8 tokens" in c.value for c in at.caption)
    at.number_input(key="zoom_from").set_value(100).run()
    at.number_input(key="zoom_to").set_value(149).run()
    assert not at.exception
    assert (store(at)["zoom_from"], store(at)["zoom_to"]) == (100, 149)
    assert chart_x(at, 0) == list(range(100, 150)) and chart_x(at, 1) == list(range(100, 150))
    at.button(key="_zoom_ahead").click().run()  # the next 50 tokens
    assert (at.number_input(key="zoom_from").value, at.number_input(key="zoom_to").value) == (150, 199)
    assert chart_x(at, 0) == list(range(150, 200))
    at.button(key="_zoom_back").click().run()
    assert chart_x(at, 0) == list(range(100, 150))
    at.number_input(key="zoom_from").set_value(123).run()
    at.number_input(key="zoom_to").set_value(123).run()
    assert chart_x(at, 0) == [123]  # one token
    at.button(key="_zoom_all").click().run()
    assert store(at)["zoom_to"] == -1 and at.number_input(key="zoom_to").value == 1023


def test_a_linked_range_opens_zoomed_and_a_range_past_the_row_is_clamped():
    at = run_app(APP, zoom_from="1000", zoom_to="2000", **LONG)
    assert at.number_input(key="zoom_to").value == 1023 and store(at)["zoom_to"] == -1
    assert any("to token 2000 is out of range (0-1023); clamped to 1023." in w.value for w in at.warning)
    assert chart_x(at, 0) == list(range(1000, 1024))
    at = run_app(APP, zoom_from="5000", **LONG)
    assert at.number_input(key="zoom_from").value == 1023
    assert any("clamped to 1023" in w.value for w in at.warning)
    assert chart_x(at, 0) == [1023]


def test_a_short_row_has_no_range_boxes():
    at = run_app(APP, **{**LONG, "context": "200"})
    assert not [b for b in at.number_input if b.key in ("zoom_from", "zoom_to")]


def test_the_token_grid_of_a_long_text_is_paged_from_its_last_page(tmp_path, monkeypatch):
    import dataclasses

    from kvviz.app.overview import GRID_MAX_TOKENS
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
    from kvviz.sources.tracefile import save_trace

    folder = tmp_path / "traces"
    folder.mkdir()
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVVIZ_TRACE_DIRS", str(folder))
    n = GRID_MAX_TOKENS + 500
    t = make_synthetic(SyntheticSpec(context=n, steps=0, layers=1, q_heads=2, kv_heads=1))
    words = tuple(f"w{i}" for i in range(n))  # a real text's tokens (a capture's source), not t0, t1, ...
    save_trace(dataclasses.replace(t, tokens=words, meta={**t.meta, "source": "model"}), folder / "long.safetensors")
    at = run_app(APP, source="file", tf_how="saved")
    box = at.number_input(key="grid_page")
    assert box.label == "Page (of 2)" and box.value == 1 and store(at)["grid_page"] == -1
    page = next(h.proto.body for h in at.get("html") if f">w{n - 1}<" in h.proto.body)
    assert f">w{GRID_MAX_TOKENS}<" in page and f">w{GRID_MAX_TOKENS - 1}<" not in page
    assert any(f"Tokens {GRID_MAX_TOKENS}-{n - 1} of {n}" in c.value for c in at.caption)
    box.set_value(0).run()
    assert not at.exception and store(at)["grid_page"] == 0
    page = next(h.proto.body for h in at.get("html") if ">w0<" in h.proto.body)
    assert f">w{GRID_MAX_TOKENS - 1}<" in page and f">w{GRID_MAX_TOKENS}<" not in page


def test_a_big_trace_opens_on_the_median_head_of_its_middle_layer(monkeypatch):
    """Past TYPICAL_ALL_LAYERS_BYTES of keys the typical head is chosen within the middle layer (one layer
    read, not every layer of a 3 GB file); below it, among every layer and head."""
    from kvviz.analysis.frames import concentration
    from kvviz.app import sidebar
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

    t = make_synthetic(SyntheticSpec(context=96, steps=0, layers=5, q_heads=4, kv_heads=2))
    top10 = concentration(t, fractions=np.array([0.1])).top10
    layer, head, why = sidebar.typical_head(t)
    flat = np.argsort(top10, axis=None, kind="stable")
    assert (layer, head) == np.unravel_index(flat[len(flat) // 2], top10.shape) and "all 20 heads" in why
    monkeypatch.setattr(sidebar, "TYPICAL_ALL_LAYERS_BYTES", t.k.nbytes - 1)
    layer, head, why = sidebar.typical_head(t)
    assert layer == 2 and head == np.argsort(top10[2], kind="stable")[2]
    assert "the 4 heads of layer 2 (a big trace: one layer read)" in why
