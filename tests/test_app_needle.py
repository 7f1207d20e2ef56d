"""AppTest for the Needle test page: it opens instantly on a shipped grid (here a small fake
one, so no model loads), the numbers on screen are the cells', the classic-failure preset
and the layer / KV head pickers drive what is shown, and no grid says what to do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from apptest_util import plotly_charts, run_app

from kvviz.analysis import needle

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "5_needle-test.py")
L, H = 4, 2


def _fake_grid() -> needle.NeedleGrid:
    prompts, cells = [], []
    for n in (40, 60):
        for d in (0.0, 1.0):
            ns = 5 if d == 0.0 else n - 12
            tokens = tuple(f"t{i} " for i in range(n))
            prompts.append(
                needle.NeedlePrompt(
                    length=n,
                    depth=d,
                    key="12345",
                    haystack="filler",
                    ids=tuple(range(n)),
                    tokens=tokens,
                    needle_start=ns,
                    needle_end=ns + 4,
                    question_start=n - 6,
                    hay_start=2,
                )
            )
            for scorer in ("full", "streaming", "h2o"):
                kept = np.ones((L, H, n), bool)
                if scorer != "full":
                    kept[:, :, 4 : n - 20] = False  # sinks 4 + a 20-token window
                    kept[1, 1, ns : ns + 2] = scorer == "h2o"  # h2o keeps half the needle in one head
                nk = kept[:, :, ns : ns + 4].mean(axis=2)
                wanted = np.full((L, H), 0.1)
                wanted[2, 1] = 0.5  # the loudest head
                right = scorer == "full" or bool(nk.mean() > 0.5)
                cells.append(
                    needle.NeedleCell(
                        scorer=scorer,
                        length=n,
                        depth=d,
                        budget=1.0 if scorer == "full" else 0.25,
                        bits=16,
                        question_after_compression=False,
                        spec=scorer,
                        budget_tokens=int(kept[0, 0].sum()),
                        key="12345",
                        correct=right,
                        answer="12345. Remember" if right else "98. It is",
                        answer_ids=(1, 2),
                        needle_kept=float(nk.mean()),
                        needle_kept_by_head=tuple(map(tuple, nk)),
                        wanted_mass=float(wanted.mean()),
                        wanted_mass_by_head=tuple(map(tuple, wanted)),
                        kept_mass=float((wanted * nk).mean()),
                        kept_mass_by_head=tuple(map(tuple, wanted * nk)),
                        full_answer="12345. Remember",
                        full_correct=True,
                        kept_packed=needle.cell._pack(kept),
                    )
                )
    return needle.NeedleGrid(
        model="fake", settings={"new_tokens": 8, "haystack": "filler"}, prompts=tuple(prompts), cells=tuple(cells)
    )


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    grid = _fake_grid()
    path = tmp_path / "needle_default.json.gz"
    grid.save(path)
    monkeypatch.setattr(needle, "DEFAULT_FILE", path)
    return grid


def test_opens_on_the_classic_failure_with_the_cells_numbers(shipped):
    at = run_app(PAGE, 120)
    assert any("Needle test" in t.value for t in at.title)
    assert needle.classic_failure(shipped) == ("streaming", 40, 0.0)
    assert [s.value for s in at.subheader][0] == "StreamingLLM · 40 tokens · needle at 0%"
    cell = shipped.cell("streaming", 40, 0.0)
    cards = [m.value for m in at.markdown if "answer" in m.value.lower()]
    assert f"Answer  \n`{cell.answer}`  \n:orange[**✗ wrong**]" in cards
    assert f"Full cache's answer  \n`{cell.full_answer}`  \n:blue[**✓ right**]" in cards
    assert {m.label: m.value for m in at.metric}["Needle tokens kept"] == f"{cell.needle_kept:.0%}" == "0%"
    # the token grid opens on the head that wanted the needle most
    assert at.number_input(key="needle_layer").value == 2 and at.number_input(key="needle_head").value == 1
    chips = [h for h in at.get("html") if "kvviz-needle-grid" in h.proto.body]
    assert len(chips) == 1 and chips[0].proto.body.count("line-through;outline") == 4  # needle, all evicted


def _needle_chips(at) -> str:
    return next(h.proto.body for h in at.get("html") if "kvviz-needle-grid" in h.proto.body)


def test_presenting_shows_the_grid_in_projector_type_without_the_long_caption(shipped):
    """Presentation mode: the grid right under the title, every text of it at 16 px or more (tick labels
    18, subplot titles 16, short enough to fit), the paragraph about the grids left out."""
    import json

    at = run_app(PAGE, present="1")
    assert not [c for c in at.main.caption if "precomputed" in c.value]
    layout = json.loads(plotly_charts(at)[0].proto.spec)["layout"]
    ticks = [v["tickfont"]["size"] for k, v in layout.items() if k.startswith(("xaxis", "yaxis"))]
    assert ticks and min(ticks) >= 18
    titles = layout.get("annotations", [])
    assert titles and min(a["font"]["size"] for a in titles) >= 16
    assert not [a["text"] for a in titles if "(" in a["text"] and "question" in a["text"]]  # the short titles


def test_a_link_opens_a_cell_and_head_and_the_pickers_drive_the_token_grid(shipped):
    # the h2o cell and its one head that keeps half the needle, from the link
    at = run_app(PAGE, 120, nd_cell="h2o:40:0", nd_layer=1, nd_head=1)
    assert [s.value for s in at.subheader][0] == "H2O · 40 tokens · needle at 0%"
    assert _needle_chips(at).count("line-through;outline") == 2  # half the needle evicted in layer 1 head 1
    assert {m.label: m.value for m in at.metric}[
        "Needle tokens kept"
    ] == f"{shipped.cell('h2o', 40, 0.0).needle_kept:.0%}"
    at.number_input(key="needle_layer").set_value(0).run()
    assert not at.exception
    assert _needle_chips(at).count("line-through;outline") == 4  # layer 0: all of it evicted
    assert at.query_params["nd_layer"] == "0" and at.query_params["nd_cell"] == "h2o:40:0"


@pytest.mark.parametrize(
    "key, param, typed, clamped", [("needle_layer", "nd_layer", 99, L - 1), ("needle_head", "nd_head", -5, 0)]
)
def test_a_layer_or_head_typed_out_of_range_is_clamped_with_the_notice_a_link_gets(shipped, key, param, typed, clamped):
    label = {"needle_layer": "Layer", "needle_head": "KV head"}[key]
    at = run_app(PAGE, 120, nd_cell="h2o:40:0")
    at.number_input(key=key).set_value(typed).run()
    assert not at.exception
    assert at.number_input(key=key).value == clamped
    n = L if key == "needle_layer" else H
    notice = f"{label} {typed} is out of range (0-{n - 1}); clamped to {clamped}."
    assert any(notice in w.value for w in at.warning), [w.value for w in at.warning]
    other = {"needle_layer": "needle_head", "needle_head": "needle_layer"}[key]
    assert at.query_params.get(param) in (None, str(clamped))  # the link holds the clamped value
    # a link out of range gets the same notice
    at = run_app(PAGE, 120, nd_cell="h2o:40:0", **{param: 1000})
    assert at.number_input(key=key).value == n - 1 and at.number_input(key=other).value >= 0
    assert any(f"{label} 1000 is out of range (0-{n - 1}); clamped to {n - 1}." in w.value for w in at.warning)


def test_classic_failure_button_selects_it_and_a_bad_link_says_so(shipped):
    at = run_app(PAGE, 120, nd_cell="full:60:1")
    assert [s.value for s in at.subheader][0] == "Full cache · 60 tokens · needle at 100%"
    at.button(key="needle_classic").click().run()
    assert not at.exception
    assert [s.value for s in at.subheader][0] == "StreamingLLM · 40 tokens · needle at 0%"
    assert "nd_cell" not in at.query_params  # the default view leaves the link clean
    at = run_app(PAGE, 120, nd_cell="tova:999:0.5")
    assert any("not in this grid" in w.value for w in at.warning)
    assert [s.value for s in at.subheader][0] == "StreamingLLM · 40 tokens · needle at 0%"


def test_no_shipped_grid_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(needle, "DEFAULT_FILE", tmp_path / "missing.json.gz")
    at = run_app(PAGE, 120)
    assert any("Run it live" in i.value for i in at.info)


def test_run_live_runs_the_grid_with_the_forms_settings_and_shows_it(shipped, monkeypatch):
    import kvviz.app.sources

    asked = {}
    live = needle.NeedleGrid(
        model="live",
        settings=shipped.settings,
        prompts=shipped.prompts,
        cells=tuple(c for c in shipped.cells if c.length == 60),
    )

    def fake_run(model, tokenizer, model_id, request, progress=None):
        asked.update(request.__dict__, model_id=model_id)
        progress(0.5, "half way")
        return live

    monkeypatch.setattr(kvviz.app.sources, "shared_model", lambda name: (None, None, None))
    monkeypatch.setattr(needle, "run_grid", fake_run)
    at = run_app(PAGE, 120)
    submit = [b for b in at.get("form_submit_button")]
    assert submit, "the live form has a submit button"
    submit[0].click().run()
    assert not at.exception
    assert asked["model_id"] == "bundled" and asked["lengths"] == (320,) and asked["depths"] == (0.0, 0.5, 1.0)
    assert asked["budgets"] == (needle.DEFAULT_BUDGET,) and asked["bits"] == (16,)
    assert asked["question_after_compression"] is False and asked["scorers"] == needle.DEFAULT_SCORERS
    assert asked["compress_every"] == 0
    assert any("this session's live run: model live" in c.value for c in at.caption)
    assert [s.value for s in at.subheader][0] == "StreamingLLM · 60 tokens · needle at 0%"


# --- both compression points ----------------------------------------------------------


def _agnostic(grid: needle.NeedleGrid) -> needle.NeedleGrid:
    """The same prompts compressed before the question: here H2O also loses the key at 40 tokens, depth 100%."""
    import dataclasses

    cells = tuple(
        c
        if c.scorer == "full"
        else dataclasses.replace(
            c,
            question_after_compression=True,
            correct=c.correct and not (c.scorer == "h2o" and c.length == 40),
            answer="777" if (c.scorer, c.length) == ("h2o", 40) else c.answer,
        )
        for c in grid.cells
    )
    return dataclasses.replace(grid, settings={**grid.settings, "question_after_compression": True}, cells=cells)


@pytest.fixture
def shipped_pair(tmp_path, monkeypatch):
    aware = _fake_grid()
    aware = needle.NeedleGrid(
        model=aware.model,
        settings={**aware.settings, "question_after_compression": False},
        prompts=aware.prompts,
        cells=aware.cells,
    )
    agnostic = _agnostic(aware)
    path = tmp_path / "needle_default.json.gz"
    needle.save_grids(path, [aware, agnostic])
    monkeypatch.setattr(needle, "DEFAULT_FILE", path)
    return agnostic, aware


def test_the_file_holds_both_grids_and_load_default_picks_one(shipped_pair):
    agnostic, aware = shipped_pair
    path = needle.DEFAULT_FILE
    grids = needle.load_grids(path)
    assert [needle.protocol(g) for g in grids] == ["agnostic", "aware"]  # agnostic first, whatever the file
    assert needle.load_default(path).cells == aware.cells
    assert needle.load_default(path, question_after_compression=True).cells == agnostic.cells


def test_the_page_opens_on_both_grids_each_labelled(shipped_pair):
    import json

    agnostic, aware = shipped_pair
    at = run_app(PAGE, 120)
    fig = json.loads(plotly_charts(at)[0].proto.spec)
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert f"<b>{needle.PROTOCOL_TITLES['agnostic']}</b>" in titles
    assert f"<b>{needle.PROTOCOL_TITLES['aware']}</b>" in titles
    squares = [tuple(d) for t in fig["data"] for d in t["customdata"]]
    assert len(squares) == len(agnostic.cells) + len(aware.cells)
    assert ("h2o", 40, 1.0, "agnostic") in squares and ("h2o", 40, 1.0, "aware") in squares
    marks = {tuple(d): m for t in fig["data"] for d, m in zip(t["customdata"], t["text"])}
    assert marks["h2o", 40, 1.0, "agnostic"] == "✗" and marks["h2o", 40, 1.0, "aware"] == "✓"
    assert [s.value for s in at.subheader][
        0
    ] == "StreamingLLM · 40 tokens · needle at 0% · compressed before the question"
    assert any("one per compression point" in c.value for c in at.caption)


def test_a_link_names_the_grid_and_an_old_link_opens_the_query_aware_one(shipped_pair):
    at = run_app(PAGE, 120, nd_cell="h2o:40:1:agnostic")
    assert [s.value for s in at.subheader][0] == "H2O · 40 tokens · needle at 100% · compressed before the question"
    assert any("`777`" in m.value and "wrong" in m.value for m in at.markdown)
    at = run_app(PAGE, 120, nd_cell="h2o:40:1")
    assert [s.value for s in at.subheader][0] == "H2O · 40 tokens · needle at 100% · compressed after the question"
    at = run_app(PAGE, 120, nd_cell="h2o:40:1:sideways")
    assert any("not in this grid" in w.value for w in at.warning)
