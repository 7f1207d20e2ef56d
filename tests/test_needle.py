"""The needle test (kvviz.analysis.needle): prompts, scoring, the disk cache, and on the bundled model
at the shortest length (320 tokens, needle at depth 10%, 25% budget):

- the full cache answers the key exactly;
- StreamingLLM's window (4 sinks + 76 recent) cannot reach the needle, so it is evicted in
  every layer and KV head (forced by the definition), and the cell is scored as the model
  answered;
- the oracle keeps at least as much of the needle's attention mass as every other policy
  at the same budget (and, forced by its definition, at least as much of the whole mass);
- a second run reads every cell from the disk cache and gives identical results.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvviz.analysis import needle
from kvviz.spec import Spec, SpecError

from cli_util import run_cli

LENGTH, DEPTH, BUDGET = 320, 0.1, 0.25
POLICIES = ("streaming", "h2o", "tova", "snapkv", "oracle")


# --- no model ------------------------------------------------------------------------------


def test_exact_match_scoring():
    assert needle.score_answer("71432. Remember it", "71432")
    assert needle.score_answer(" 71432.\n", "71432")
    assert not needle.score_answer("7143", "71432")
    assert not needle.score_answer("714321", "71432")  # the first run of digits must be the key
    assert not needle.score_answer("the key is 12 or 71432", "71432")
    assert not needle.score_answer("no digits at all", "71432")


def test_keys_are_seeded_and_differ_across_cells():
    assert needle.passkey(0, 320, 0.5) == needle.passkey(0, 320, 0.5)
    keys = {needle.passkey(0, n, d) for n in (320, 640) for d in (0, 0.5, 1)}
    assert len(keys) == 6 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert needle.passkey(1, 320, 0.5) != needle.passkey(0, 320, 0.5)


def test_budget_is_a_fraction_of_the_prompt_and_specs_follow_the_model_lab_split():
    assert needle.budget_tokens(0.25, 320) == 80
    assert needle.budget_tokens(0.01, 320) == needle.MIN_BUDGET_TOKENS
    with pytest.raises(SpecError, match="fraction"):
        needle.budget_tokens(1.5, 320)
    s = needle.spec_for("streaming", 0.25, 16, 320)
    assert (s.sink, s.recent, s.heavy, s.scorer) == (4, 76, 0, "streaming")
    h = needle.spec_for("h2o", 0.25, 4, 320)
    assert (h.sink, h.recent, h.heavy, h.budget, h.key_bits, h.value_bits) == (4, 36, 40, 80, 4, 4)
    assert needle.spec_for("full", 0.25, 16, 320) == Spec()
    assert needle.spec_for("full", 0.25, 4, 320).quantizes and not needle.spec_for("full", 0.25, 4, 320).evicts
    with pytest.raises(SpecError, match="unknown scorer"):
        needle.spec_for("nope", 0.25, 16, 320)


def test_lengths_past_the_model_positions_are_refused_with_the_limit():
    with pytest.raises(SpecError, match="past the model's 2048 positions; use lengths up to 2040"):
        needle.check_lengths([320, 4096], 2048, 8, 60)
    with pytest.raises(SpecError, match="at least 60 tokens"):
        needle.check_lengths([40], 2048, 8, 60)
    needle.check_lengths([320, 2040], 2048, 8, 60)


def test_kept_masks_round_trip_through_packed_bits():
    rng = np.random.default_rng(0)
    mask = rng.random((3, 2, 37)) < 0.4
    assert np.array_equal(needle.cell._unpack(needle.cell._pack(mask), mask.shape), mask)


def test_every_cache_the_page_offers_is_named_for_a_reader():
    """The Caches pills and the cell titles: a name ('Expected Attention', 'SnapKV'), never the raw id."""
    from kvviz.plots.needle import scorer_label

    names = [scorer_label(s) for s in needle.SCORER_NAMES]
    assert names[:2] == ["Full cache", "H2O"] and len(set(names)) == len(names)
    for scorer, name in zip(needle.SCORER_NAMES, names):
        assert name != scorer and "_" not in name, (scorer, name)


def test_the_shipped_default_grid_is_complete_and_consistent():
    grid = needle.load_default()
    if grid is None:
        pytest.skip("no shipped grid yet (scripts/needle_default.py writes it)")
    s = grid.settings
    assert grid.model == "bundled" and s["budgets"] == [needle.DEFAULT_BUDGET] and s["bits"] == [16]
    assert grid.scorers == list(needle.DEFAULT_SCORERS)
    assert len(grid.cells) == len(grid.scorers) * len(s["lengths"]) * len(s["depths"])
    for p in grid.prompts:
        assert len(p.ids) == len(p.tokens) == p.length
        assert p.key in "".join(p.tokens[p.needle_start : p.needle_end])
        full = grid.cell("full", p.length, p.depth)
        stream = grid.cell("streaming", p.length, p.depth)
        spec = needle.spec_for("streaming", needle.DEFAULT_BUDGET, 16, p.length)
        if spec.sink <= p.needle_start and p.needle_end <= p.length - spec.recent:
            assert stream.needle_kept == 0.0  # out of the window: gone, by definition
        if p.needle_start >= p.length - spec.recent:
            assert stream.needle_kept == 1.0
        for name in grid.scorers:
            c = grid.cell(name, p.length, p.depth)
            kept = c.kept()
            assert np.all(kept.sum(axis=2) == c.budget_tokens)
            assert np.allclose(kept[:, :, p.needle_start : p.needle_end].mean(axis=2), c.needle_kept_by_head)
            assert c.full_answer == full.answer and c.correct == needle.score_answer(c.answer, c.key)


# --- the bundled model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    from apptest_util import load_shared

    model, tokenizer, _ = load_shared("bundled")  # one load per test process
    return model, tokenizer


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("needle-cache")


@pytest.fixture(scope="module")
def runs(bundled, cache_folder):
    """The same small grid twice: fresh into an empty cache folder, then from it."""
    model, tokenizer = bundled
    mp = pytest.MonkeyPatch()
    mp.setenv("KVVIZ_CACHE_DIR", str(cache_folder))
    try:
        request = needle.GridRequest(lengths=[LENGTH], depths=[DEPTH], scorers=["full", *POLICIES], budgets=[BUDGET])
        s1, s2 = {}, {}
        fresh = needle.run_grid(model, tokenizer, "bundled", request, stats=s1)
        again = needle.run_grid(model, tokenizer, "bundled", request, stats=s2)
    finally:
        mp.undo()
    return fresh, again, s1, s2


@pytest.mark.model
def test_prompt_has_the_asked_length_and_the_needle_where_it_says(bundled):
    _, tokenizer = bundled
    p = needle.build_prompt(tokenizer, LENGTH, DEPTH)
    assert len(p.ids) == len(p.tokens) == LENGTH
    assert "".join(p.tokens[p.needle_start : p.needle_end]).strip() == needle.NEEDLE_TEMPLATE.format(key=p.key)
    assert "".join(p.tokens[p.question_start :]).lstrip().startswith(needle.QUESTION)
    assert "".join(p.tokens).rstrip().endswith(needle.PRIMER.rstrip())
    assert abs(p.needle_depth - DEPTH) < 0.06  # snapped to the nearest sentence end
    with pytest.raises(SpecError, match="at least"):
        needle.build_prompt(tokenizer, 20, 0.5)


@pytest.mark.model
@pytest.mark.slow
def test_full_cache_answers_the_key(runs):
    fresh, *_ = runs
    full = fresh.cell("full", LENGTH, DEPTH)
    assert full.correct and full.answer.lstrip().startswith(full.key)
    assert full.needle_kept == 1.0 and full.kept_mass == pytest.approx(full.wanted_mass)
    assert full.budget_tokens == LENGTH and full.spec == "no compression"
    for c in fresh.cells:
        assert c.full_answer == full.answer and c.full_correct


@pytest.mark.model
@pytest.mark.slow
def test_streaming_window_that_cannot_reach_the_needle_evicts_it_everywhere(runs):
    fresh, *_ = runs
    p = fresh.prompt(LENGTH, DEPTH)
    c = fresh.cell("streaming", LENGTH, DEPTH)
    spec = needle.spec_for("streaming", BUDGET, 16, LENGTH)
    assert spec.sink <= p.needle_start and p.needle_end <= LENGTH - spec.recent  # out of reach, by position
    by_head = np.array(c.needle_kept_by_head)
    assert by_head.shape == (30, 3) and np.all(by_head == 0.0) and c.needle_kept == 0.0
    assert c.kept_mass == 0.0 and c.wanted_mass > 0.0
    kept = c.kept()
    assert not kept[:, :, p.needle_start : p.needle_end].any()
    assert np.all(kept.sum(axis=2) == spec.budget)
    assert c.correct == needle.score_answer(c.answer, c.key)  # scored as the model answered


@pytest.mark.model
@pytest.mark.slow
def test_oracle_keeps_the_most_needle_mass_at_the_same_budget(runs):
    fresh, *_ = runs
    oracle = fresh.cell("oracle", LENGTH, DEPTH)
    for name in POLICIES:
        c = fresh.cell(name, LENGTH, DEPTH)
        assert c.budget_tokens == oracle.budget_tokens == 80
        assert oracle.kept_mass >= c.kept_mass, name
        assert np.all(np.array(c.kept_mass_by_head) <= np.array(c.wanted_mass_by_head) + 1e-12)
        assert 0.0 <= c.needle_kept <= 1.0
        assert c.wanted_mass == pytest.approx(oracle.wanted_mass)  # the same full-model query


@pytest.mark.model
@pytest.mark.slow
def test_oracle_keeps_the_most_total_mass_of_the_first_answer_query(bundled, runs):
    """Forced by its definition: top-k by that query's group attention, same sink / window split."""
    model, _ = bundled
    fresh, *_ = runs
    p = fresh.prompt(LENGTH, DEPTH)
    pre = needle.prefill(model, p.ids)
    attn = needle.cell._first_answer_attention(pre, LENGTH - 1)  # (L, Hq, P)
    per_kv = attn.reshape(attn.shape[0], 3, 3, -1).sum(axis=2)  # (L, H, P) group sums
    best = (per_kv * fresh.cell("oracle", LENGTH, DEPTH).kept()).sum(axis=2)
    for name in ("h2o", "tova", "snapkv", "streaming"):
        other = (per_kv * fresh.cell(name, LENGTH, DEPTH).kept()).sum(axis=2)
        assert np.all(best >= other - 1e-9), name


