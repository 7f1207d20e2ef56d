"""The leaderboard: its tasks, its cells on the bundled model, its table, chart, CSV and study file."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pytest

from kvviz.analysis import leaderboard as lb
from kvviz.analysis.needle import TASKS, passkey, spec_for
from kvviz.policies import get_policy
from kvviz.spec import Spec, SpecError

ROOT = Path(__file__).resolve().parents[1]


def test_each_task_scores_exactly_its_key():
    digits, word = TASKS["multikey"], TASKS["qa"]
    assert digits.score(" 48213. Remember", "48213") and not digits.score(" 4821 3", "48213")
    assert not digits.score("The key is 48212", "48213")
    assert word.score(" Mango.", "Mango") and word.score("mango", "Mango") and not word.score(" a mango", "Mango")


def test_instances_are_seeded_and_the_pass_key_is_the_needle_tests_own():
    for task in TASKS.values():
        a, b = task.instance(0, 256, 0.25), task.instance(0, 256, 0.25)
        assert a == b and a.key in a.needle and a.question and a.primer
    assert TASKS["passkey"].instance(3, 320, 0.5).key == passkey(3, 320, 0.5)
    keys = {TASKS["passkey"].instance(0, 256, d).key for d in (0.0, 0.25, 0.5, 0.75, 1.0)}
    assert len(keys) == 5
    multi = TASKS["multikey"].instance(0, 256, 0.25)
    assert multi.needle.count("pass key is") == 2 and multi.key in multi.needle


def test_the_request_is_checked_before_any_model():
    with pytest.raises(SpecError, match="unknown task 'nope'"):
        lb.BoardRequest(tasks=["nope"]).check()
    with pytest.raises(SpecError, match="unknown protocol"):
        lb.BoardRequest(protocols=["sometimes"]).check()
    with pytest.raises(SpecError, match="compression ratios"):
        lb.BoardRequest(ratios=[1.0]).check()
    with pytest.raises(SpecError, match="unknown scorer 'bogus'"):
        lb.BoardRequest(methods=["bogus"]).check()
    assert len(lb.METHODS) >= 15 and lb.BoardRequest().n_cells == 2 * 6 * (1 + 4 * len(lb.METHODS)) == 924


def test_a_method_that_keeps_its_own_count_is_set_for_the_budget():
    """DuoAttention's share: a retrieval head keeps n, a streaming head sinks + window, and on average they
    keep the budget; a threshold falls as the budget grows."""
    for fraction in (0.75, 0.5, 0.25, 0.125):
        spec = spec_for("duo_attention", fraction, 16, 256)
        b, protected = round(fraction * 256), spec.sink + spec.recent
        assert 256 - spec.duo_streaming * (256 - protected) == pytest.approx(b)
    thresholds = [spec_for("threshold", f, 16, 256).threshold for f in (0.125, 0.25, 0.5, 0.75)]
    assert all(a > b for a, b in zip(thresholds, thresholds[1:]))
    # a budget method's spec is not changed
    assert get_policy("snapkv").fit_budget(Spec(sink=4, recent=8, heavy=8, scorer="snapkv"), 20, 100) == Spec(
        sink=4, recent=8, heavy=8, scorer="snapkv"
    )


def test_the_study_file_runs_the_leaderboards_cells():
    from kvviz.analysis.study import load_study
    from kvviz.analysis.study.grid import cells

    study = load_study(ROOT / "examples" / "studies" / "leaderboard.toml")
    got = cells(study)
    req = lb.BoardRequest()
    assert len(got) == req.n_cells
    scorers = {c.settings["scorer"] for c in got}
    assert scorers == {"full", *req.methods}
    assert {c.settings.get("task", "passkey") for c in got} == set(req.tasks)
    assert {c.settings["protocol"] for c in got} == set(req.protocols)
    assert {c.settings["budget"] for c in got if c.settings["scorer"] != "full"} == {
        round(1 - r, 6) for r in req.ratios
    }


def test_cli_errors_are_one_line_before_any_model_loads(capsys, monkeypatch):
    import kvviz.models
    from kvviz.cli import main

    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["leaderboard", "--tasks", "passkey,nope", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "unknown task 'nope'" in err and err.count("\n") == 1


# --- the bundled model ---------------------------------------------------------------------

SMALL = lb.BoardRequest(methods=["snapkv", "duo_attention"], ratios=[0.5], tasks=["passkey", "qa"], depths=[0.5])


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    from apptest_util import load_shared

    model, tokenizer, _ = load_shared("bundled")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVVIZ_CACHE_DIR", str(tmp_path_factory.mktemp("leaderboard-cache")))
    heard = []
    try:
        fresh = lb.run(model, tokenizer, "bundled", SMALL, progress=lambda f, m: heard.append((f, m)))
        again = lb.run(None, None, "bundled", SMALL, load=lambda: pytest.fail("a cached rerun loaded the model"))
    finally:
        mp.undo()
    return fresh, again, heard


@pytest.mark.model
@pytest.mark.slow
def test_the_uncompressed_model_solves_the_task_set(board):
    fresh, again, heard = board
    assert len(fresh.cells) == SMALL.n_cells == 2 * 2 * (1 + 2)
    assert fresh.full_accuracy() == {"passkey": 1.0, "qa": 1.0}
    assert again.cells == fresh.cells  # from the disk cache, identical
    fractions = [f for f, _ in heard]
    assert fractions == sorted(fractions) and 0.9 < fractions[-1] <= 1.0
    assert any("min left" in m for _, m in heard)  # an estimate of the time left


@pytest.mark.model
@pytest.mark.slow
def test_the_ratio_reached_is_what_the_caches_hold(board):
    fresh, *_ = board
    rows = {(s["protocol"], s["method"]): s for s in fresh.scores()}
    for protocol in SMALL.protocols:
        assert rows[(protocol, "full")]["ratio_reached"] == 0.0
    # question-aware: the budget is the prompt's half, to rounding; DuoAttention about it (whole heads)
    assert rows[("question-aware", "snapkv")]["ratio_reached"] == pytest.approx(0.5, abs=0.01)
    assert rows[("question-aware", "duo_attention")]["ratio_reached"] == pytest.approx(0.5, abs=0.05)
    table = lb.format_board(fresh)
    assert "question-aware" in table and "query-agnostic" in table and "snapkv" in table
    rows_csv = list(csv.DictReader(io.StringIO(fresh.to_csv())))
    assert len(rows_csv) == len(fresh.cells) and set(rows_csv[0]) == set(lb.FIELDS)


@pytest.mark.model
@pytest.mark.slow
def test_the_chart_has_a_line_per_method_and_protocol(board):
    from kvviz.plots.leaderboard import leaderboard_figure

    fresh, *_ = board
    fig = leaderboard_figure(fresh)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert len(lines) == len(SMALL.methods) * len(SMALL.protocols)
    assert sum(t.showlegend for t in lines) == len(SMALL.methods)
    for t in lines:
        assert all(0 <= y <= 100 for y in t.y) and np.all(np.asarray(t.x) >= 0)


# --- the shipped board and the page ---------------------------------------------------------


def test_the_shipped_board_is_the_default_request_complete():
    board = lb.Board.load(lb.DEFAULT_FILE)
    req = board.request
    assert req == lb.BoardRequest() and len(board.cells) == req.n_cells
    assert len(req.methods) >= 15 and len(req.ratios) == 4 and len(req.protocols) == 2
    full = board.full_accuracy()
    assert set(full) == set(req.tasks) and np.mean(list(full.values())) >= 0.8
    scores = board.scores()
    assert {(s["protocol"], s["method"], s["ratio"]) for s in scores} == {
        *((p, m, round(r, 6)) for p in req.protocols for m in req.methods for r in req.ratios),
        *((p, "full", 0.0) for p in req.protocols),
    }
    assert all(s["cells"] == len(req.tasks) * len(req.depths) for s in scores)
    budgeted = [s for s in scores if s["method"] in ("snapkv", "streaming", "adakv-snapkv")]
    assert all(abs(s["ratio_reached"] - s["ratio"]) < 0.02 for s in budgeted if s["protocol"] == "question-aware")


def test_the_trade_offs_page_shows_the_board_when_opened():
    from apptest_util import run_app

    page = str(ROOT / "pages" / "1_trade-offs.py")
    closed = run_app(page, 120)

    def heading(at):
        return [m.value for m in at.markdown if "% right at each compression ratio" in m.value]

    assert heading(closed) == []  # folded: nothing drawn
    at = run_app(page, 120, opened=("_leaderboard_open",))
    assert len(heading(at)) == 2 and not at.error
    tables = [d.value for d in at.dataframe[-2:]]  # one per protocol, after the Pareto table
    for table in tables:
        assert len(table) == len(lb.METHODS) and "Oracle (the bound)" in list(table["method"])
        assert list(table.columns) == ["method", "0.25", "0.5", "0.75", "0.875"]
        assert all(str(v).endswith("%") or "reached" in str(v) for v in table["0.5"])
