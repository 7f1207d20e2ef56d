"""The Ray engine: a local Ray with 2 CPUs, started once for this module; the same rows as
the local engine for a synthetic study, model cells on actors that load the model once, and a bad
model path that fails its own cells while the rest complete. Selected with `-m ray`; part of `make test`."""

from __future__ import annotations

import pytest

from kvviz.analysis.study import StudyDir, parse_study, run_study
from tests.test_study import SMALL

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'kvviz[ray]'; make dev)")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    from kvviz.analysis.study.engines import start_ray

    started = start_ray(ray, 2)
    assert ray.cluster_resources().get("CPU") == 2.0 or not started
    yield
    if started:
        ray.shutdown()


def test_ray_and_local_engines_give_identical_rows(tmp_path, local_ray):
    pytest.importorskip("torch")  # loaded in this process, not in Ray's workers: rows must not care
    study = parse_study(SMALL)
    local = run_study(study, tmp_path / "local")
    on_ray = run_study(study, tmp_path / "ray", engine="ray", workers=2)
    assert (local.finished, on_ray.finished) == (12, 12) and not on_ray.failures
    a, b = (StudyDir(tmp_path / d).rows() for d in ("local", "ray"))
    assert set(b.engine) == {"ray"}
    drop = ["wall_time_s", "engine"]
    assert a.drop(columns=drop).equals(b.drop(columns=drop))  # every setting and metric, bit for bit
    again = run_study(study, tmp_path / "ray", engine="ray", workers=2)
    assert again.start_line() == "study small: 12 cells, 12 done, 0 to run" and again.finished == 0


MODEL_STUDY = """
name = "model-fail"
[source]
kind = "model"
models = ["bundled", "./no-such-model"]
prompt_tokens = 64
continuation_tokens = 8
[grid]
methods = ["streaming", "h2o", "kv-4bit"]
budgets = [0.25]
"""


@pytest.mark.model
def test_model_cells_on_ray_actors_a_bad_path_fails_only_its_cells(tmp_path, local_ray):
    from kvviz.models import bundled_model_file

    if bundled_model_file() is None:
        pytest.skip("the bundled model is not installed")
    report = run_study(parse_study(MODEL_STUDY), tmp_path / "m", engine="ray", workers=1)
    assert report.finished == 3 and len(report.failures) == 3
    assert {f["settings"]["model"] for f in report.failures} == {"./no-such-model"}
    assert all("no such model folder or file" in f["error"] for f in report.failures)
    rows = StudyDir(tmp_path / "m").rows()
    assert set(rows.model) == {"bundled"} and set(rows.method) == {"streaming", "h2o", "kv-4bit"}
    assert rows.model_revision.str.startswith("SmolLM2-135M-Instruct.Q4_1.gguf sha256:").all()
    assert (rows.torch_version != "").all() and (rows.scored_tokens == 8).all()
    assert rows[rows.method == "streaming"].budget_tokens.tolist() == [16]  # 0.25 x 64
    assert (rows.perplexity_full == rows.perplexity_full.iloc[0]).all()  # one reference for the text
    # the same cells in this process: the same numbers (float32 on 1 vs 2 threads: to rounding)
    local = run_study(parse_study(MODEL_STUDY), tmp_path / "l")
    lrows = StudyDir(tmp_path / "l").rows()
    assert len(local.failures) == 3 and list(lrows.cell) == list(rows.cell)
    for col in ("perplexity", "kl_mean", "top1_agreement", "memory_ratio", "kv_bytes"):
        assert lrows[col].tolist() == pytest.approx(rows[col].tolist(), rel=1e-4, abs=1e-6), col