@pytest.mark.model
@pytest.mark.slow
def test_results_are_identical_from_the_cache_and_fresh(runs):
    fresh, again, s1, s2 = runs
    assert s1["computed"] == 1 + len(POLICIES) and s1["cached"] == 0
    assert s2["computed"] == 0 and s2["cached"] == 1 + len(POLICIES)
    assert [c.as_dict(kept=True) for c in fresh.cells] == [c.as_dict(kept=True) for c in again.cells]
    assert fresh == again


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scorers", "full,bogus"], "unknown scorer 'bogus'"),
        (["--depths", "1.5"], "depths are fractions"),
        (["--depths", "a,b"], "--depths takes"),
        (["--budget", "2"], "fraction of the prompt's tokens"),
        (["--bits", "11"], "bits must be"),
        (["--lengths", "x"], "--lengths takes"),
        (
            ["--lengths", "1000000000"],
            "--lengths are token counts of 1-131,072 (and at most the model's positions), got 1,000,000,000",
        ),
        (["--new-tokens", "0"], "--new-tokens: must be 1-64, got 0"),
    ],
)
def test_cli_errors_are_one_line_before_any_model_loads(capsys, monkeypatch, argv, message):
    import kvviz.models

    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    try:  # ranges the parser checks exit through argparse, the rest return 2
        code, out, err = run_cli(capsys, "needle", *argv, "--quiet")
    except SystemExit as exc:
        (out, err), code = capsys.readouterr(), exc.code
    assert code == 2 and out == ""
    assert err.startswith("kvviz") and "error:" in err and message in err and err.count("\n") == 1


