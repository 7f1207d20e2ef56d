"""The Studies page (AppTest): it draws a study folder's frontier with the study's own numbers,
refuses any folder outside the studies root, runs the shipped example; a clicked cell's setting
maps back to the Explorer's and the Model lab's controls exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from apptest_util import app_test, plotly_charts, plotly_values, run_app

from kvviz.analysis.study import StudyDir, parse_study, run_study
from kvviz.analysis.study.frontier import frontier
from tests.test_study import SMALL

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "6_studies.py")


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    r = tmp_path / "runs"
    r.mkdir()
    monkeypatch.setenv("KVVIZ_STUDIES_DIR", str(r))
    return r


@pytest.fixture(scope="module")
def small_study(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study") / "small"
    run_study(parse_study(SMALL), out)
    return out


def _copy(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    return dest


def chart_spec(at) -> dict:
    return json.loads(plotly_charts(at)[0].proto.spec)


def test_the_page_draws_a_study_with_its_own_means_and_error_bars(root, small_study):
    _copy(small_study, root / "small")
    at = run_app(PAGE, study="small", st_metric="tv")
    assert not at.error
    assert any("small: 12 cells, 12 done, 0 to run" in c.value for c in at.caption)
    spec = chart_spec(at)
    fr = frontier(StudyDir(root / "small").rows(), "synthetic", "tv")
    drawn = {
        (t["name"], tuple(round(x, 12) for x in plotly_values(t["x"]))): (
            plotly_values(t["y"]),
            plotly_values(t["error_y"]["array"]),
        )
        for t in spec["data"]
        if t.get("error_y")
    }
    assert len(drawn) == 6  # (h2o, streaming, full) x (16, 4 bits)
    for (name, xs), (ys, half) in drawn.items():
        for x, y, h in zip(xs, ys, half):
            p = fr.points[(fr.points.x.round(12) == x) & (fr.points["mean"] == y)]
            assert len(p) == 1 and p["half"].iloc[0] == h and p["n"].iloc[0] == 2
    assert "95% t-interval" in spec["layout"]["title"]["text"]
    assert at.query_params["study"] in ("small", ["small"])


@pytest.mark.parametrize("name", ["..", "../outside", "/etc", "small/../../outside", "nope"])
def test_a_folder_outside_the_root_or_not_a_study_is_refused(root, small_study, name):
    _copy(small_study, root.parent / "outside")  # a real study, but not under the root
    at = run_app(PAGE, study=name)
    assert not plotly_charts(at)
    assert at.error and "Cannot open this study" in at.error[0].value
    assert ("outside the studies folder" in at.error[0].value) or ("not a study folder" in at.error[0].value)


def test_a_symlink_out_of_the_root_is_refused(root, small_study):
    _copy(small_study, root.parent / "outside")
    os.symlink(root.parent / "outside", root / "link")
    at = run_app(PAGE, study="link")
    assert not plotly_charts(at) and "outside the studies folder" in at.error[0].value


def test_the_shipped_example_is_listed_and_runs_into_the_root(root):
    at = run_app(PAGE)
    assert any("quarter-cache" in m.value for m in at.markdown)
    assert any("kvviz study run examples/studies/quarter-cache.toml" in c.value for c in at.code)
    at.button(key="run_example_quarter-cache").click().run(timeout=300)
    assert not at.exception, [e.value for e in at.exception]
    assert StudyDir(root / "quarter-cache").status_line() == "study quarter-cache: 36 cells, 36 done, 0 to run"
    assert plotly_charts(at) and at.query_params["study"] in ("quarter-cache", ["quarter-cache"])


def test_presenting_with_no_study_open_offers_the_example_the_page_points_to(root, small_study):
    """'Run the shipped example below': in presentation mode as well, until a study is open."""
    at = run_app(PAGE, present="1")
    assert any("run the shipped example below" in i.value for i in at.info)
    assert [e.label for e in at.expander] == ["Shipped example study"]
    assert "run_example_quarter-cache" in [b.key for b in at.button]
    _copy(small_study, root / "small")
    at = run_app(PAGE, present="1", study="small")
    assert not at.exception and len(plotly_charts(at)) == 1
    assert "run_example_quarter-cache" not in [b.key for b in at.button]  # a lecture shows the study
    layout = json.loads(plotly_charts(at)[0].proto.spec)["layout"]  # at a projector's sizes
    assert layout["xaxis"]["tickfont"]["size"] >= 16 and layout["legend"]["font"]["size"] >= 16


def test_a_clicked_cell_maps_to_the_explorer_and_the_model_lab_exactly(small_study):
    from kvviz.analysis.study.grid import model_spec
    from kvviz.analysis.sweep import point_spec
    from kvviz.app.compression import spec_from_values
    from kvviz.app.params import PARAMS
    from kvviz.app.studies import cell_values, values_from_spec
    from kvviz.decode.eval_sweep import QUANT_METHODS, SWEEP_METHODS

    defaults = {n: p.default for n, p in PARAMS.items()}
    for row in StudyDir(small_study).rows().to_dict("records"):
        values, page, notes = cell_values(row)
        assert page == "explorer" and not notes
        assert values["syn_seed"] == row["seed"] and values["context"] == 128 and values["source"] == "synthetic"
        method = row["scorer"]
        want = point_spec(method, int(row["budget_tokens"]), int(row["bits"]), row["format"])
        got = spec_from_values(defaults | values)
        assert got.with_(scorer=want.scorer) == want if method == "full" else got == want
    for method in [*SWEEP_METHODS, *QUANT_METHODS]:
        spec = model_spec(method, 0.25, 4, 128)
        assert spec_from_values(defaults | values_from_spec(spec)) == spec, method
    values, page, notes = cell_values(
        {
            "kind": "model",
            "method": "snapkv",
            "budget": 0.25,
            "bits": 16,
            "prompt_tokens": 128,
            "scored_tokens": 32,
            "text": "texts/x.txt",
        }
    )
    assert page == "model_lab" and values["lab_prompt"] == 128 and values["lab_cont"] == 32
    assert (values["sink"], values["recent"], values["heavy"], values["scorer"]) == (4, 12, 16, "snapkv")
    assert notes and "texts/x.txt" in notes[0]


def test_the_page_loads_with_no_study_and_the_picker_opens_one(root, small_study):
    _copy(small_study, root / "small")
    at = app_test(PAGE)
    at.run()
    assert not at.exception and any("No study open" in i.value for i in at.info)
    assert not plotly_charts(at) and at.selectbox(key="study").options == ["— choose a study —", "small"]
    at.selectbox(key="study").select("small").run()
    assert not at.exception and len(plotly_charts(at)) == 1
    assert at.query_params["study"] in ("small", ["small"])
    at.radio(key="st_metric").set_value("mass_retained").run()  # the choice survives a rerun
    assert at.selectbox(key="study").value == "small" and len(plotly_charts(at)) == 1
    assert "attention mass retained" in chart_spec(at)["layout"]["yaxis"]["title"]["text"]
