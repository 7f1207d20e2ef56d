"""Every page names a layer by the model's own number: a trace that holds the model's
layers 3 and 15 offers 3 and 15 on the decode timeline and names the Concentration page's heatmap rows
and the Explorer's overview by them, never by the position in the file (0 and 1)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvviz.analysis.frames import ensemble_text
from kvviz.analysis.timeline import timeline
from kvviz.engine import compare
from kvviz.plots import grids
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.spec import Spec, View
from kvviz.sources.tracefile import save_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_layers():
    """A synthetic trace with decode steps, labelled as the model's layers 3 and 15."""
    t = make_synthetic(SyntheticSpec(context=48, steps=6, layers=2))
    return dataclasses.replace(t, meta={**t.meta, "layers": [3, 15]})


@pytest.fixture
def saved(two_layers, tmp_path, monkeypatch):
    folder = tmp_path / "traces"
    folder.mkdir()
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVVIZ_TRACE_DIRS", str(folder))
    save_trace(two_layers, folder / "two-layers.safetensors")
    return two_layers


def test_a_timeline_and_an_ensemble_over_layers_say_the_models_numbers(two_layers):
    spec = Spec(sink=2, recent=4, heavy=4)
    tl = timeline(two_layers, spec, layer=1, kv_head=0, policies=("h2o",))
    assert (tl.layer, tl.model_layer) == (1, 15)
    comp = compare(two_layers, spec, View(layer=1, head=0, ensemble="layers"))
    assert ensemble_text(comp) == "query head 0 in layers 3, 15"
    heads = compare(two_layers, spec, View(layer=1, head=0, ensemble="heads"))
    assert ensemble_text(heads).endswith("of layer 15")


def test_the_heatmap_names_its_rows_by_the_numbers_it_is_given():
    grid = np.arange(6.0).reshape(2, 3)
    fig = grids.heatmap_figure(grid, "t", "v", layers=(3, 15))
    assert list(fig.data[0].y) == ["3", "15"] and fig.layout.yaxis.title.text == "layer (the model's number)"
    assert list(grids.heatmap_figure(grid, "t", "v").data[0].y) == ["0", "1"]
    with pytest.raises(ValueError, match="2 rows"):
        grids.heatmap_figure(grid, "t", "v", layers=(3,))


def test_the_timeline_page_offers_the_models_layer_numbers(saved):
    from apptest_util import run_app

    at = run_app(
        str(ROOT / "pages" / "4_decode-timeline.py"),
        source="file",
        tf_how="saved",
        sink=2,
        recent=4,
        heavy=4,
        tl_policies="h2o",
    )
    box = at.selectbox(key="tl_layer")
    assert box.label == "Layer (the model's number)" and box.options == ["3", "15"]
    box.set_value(15).run()
    assert not at.exception
    assert at.session_state["_kvviz_state"]["tl_layer"] == 15
    text = " ".join(m.value for m in at.markdown)
    assert "layer 15, KV head 0" in text and "layer 1, KV head" not in text


def test_the_concentration_heatmaps_name_rows_by_the_models_numbers(saved):
    from apptest_util import plotly_charts, run_app

    at = run_app(str(ROOT / "pages" / "2_concentration.py"), source="file", tf_how="saved")
    figs = [c.proto.spec for c in plotly_charts(at)]
    assert len(figs) == 4  # the curves and three layer x head maps
    assert sum('"y":["3","15"]' in f.replace(" ", "") for f in figs) == 3