def test_cli_json_and_out_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, "needle", "--json", "--out", "x.csv")
    assert exc.value.code == 2


@pytest.mark.model
def test_cli_lengths_past_the_model_positions(bundled, capsys, monkeypatch):
    import kvviz.models

    model, tokenizer = bundled
    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: (model, tokenizer, None))
    code, out, err = run_cli(capsys, "needle", "--lengths", "320,9000", "--quiet")
    assert code == 2 and out == ""
    assert "past the model's 8192 positions; use lengths up to 8184" in err and err.count("\n") == 1


@pytest.mark.model
@pytest.mark.slow
def test_cli_json_csv_and_progress_from_the_cache(runs, cache_folder, capsys, monkeypatch, tmp_path):
    import csv
    import json

    import kvviz.models

    fresh, *_ = runs
    # every prompt and cell is on disk: the rerun needs no model at all
    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(cache_folder))
    args = [
        "needle",
        "--model",
        "bundled",
        "--lengths",
        LENGTH,
        "--depths",
        DEPTH,
        "--scorers",
        ",".join(["full", *POLICIES]),
        "--budget",
        BUDGET,
    ]
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0
    cells = json.loads(out)["cells"]
    assert cells == [c.as_dict() for c in fresh.cells]  # the same numbers, from the cache
    keys = {
        "scorer",
        "length",
        "depth",
        "budget",
        "bits",
        "correct",
        "answer",
        "needle_kept",
        "needle_kept_by_head",
        "wanted_mass",
    }
    assert all(keys <= set(c) for c in cells)
    assert [c["scorer"] for c in cells] == ["full", *POLICIES]
    assert cells[0]["budget"] == 1.0 and all(c["budget"] == BUDGET for c in cells[1:])
    assert "6 cells: 0 computed, 6 from the cache" in err and "[" in err  # the progress line
    code, out, err = run_cli(capsys, *args, "--out", tmp_path / "needle.csv", "--quiet")
    rows = list(csv.DictReader(open(tmp_path / "needle.csv")))
    assert code == 0 and len(rows) == 6 and rows[1]["scorer"] == "streaming" and rows[1]["needle_kept"] == "0"
    assert rows[0]["correct"] == "True"
    code, out, err = run_cli(capsys, *args, "--quiet")
    assert code == 0 and "streaming 0.25" in out and "correct 1/1" in out


