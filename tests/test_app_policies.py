"""AppTest for the allocation and the new scorers' settings in Advanced and
the URL, the budget ledger expander, and the trade-off chart saying what Quest saves."""

from pathlib import Path

import numpy as np
import pytest
from apptest_util import lab_quality, lab_run_metrics, plotly_charts, run_app, share_one_model_load, unfold

from kvviz.app.compression import ADVANCED
from kvviz import Spec, View, compare

from kvviz.plots import tradeoffs
from kvviz.analysis.ledger import budget_ledger
from kvviz.sources.handbook import handbook_trace

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
SMALL = {"source": "synthetic", "context": "96", "steps": "4", "layers": "3"}


def store(at) -> dict:
    return at.session_state["_kvviz_state"]


def test_allocation_and_scorer_settings_round_trip_through_the_url():
    at = run_app(APP, 120, opened=(ADVANCED,), scorer="snapkv", recent=8, allocation="adakv", ada_alpha=0.35, **SMALL)
    s = store(at)
    assert (s["scorer"], s["allocation"], s["ada_alpha"]) == ("snapkv", "adakv", 0.35)
    assert at.selectbox(key="allocation").value == "adakv"
    assert at.number_input(key="ada_alpha").value == 0.35
    assert "adakv-snapkv (alpha 0.35)" in " ".join(c.value for c in at.caption)
    at = run_app(
        APP,
        120,
        opened=(ADVANCED,),
        scorer="expected_attention",
        allocation="pyramid",
        pyr_beta=4,
        ea_horizon=64,
        ea_cov="0",
        **SMALL,
    )
    s = store(at)
    assert (s["allocation"], s["pyr_beta"], s["ea_horizon"], s["ea_cov"]) == ("pyramid", 4.0, 64, False)
    assert at.number_input(key="pyr_beta").value == 4.0 and at.checkbox(key="ea_cov").value is False
    at = run_app(APP, 120, opened=(ADVANCED,), scorer="chunkkv", chunk=6, chunk_scorer="keydiff", recent=8, **SMALL)
    assert (store(at)["chunk"], store(at)["chunk_scorer"]) == (6, "keydiff")
    at = run_app(APP, 120, opened=(ADVANCED,), scorer="quest", page=8, **SMALL)
    assert store(at)["page"] == 8 and at.number_input(key="page").value == 8


def test_impossible_allocation_says_why_and_changes_nothing():
    """The error says why; nothing is computed or drawn from some other setting, the settings stay as
    the link gave them (not silently replaced), and a rerun shows the same."""
    at = run_app(APP, 120, opened=(ADVANCED,), scorer="h2o", allocation="adakv")
    for _ in range(2):
        assert [e.value for e in at.error if "AdaKV" in e.value and "h2o decides again at every step" in e.value]
        assert not at.metric and not plotly_charts(at)
        assert (store(at)["scorer"], store(at)["allocation"]) == ("h2o", "adakv")
        assert dict(at.query_params) == {"allocation": "adakv"}  # h2o is the default: not written
        at.run()


def test_the_ledger_on_the_explorer_shows_the_cores_numbers():
    at = unfold(
        run_app(APP, 120, opened=(ADVANCED,), scorer="quest", sink=4, recent=8, heavy=16, page=4), "_ledger_open"
    )
    exp = [e for e in at.expander if e.label.startswith("Budget ledger")]
    assert len(exp) == 1
    ledger = budget_ledger(handbook_trace(), Spec(sink=4, recent=8, heavy=16, scorer="quest", page_size=4))
    table = exp[0].dataframe[0].value
    assert list(table["kept_tokens"]) == list(ledger.column("kept_tokens"))
    assert list(table["stored_bytes"]) == list(ledger.column("stored_bytes"))
    text = " ".join(m.value for m in exp[0].markdown)
    assert "Quest keeps every token" in text and "reads" in text
    assert any("saves memory read per step, not memory stored" in i.value for i in at.info)


def test_tradeoff_chart_places_quest_by_bytes_read_and_says_so():
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
    from kvviz.analysis.sweep import sweep

    t = make_synthetic(SyntheticSpec(context=64, steps=2))
    rows = sweep(t, ["quest", "snapkv"], [0.25], [16], View(ensemble="heads"))
    quest = next(r for r in rows if r["method"] == "quest")
    snap = next(r for r in rows if r["method"] == "snapkv")
    assert quest["saves"] == "memory read" and snap["saves"] == "memory stored"
    assert quest["memory_ratio"] > 1 > quest["memory_read_ratio"]
    fig = tradeoffs.tradeoff_figure(rows, "tv")
    trace = next(d for d in fig.data if d.legendgroup == "quest" and d.name)
    assert "saves memory read" in trace.name
    np.testing.assert_allclose(trace.x, [quest["memory_read_ratio"]])
    c = compare(t, Spec(sink=4, recent=6, heavy=6, scorer="quest"), View())
    assert c.memory.bytes_read < c.memory.kv_bytes


def test_timeline_with_new_scorers_and_ragged_caches():
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
    from kvviz.analysis.timeline import timeline

    t = make_synthetic(SyntheticSpec(context=96, steps=6))
    spec = Spec(sink=4, recent=8, heavy=12, scorer="oracle", allocation="adakv")  # scorer: set per policy
    tl = timeline(t, spec, layer=1, kv_head=0, policies=("snapkv", "oracle", "quest", "expected_attention", "h2o"))
    assert "AdaKV" in tl.skipped["h2o"] and "h2o" not in tl.policies
    from kvviz.engine import kept_at_query

    for name in ("snapkv", "oracle", "quest", "expected_attention"):
        s = spec.with_(scorer=name)
        for i, qi in enumerate(t.later_queries):
            p = int(t.query_positions[qi])
            np.testing.assert_array_equal(tl.policies[name].kept[i, : p + 1], kept_at_query(t, s, 1, int(qi))[0])
    at = run_app(
        str(ROOT / "pages" / "4_decode-timeline.py"),
        120,
        allocation="adakv",
        tl_policies="snapkv,h2o,quest",
        **{"source": "synthetic", "context": "96", "steps": "6"},
    )
    assert any("H2O is not drawn" in i.value for i in at.info)


@pytest.mark.model
@pytest.mark.slow
def test_model_lab_runs_adakv_snapkv_with_the_cores_numbers(monkeypatch):
    load_once = share_one_model_load(monkeypatch)  # the page and this test share one load
    at = run_app(
        str(ROOT / "pages" / "3_model-lab.py"), 300, sink=4, recent=8, heavy=8, scorer="snapkv", allocation="adakv"
    )
    shown = lab_run_metrics(at, prompt=48, cont=10, greedy=0)
    q = lab_quality(load_once, Spec(sink=4, recent=8, heavy=8, scorer="snapkv", allocation="adakv"), 48, 10)
    assert shown["Perplexity (compressed)"] == f"{q.perplexity:.2f}"
