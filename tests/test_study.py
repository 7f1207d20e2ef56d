"""Studies: the study file's checks, the local engine's rows, the resume rule after a kill,
the CLI, the frontier's numbers. The Ray engine: tests/test_study_ray.py; the page: test_study_app.py."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvviz.analysis.study import StudyDir, StudyError, load_study, parse_study, plan, run_study
from kvviz.analysis.study import cells as grid_cells
from kvviz.analysis.study.frontier import frontier, t_half_width
from kvviz.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "studies" / "quarter-cache.toml"

SMALL = """
name = "small"
[source]
kind = "synthetic"
context = 128
steps = 8
seeds = [0, 1]
[grid]
scorers = ["h2o", "streaming"]
budgets = [0.25, 1.0]
bits = [16, 4]
"""


def study_text(source: str = "", grid: str = "", top: str = 'name = "t"', kind: str = "synthetic") -> str:
    base_source = {
        "synthetic": "seeds = [0]\ncontext = 64",
        "model": 'models = ["bundled"]',
        "needle": 'models = ["bundled"]\nlengths = [320]\ndepths = [0.5]',
    }[kind]
    base_grid = {
        "synthetic": 'scorers = ["h2o"]\nbudgets = [0.5]',
        "model": 'methods = ["h2o"]\nbudgets = [0.25]',
        "needle": 'scorers = ["h2o"]',
    }[kind]
    return f'{top}\n[source]\nkind = "{kind}"\n{base_source}\n{source}\n[grid]\n{base_grid}\n{grid}\n'


# --- the study file's errors: one message, naming the key ---------------------------------------------


@pytest.mark.parametrize(
    "text, named",
    [
        ('nam = "x"\n[source]\nkind = "synthetic"\n[grid]\n', "unknown key 'nam'"),
        (study_text(source="contxt = 512"), "[source]: unknown key 'contxt'"),
        (study_text(grid="bitz = [4]"), "[grid]: unknown key 'bitz'"),
        (study_text(source='steps = "32"'), "[source] steps: expected an integer, got '32'"),
        (study_text(source="sparsity = true"), "[source] sparsity: expected a number"),
        (study_text(grid="bits = 4"), "[grid] bits: expected a list of integers, got 4"),
        (study_text(grid='bits = [4, "2"]'), "[grid] bits: expected a list of integers"),
        (study_text(grid="bits = [4, 17]"), "[grid] bits: 17"),
        (study_text(grid="bits = [4, 4]"), "[grid] bits: 4 is listed twice"),
        (study_text(source="kv_heads = 3"), "[source] kv_heads: "),
        (study_text(source="layer = 2"), "[source] layer: 2 is not a layer of a 2-layer trace"),
        (study_text(source='ensemble = "seeds"'), "[source] ensemble: 'seeds' is not one of heads, layers, steps"),
        (study_text(grid='formats = ["fp3"]'), "[grid] formats: unknown format 'fp3'"),
        (study_text(top='name = "a b"'), "name: use letters"),
        (study_text().replace('kind = "synthetic"', 'kind = "video"'), "[source] kind: expected one of"),
        ('name = "t"\n[source]\nkind = "synthetic"\nseeds = [0]\n', "grid: missing (required)"),
        (
            'name = "t"\n[source]\nkind = "synthetic"\n[grid]\nscorers = ["h2o"]\nbudgets = [0.5]\n',
            "[source] seeds: missing (required)",
        ),
        ("name = [", "is not valid TOML"),
        (
            study_text(kind="model", grid="").replace("budgets = [0.25]", "budgets = [0.01]"),
            "[grid] budgets: 0.01 of a 206-token prompt is 2 tokens",
        ),
        (
            study_text(kind="model").replace('methods = ["h2o"]', 'methods = ["h2o", "zip"]'),
            "[grid] methods: unknown method 'zip'",
        ),
        (
            study_text(kind="model", source='texts = ["no-such-text.txt"]'),
            "[source] texts: no such file 'no-such-text.txt'",
        ),
        (
            study_text(kind="model", source="prompt_tokens = 200000"),
            "[source] prompt_tokens: 200000 is not in 1-131072",
        ),
        (
            study_text(kind="model", source='device = "tpu"'),
            "[source] device: 'tpu' is not one of cpu, cuda, auto, mps",
        ),
        (study_text(kind="needle").replace("depths = [0.5]", "depths = [0.5, 1.5]"), "[source] depths"),
        (study_text(kind="needle", grid="budgets = [0]"), "[grid] budgets: 0 is not a fraction"),
        (
            study_text(kind="needle").replace('scorers = ["h2o"]', 'scorers = ["h2o", "magic"]'),
            "[grid] scorers: unknown scorer 'magic'",
        ),
    ],
)
def test_a_bad_study_file_is_one_error_naming_the_key(text, named):
    with pytest.raises(StudyError) as err:
        parse_study(text, ROOT)
    assert named in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_study_file_runs_nothing_and_creates_no_folder(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(study_text(grid="bits = [4, 17]"))
    assert main(["study", "run", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "[grid] bits: 17" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cells_are_the_product_of_the_lists_with_one_full_cell_per_width():
    study = parse_study(SMALL)
    cells = grid_cells(study)
    # 2 seeds x (2 scorers x 1 budget + one shared full-cache cell) x 2 widths
    assert len(cells) == 2 * (2 + 1) * 2
    assert len({c.id for c in cells}) == len(cells)
    full = [c for c in cells if c.settings["budget"] == 1.0]
    assert {c.settings["scorer"] for c in full} == {"full"} and len(full) == 4
    assert len(grid_cells(load_study(EXAMPLE))) == 3 * 3 * 2 * 2


def test_a_setting_axis_reaches_only_the_cells_it_applies_to():
    """ChunkKV's chunk size makes a ChunkKV cell a value; H2O, which never reads it, stays one cell (not one a
    value with the same numbers), as does the full cache."""
    study = parse_study(SMALL.replace('"streaming"', '"chunkkv"') + "chunk_size = [4, 8]\n")
    cells = grid_cells(study)
    by_scorer = {}
    for c in cells:
        if c.settings["seed"] == 0 and c.settings["bits"] == 16:
            by_scorer.setdefault(c.settings["scorer"], []).append(c.settings.get("chunk_size"))
    assert by_scorer == {"h2o": [None], "chunkkv": [4, 8], "full": [None]}, by_scorer


# --- the local engine -----------------------------------------------------------------------------------


def test_local_run_writes_one_row_per_cell_with_settings_metrics_versions_and_time(tmp_path):
    report = run_study(parse_study(SMALL), tmp_path / "s")
    assert (report.cells, report.done_before, report.to_run, report.finished) == (12, 0, 12, 12)
    rows = StudyDir(tmp_path / "s").rows()
    assert len(rows) == 12 and rows["cell"].is_unique
    for col in (
        "seed",
        "scorer",
        "budget",
        "bits",
        "format",
        "context",
        "steps",
        "kvviz_version",
        "numpy_version",
        "torch_version",
        "transformers_version",
        "model_revision",
        "wall_time_s",
        "tv",
        "mass_retained",
        "memory_ratio",
        "budget_tokens",
    ):
        assert col in rows, col
    n = 128 + 8  # the last query sees the context and the 8 later steps
    evict16 = rows[(rows.bits == 16) & (rows.scorer != "full")]
    assert (evict16.budget_tokens == round(0.25 * n)).all()
    assert evict16.memory_ratio.tolist() == [round(0.25 * n) / n] * len(evict16)  # bytes of kept tokens, exactly
    # pure eviction: TV between the rows is exactly the evicted mass
    assert ((evict16.tv - (1 - evict16.mass_retained)).abs() < 1e-12).all()
    full16 = rows[(rows.bits == 16) & (rows.scorer == "full")]
    assert full16.memory_ratio.tolist() == [1.0, 1.0] and (full16.tv.abs() < 1e-12).all()
    assert (rows.wall_time_s > 0).all() and (rows.engine == "local").all()


def test_a_process_pool_gives_the_same_rows(tmp_path, monkeypatch):
    pytest.importorskip("torch")  # loaded here, not in the pool's fresh processes: rows must not care
    # Under pytest-xdist this process's __main__ is execnet's bootstrap script, which a spawned worker
    # would re-run (and fail on: it needs execnet's arguments); `kvviz study run`'s __main__ is the CLI.
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None:
        monkeypatch.delattr(main, "__file__", raising=False)
    run_study(parse_study(SMALL), tmp_path / "one")
    run_study(parse_study(SMALL), tmp_path / "two", workers=2)
    drop = ["wall_time_s", "engine"]
    a, b = (StudyDir(tmp_path / d).rows().drop(columns=drop) for d in ("one", "two"))
    assert a.equals(b) and set(a.torch_version) == {""}  # a synthetic cell never runs torch


# --- resume ----------------------------------------------------------------------------------------------


def test_a_killed_run_resumes_to_exactly_the_full_set(tmp_path):
    study = tmp_path / "slow.toml"
    study.write_text(SMALL.replace("context = 128", "context = 1536").replace("seeds = [0, 1]", "seeds = [0, 1, 2, 3]"))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvviz", "study", "run", str(study), "--out", str(out), "--quiet"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    try:
        while len(list((out / "parts").glob("*.parquet"))) < 3:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "no part file within 240 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    killed_with = len(list((out / "parts").glob("*.parquet")))
    cells = grid_cells(load_study(study))
    assert 3 <= killed_with < len(cells), "the run finished before the kill: make the cells slower"
    plan_ = plan(study, out)[3]
    assert (plan_.done_before, plan_.to_run) == (killed_with, len(cells) - killed_with)
    report = run_study(study, out)
    assert report.finished == len(cells) - killed_with and not report.failures
    rows = StudyDir(out).rows()
    assert sorted(rows["cell"]) == sorted(c.id for c in cells)  # no gap, no duplicate
    assert StudyDir(out).done_ids() == {c.id for c in cells}
    again = run_study(study, out)
    assert (again.to_run, again.finished) == (0, 0)


def test_rerun_prints_zero_to_run_and_status_export_agree(tmp_path, capsys):
    out = tmp_path / "q"
    f = tmp_path / "small.toml"
    f.write_text(SMALL)
    assert main(["study", "run", str(f), "--out", str(out), "--quiet"]) == 0
    assert main(["study", "run", str(f), "--out", str(out)]) == 0
    assert "study small: 12 cells, 12 done, 0 to run" in capsys.readouterr().out
    assert main(["study", "status", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "study small: 12 cells, 12 done, 0 to run"
    assert main(["study", "export", str(out), "--csv"]) == 0
    assert "wrote 12 rows to" in capsys.readouterr().err
    text = (out / "small.csv").read_text().splitlines()
    assert len(text) == 13 and text[0].startswith("study,cell,seed,scorer,budget,bits,format,kind,context")


def test_a_changed_fixed_setting_is_refused_and_a_longer_list_runs_only_the_new_cells(tmp_path):
    out = tmp_path / "q"
    run_study(parse_study(SMALL), out)
    before = sorted(p.name for p in (out / "parts").iterdir())
    with pytest.raises(StudyError) as err:
        run_study(parse_study(SMALL.replace("context = 128", "context = 256")), out)
    assert "[source] context = 128; this study file says 256" in str(err.value)
    assert sorted(p.name for p in (out / "parts").iterdir()) == before
    assert (out / "study.toml").read_text() == SMALL  # the record is untouched
    with pytest.raises(StudyError, match="holds study 'small' run with name"):
        run_study(parse_study(SMALL.replace('name = "small"', 'name = "other"')), out)
    more = parse_study(SMALL.replace("seeds = [0, 1]", "seeds = [0, 1, 2]"))
    report = run_study(more, out)
    assert (report.cells, report.done_before, report.to_run) == (18, 12, 6)
    fewer = parse_study(SMALL.replace("seeds = [0, 1]", "seeds = [1]"))
    assert plan(fewer, out)[3].start_line() == "study small: 6 cells, 6 done, 0 to run"
    assert StudyDir(out).counts()["extra"] == 12 and len(StudyDir(out).rows()) == 6


def test_an_unreadable_part_is_one_error_naming_it(tmp_path, capsys):
    run_study(parse_study(SMALL), tmp_path / "s")
    part = sorted((tmp_path / "s" / "parts").glob("*.parquet"))[0]
    part.write_bytes(b"not parquet")
    assert main(["study", "export", str(tmp_path / "s"), "--csv"]) == 2
    err = capsys.readouterr().err
    assert f"{part} is unreadable" in err and "delete it and rerun" in err and len(err.splitlines()) == 1


def test_out_must_be_a_new_or_study_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StudyError, match="other files in it"):
        run_study(parse_study(SMALL), tmp_path)
    with pytest.raises(StudyError, match="holds no study"):
        StudyDir(tmp_path).status_line()


def test_ray_missing_says_how_to_install_it(tmp_path, monkeypatch):
    from kvviz.analysis.study.engines import run_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(StudyError, match=r"pip install 'kvviz\[ray\]'"):
        run_ray(parse_study(SMALL), grid_cells(parse_study(SMALL)), lambda c, r: None)


# --- the frontier ------------------------------------------------------------------------------------------


def test_frontier_means_and_95_percent_t_intervals_over_seeds():
    import pandas as pd

    rows = pd.DataFrame(
        [
            {
                "scorer": s,
                "bits": 16,
                "format": "int",
                "budget": b,
                "seed": seed,
                "cell": f"{s}{b}{seed}",
                "memory_ratio": b,
                "tv": tv,
            }
            for s, b, seed, tv in [
                ("h2o", 0.1, 0, 1.0),
                ("h2o", 0.1, 1, 2.0),
                ("h2o", 0.1, 2, 3.0),
                ("h2o", 0.5, 0, 0.5),
                ("h2o", 0.5, 1, 0.5),
                ("h2o", 0.5, 2, 0.5),
                ("oracle", 0.1, 0, 0.0),
                ("oracle", 0.1, 1, 0.0),
                ("oracle", 0.1, 2, 0.0),
                ("streaming", 0.5, 0, 0.4),
                ("streaming", 0.5, 1, 0.6),
                ("streaming", 0.5, 2, 0.2),
            ]
        ]
    )
    fr = frontier(rows, "synthetic", "tv")
    p = fr.points.set_index(["scorer", "budget"])
    assert p.loc[("h2o", 0.1), "mean"] == 2.0 and p.loc[("h2o", 0.1), "n"] == 3
    assert math.isclose(p.loc[("h2o", 0.1), "half"], 4.302652729749464 / math.sqrt(3), rel_tol=1e-12)  # t(0.975, 2)
    assert p.loc[("h2o", 0.5), "half"] == 0.0
    front = fr.points.loc[fr.front]
    assert list(zip(front.scorer, front.budget)) == [("h2o", 0.1), ("streaming", 0.5)]  # the oracle is left out
    assert t_half_width(pd.Series([7.0])) == 0.0


NEEDLE = """
name = "needle-small"
[source]
kind = "needle"
models = ["bundled"]
lengths = [320]
depths = [0.0, 1.0]
[grid]
scorers = ["streaming"]
budgets = [0.25]
"""


@pytest.mark.model
def test_a_needle_study_gives_kvviz_needles_cells(tmp_path, monkeypatch):
    from apptest_util import load_shared

    from kvviz.analysis import needle
    from kvviz.models import bundled_model_file

    if bundled_model_file() is None:
        pytest.skip("the bundled model is not installed")
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path / "cache"))  # computed here, not read from a cache
    report = run_study(parse_study(NEEDLE), tmp_path / "n")
    assert (report.cells, report.finished, report.failures) == (2, 2, [])
    rows = StudyDir(tmp_path / "n").rows()
    model, tokenizer, _ = load_shared()  # the bundled model as this process's other tests loaded it
    grid = needle.run_grid(
        model,
        tokenizer,
        "bundled",
        needle.GridRequest(lengths=[320], depths=[0.0, 1.0], scorers=["streaming"], budgets=[0.25]),
    )
    for r in rows.to_dict("records"):
        c = grid.cell(r["scorer"], r["length"], r["depth"]).as_dict()
        assert {k: r[k] for k in ("correct", "answer", "needle_kept", "kept_mass", "budget_tokens", "key")} == {
            k: c[k] for k in ("correct", "answer", "needle_kept", "kept_mass", "budget_tokens", "key")
        }
    # StreamingLLM keeps a window of the last quarter: the needle at depth 0 is gone, at depth 1 it is kept
    s = rows[rows.scorer == "streaming"].set_index("depth")
    assert s.loc[0.0, "needle_kept"] == 0.0 and s.loc[1.0, "needle_kept"] == 1.0
    fr = frontier(rows, "needle", "correct")
    assert list(fr.points.n) == [2] and list(fr.points.x) == [0.25] and list(fr.points["mean"]) == [0.5]