@pytest.mark.model
@pytest.mark.slow
def test_question_after_compression_and_quantization_run_the_same_path(bundled, runs, cache_folder, monkeypatch):
    """Query-agnostic: compressed right after the haystack, the question decoded through the
    compressed cache. 4-bit K/V on every cell; `full` is then quantization alone."""
    model, tokenizer = bundled
    fresh, *_ = runs
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(cache_folder))
    grid = needle.run_grid(
        model,
        tokenizer,
        "bundled",
        needle.GridRequest(
            lengths=[LENGTH],
            depths=[DEPTH],
            scorers=["full", "streaming"],
            budgets=[BUDGET],
            bits=[4],
            question_after_compression=True,
        ),
    )
    p = grid.prompt(LENGTH, DEPTH)
    quant, stream = grid.cell("full", LENGTH, DEPTH), grid.cell("streaming", LENGTH, DEPTH)
    assert quant.question_after_compression and stream.question_after_compression
    assert quant.spec == "K4/V4-bit" and quant.needle_kept == 1.0 and quant.budget_tokens == LENGTH
    assert stream.spec.startswith("streaming sink 4 recent 76") and stream.spec.endswith("K4/V4-bit")
    assert stream.needle_kept == 0.0 and stream.budget_tokens == 80
    kept = stream.kept()
    assert np.all(kept[:, :, LENGTH - 76 :]) and not kept[:, :, 4 : LENGTH - 76].any()  # sinks + window, nothing else
    # the reference is still the uncompressed cache's answer
    assert quant.full_answer == fresh.cell("full", LENGTH, DEPTH).answer and p.question_start < LENGTH


@pytest.mark.model
@pytest.mark.slow
def test_duo_attention_retrieval_heads_hold_the_needle_and_streaming_heads_do_not(bundled, cache_folder):
    """A cache whose heads hold different numbers of tokens is measured head by head: the retrieval heads keep
    the whole prompt (the needle with it), the streaming heads sinks and window only (the needle out of reach)."""
    model, tokenizer = bundled
    mp = pytest.MonkeyPatch()
    mp.setenv("KVVIZ_CACHE_DIR", str(cache_folder))
    try:
        request = needle.GridRequest(lengths=[LENGTH], depths=[DEPTH], scorers=["duo_attention"], budgets=[BUDGET])
        grid = needle.run_grid(model, tokenizer, "bundled", request)
    finally:
        mp.undo()
    p, c = grid.prompt(LENGTH, DEPTH), grid.cell("duo_attention", LENGTH, DEPTH)
    spec = needle.spec_for("duo_attention", BUDGET, 16, LENGTH)
    assert spec.sink <= p.needle_start and p.needle_end <= LENGTH - spec.recent
    by_head = np.array(c.needle_kept_by_head)
    streaming = round(90 * spec.duo_streaming)  # of 30 x 3 heads: the share set for the budget
    assert 0 < streaming < 90 and set(np.unique(by_head)) == {0.0, 1.0} and int(by_head.sum()) == 90 - streaming
    counts = c.kept().sum(axis=2)
    assert set(np.unique(counts)) == {spec.sink + spec.recent, LENGTH}
    assert np.array_equal(counts == LENGTH, by_head == 1.0)


@pytest.mark.model
def test_merging_keeps_the_same_tokens_and_bytes_and_has_its_own_cell(bundled, cache_folder):
    """merge-snapkv is SnapKV's cache with the evicted values merged in: the same kept tokens in every head and
    the same bytes, and a cell of its own in the disk cache (the setting is in the key)."""
    from kvviz.analysis.needle.store import cell_key

    model, tokenizer = bundled
    mp = pytest.MonkeyPatch()
    mp.setenv("KVVIZ_CACHE_DIR", str(cache_folder))
    try:
        request = needle.GridRequest(
            lengths=[LENGTH], depths=[DEPTH], scorers=["snapkv", "merge-snapkv"], budgets=[BUDGET]
        )
        grid = needle.run_grid(model, tokenizer, "bundled", request)
    finally:
        mp.undo()
    drop, merge = grid.cell("snapkv", LENGTH, DEPTH), grid.cell("merge-snapkv", LENGTH, DEPTH)
    assert np.array_equal(drop.kept(), merge.kept())
    assert drop.needle_kept_by_head == merge.needle_kept_by_head
    assert drop.budget_tokens == merge.budget_tokens
    p = grid.prompt(LENGTH, DEPTH)
    specs = [needle.spec_for(name, BUDGET, 16, LENGTH) for name in ("snapkv", "merge-snapkv")]
    assert specs[1] == specs[0].with_(merge=True)
    assert len({cell_key("bundled", p, s, False, 8) for s in specs}) == 2
