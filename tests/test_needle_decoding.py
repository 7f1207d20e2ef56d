"""Compression during decoding in the needle test and as a real-model study axis: `kvviz needle
--compress-every N`, the GridRequest that carries it, the needle and model studies' `compress_every` axis."""

from __future__ import annotations

import numpy as np
import pytest

from kvviz.analysis import needle
from kvviz.analysis.study import parse_study
from kvviz.analysis.study.grid import cells, model_spec
from kvviz.analysis.study.schema import StudyError
from kvviz.spec import SpecError

MODEL_STUDY = """
name = "every-model"
[source]
kind = "model"
models = ["bundled"]
prompt_tokens = 96
[grid]
methods = ["snapkv", "h2o", "kv-4bit"]
budgets = [0.5]
compress_every = [0, 16]
"""
NEEDLE_STUDY = """
name = "every-needle"
[source]
kind = "needle"
models = ["bundled"]
lengths = [320]
depths = [0.5]
question_after_compression = true
[grid]
scorers = ["full", "h2o", "snapkv"]
compress_every = [0, 4]
"""


def test_the_request_gives_the_setting_to_the_one_shot_scorers_only():
    req = needle.GridRequest(scorers=["full", "streaming", "h2o", "snapkv", "knorm"], compress_every=8)
    req.check()
    assert isinstance(req.lengths, tuple) and req.settings()["compress_every"] == 8
    every = {s: req.spec(s, 0.25, 16, 320).compress_every for s in req.scorers}
    # H2O decides at every step; StreamingLLM's sinks + window are one-shot scores too (kvpress's DecodingPress
    # takes any scorer press): the setting's own owner test decides (kvviz.policies.decoding.one_shot)
    assert every == {"full": 0, "streaming": 8, "h2o": 0, "snapkv": 8, "knorm": 8}
    assert req.spec("snapkv", 0.25, 16, 320) == needle.spec_for("snapkv", 0.25, 16, 320).with_(compress_every=8)
    assert "compress_every" not in needle.GridRequest().settings()  # as the shipped grids were saved
    with pytest.raises(SpecError, match="0-100,000, got -1"):
        needle.GridRequest(compress_every=-1).check()
    with pytest.raises(SpecError, match="chunkkv: ChunkKV's whole chunks"):
        needle.GridRequest(scorers=["chunkkv"], compress_every=8).check()


def test_kvviz_needle_takes_the_flag_from_the_settings_table(capsys):
    from kvviz.cli import main
    from kvviz.settings import SETTINGS

    with pytest.raises(SystemExit):
        main(["needle", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--compress-every COMPRESS_EVERY" in out and " ".join(SETTINGS["compress_every"].help.split())[:60] in out
    with pytest.raises(SystemExit) as stop:
        main(["needle", "--compress-every", "-1"])
    assert stop.value.code == 2
    assert "must be 0-100,000, got -1" in capsys.readouterr().err
    assert main(["needle", "--scorers", "chunkkv", "--compress-every", "8"]) == 2
    err = capsys.readouterr().err
    assert "ChunkKV's whole chunks" in err and "Traceback" not in err


def test_a_model_study_runs_compress_every_where_it_applies():
    study = parse_study(MODEL_STUDY)
    got = sorted((c.settings["method"], c.settings.get("compress_every")) for c in cells(study))
    # H2O decides at every step and kv-4bit does not evict: one cell each, without the setting
    assert got == [("h2o", None), ("kv-4bit", None), ("snapkv", 0), ("snapkv", 16)]
    assert model_spec("snapkv", 0.5, 16, 96, {"compress_every": 16}).compress_every == 16
    assert model_spec("h2o", 0.5, 16, 96, {"compress_every": 16}).compress_every == 0
    with pytest.raises(StudyError, match="compress_every=16 is impossible"):
        parse_study(
            MODEL_STUDY.replace('"snapkv", "h2o", "kv-4bit"', '"snapkv"').replace(
                "[grid]", '[grid]\nallocation = ["adakv"]'
            )
        )


def test_a_needle_study_has_the_axis_and_nothing_else_of_the_table():
    study = parse_study(NEEDLE_STUDY)
    got = sorted((c.settings["scorer"], c.settings.get("compress_every")) for c in cells(study))
    assert got == [("full", None), ("h2o", None), ("snapkv", 0), ("snapkv", 4)]
    with pytest.raises(StudyError, match="unknown key 'chunk_size'"):
        parse_study(NEEDLE_STUDY + "chunk_size = [10]\n")


@pytest.mark.model
@pytest.mark.slow
def test_the_needle_cache_is_compressed_again_and_never_holds_more_than_budget_plus_n(monkeypatch, tmp_path):
    """Query-agnostic: compressed after the haystack, then the question's tokens arrive through the cache: with
    compress_every 4 SnapKV scores again every 4 of them, so the cache the first answer step reads holds
    budget + (steps since the last compression) <= budget + 4 tokens, and other tokens than compressing once.
    The needle study's compress_every axis gives the same cells."""
    from apptest_util import load_shared, share_one_model_load

    from kvviz.analysis.study import StudyDir, run_study

    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path / "cache"))
    share_one_model_load(monkeypatch)
    model, tokenizer, _ = load_shared("bundled")
    grids = {
        n: needle.run_grid(
            model,
            tokenizer,
            "bundled",
            needle.GridRequest(
                lengths=[320],
                depths=[0.5],
                scorers=["full", "snapkv"],
                question_after_compression=True,
                compress_every=n,
            ),
        )
        for n in (0, 4)
    }
    p = grids[4].prompt(320, 0.5)
    once, again = grids[0].cell("snapkv", 320, 0.5), grids[4].cell("snapkv", 320, 0.5)
    assert again.spec == once.spec + ", compressed again every 4 steps"
    q = p.length - p.question_start  # the question's tokens, decoded through the cache
    assert q > 4
    budget = once.budget_tokens  # 80: a quarter of the prompt
    assert budget == 80 and budget < again.budget_tokens <= budget + 4
    assert not np.array_equal(again.kept(), once.kept())
    assert grids[4].cell("full", 320, 0.5) == grids[0].cell("full", 320, 0.5)
    run_study(parse_study(NEEDLE_STUDY.replace('"full", "h2o", ', "")), tmp_path / "s")
    rows = StudyDir(tmp_path / "s").rows().set_index("compress_every")
    assert rows.loc[4, "spec"] == again.spec and rows.loc[0, "spec"] == once.spec
    assert rows.loc[4, "needle_kept"] == again.needle_kept and rows.loc[0, "needle_kept"] == once.needle_kept
