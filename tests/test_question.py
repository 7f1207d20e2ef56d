"""A context and a question: `kvviz eval --question` and the Model lab compress before the question
(query-agnostic, kvpress's pipeline default) or after it (query-aware), and on the bundled model the two differ
for SnapKV; the lab's question box and its choice are in the page's link."""

from __future__ import annotations

from pathlib import Path

import pytest
from apptest_util import lab_quality, lab_run_metrics, run_app, share_one_model_load

from kvviz.spec import Spec

ROOT = Path(__file__).resolve().parents[1]
LAB = str(ROOT / "pages" / "3_model-lab.py")
QUESTION = "Who runs the bakery?"


def test_the_lab_question_and_its_compression_point_are_in_the_link(monkeypatch):
    import kvviz.models

    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    at = run_app(LAB, 300)
    assert at.text_input(key="lab_question").value == ""
    assert at.radio(key="lab_point").value == "before-question"  # kvpress's pipeline default
    assert at.radio(key="lab_point").disabled  # no question: nothing to choose
    params = {"lab_question": QUESTION, "lab_point": "after-question"}
    at = run_app(LAB, 300, **params)
    assert dict(at.query_params) == params
    assert at.text_input(key="lab_question").value == QUESTION and not at.radio(key="lab_point").disabled
    assert any("Compressed:** after the question" in md.value for md in at.markdown)
    at.radio(key="lab_point").set_value("before-question").run()
    assert "lab_point" not in at.query_params  # back to the default
    at = run_app(LAB, 300, lab_point="middle")
    assert any("lab_point=middle" in w.value for w in at.warning)


def test_an_empty_question_is_refused_in_one_line(capsys):
    from kvviz.cli import main

    assert main(["eval", "--question", "  ", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--question is empty" in err and "Traceback" not in err


@pytest.mark.model
def test_kvviz_eval_compresses_before_or_after_the_question_and_snapkv_differs(monkeypatch, capsys):
    """Before the question the cache is compressed at the context's end and the question's tokens are decoded
    through it; after it the scorer sees the question. Same text, same tokens, same full cache: SnapKV keeps
    other tokens, so its scores differ; without eviction both points give the full cache exactly."""
    share_one_model_load(monkeypatch)
    from cli_util import eval_json

    window = ("--scorer", "snapkv", "--sink", 4, "--recent", 8, "--heavy", 24)
    argv = (*window, "--prompt-tokens", 120, "--continuation-tokens", 16, "--question", QUESTION)
    out = {
        point: eval_json(capsys, *argv, "--compression-point", point) for point in ("before-question", "after-question")
    }
    before, after = out["before-question"], out["after-question"]
    n = before["prompt_tokens"]
    assert n == after["prompt_tokens"] == 120 + before["question_tokens"] and before["question_tokens"] > 3
    assert (before["compressed_at"], after["compressed_at"]) == (120, n)
    assert before["per_token"]["tokens"] == after["per_token"]["tokens"]
    assert before["per_token"]["nll_full"] == after["per_token"]["nll_full"]  # one full-cache reference
    assert before["kl_mean"] != after["kl_mean"] and before["per_token"]["kl"] != after["per_token"]["kl"]
    # the first scored token: predicted by the prefill after compressing after the question (as without one),
    # by a decode step through the compressed cache before it
    assert after["per_token"]["kl"][0] == 0.0 and before["per_token"]["kl"][0] > 0.0
    assert before["kept_tokens"] == after["kept_tokens"] == 36  # the budget, both ways


@pytest.mark.model
def test_snapkv_keeps_other_context_tokens_before_the_question_than_after():
    from apptest_util import load_shared

    from kvviz.decode.loop import decode
    from kvviz.decode.quality import evaluate, reference, sample_text

    model, tokenizer, _ = load_shared("bundled")
    ref = reference(model, tokenizer, sample_text(), 120, 8, question=QUESTION)
    n = ref.prompt_len
    spec = Spec(sink=4, recent=8, heavy=24, scorer="snapkv")
    kept = {}
    for point in ("before-question", "after-question"):
        c = ref.compression_point(point)
        _, _, cache = decode(model, ref.ids[:c], spec, n - c, feed=ref.ids[c:n], prefix=ref.prefill)
        kept[point] = [set(map(int, k[h])) for k in cache.kept for h in range(k.shape[0])]
        # the cache at the prompt's end: the budget, the question's tokens the newest of the window
        assert all(len(s) == 36 and set(range(n - 8, n)) <= s for s in kept[point])
    context = [
        (b & set(range(120)), a & set(range(120))) for b, a in zip(kept["before-question"], kept["after-question"])
    ]
    assert sum(b != a for b, a in context) > len(context) // 2  # most heads keep other context tokens
    for point in ("before-question", "after-question"):  # no eviction: the full cache both ways
        assert evaluate(model, ref, Spec(), question_point=point).kl.max() < 1e-3


@pytest.mark.model
def test_the_lab_page_runs_with_a_question_and_shows_the_cores_numbers(monkeypatch):
    load_once = share_one_model_load(monkeypatch)
    at = run_app(
        LAB,
        300,
        sink="4",
        recent="8",
        heavy="24",
        scorer="snapkv",
        lab_prompt="64",
        lab_cont="8",
        lab_greedy="4",
        lab_question=QUESTION,
    )
    shown = lab_run_metrics(at)
    spec = Spec(sink=4, recent=8, heavy=24, scorer="snapkv")
    q = lab_quality(load_once, spec, 64, 8, question=QUESTION, question_point="before-question")
    assert shown["Perplexity (compressed)"] == f"{q.perplexity:.2f}"
    assert shown["Next-token KL"] == f"{q.kl_mean:.3f}"
    assert any("compressed at token 64, before the question" in c.value for c in at.caption)


STUDY = """
name = "question"
[source]
kind = "model"
models = ["bundled"]
prompt_tokens = 64
continuation_tokens = 8
{question}
[grid]
methods = ["snapkv", "h2o"]
budgets = [0.5]
{points}
"""


def test_a_model_study_has_the_question_and_its_compression_points_as_an_axis():
    from kvviz.analysis.study import parse_study
    from kvviz.analysis.study.grid import cells
    from kvviz.analysis.study.schema import StudyError
    from kvviz.app.studies import cell_values

    plain = parse_study(STUDY.format(question="", points=""))
    both = parse_study(
        STUDY.format(
            question=f'question = "{QUESTION}"', points='question_points = ["before-question", "after-question"]'
        )
    )
    # a study without a question keeps the ids it had before the key existed; one cell per method
    assert [c.settings.get("question_point") for c in cells(plain)] == [None, None]
    assert "question" not in plain.fixed() and both.fixed()["question"] == QUESTION
    got = sorted((c.settings["method"], c.settings["question_point"]) for c in cells(both))
    assert got == [(m, p) for m in ("h2o", "snapkv") for p in ("after-question", "before-question")]
    assert any("question_point=after-question" in c.label() for c in cells(both))
    with pytest.raises(StudyError, match=r"\[grid\] question_points: .* needs \[source\] question"):
        parse_study(STUDY.format(question="", points='question_points = ["after-question"]'))
    with pytest.raises(StudyError, match="'middle' is not one of before-question, after-question"):
        parse_study(STUDY.format(question=f'question = "{QUESTION}"', points='question_points = ["middle"]'))
    # a row opens in the Model lab with its question, where it compressed, and its compress_every
    values, page, _ = cell_values(
        {
            "kind": "model",
            "method": "snapkv",
            "budget": 0.5,
            "bits": 16,
            "prompt_tokens": 64,
            "scored_tokens": 8,
            "text": "sample",
            "question": QUESTION,
            "question_point": "after-question",
            "compress_every": 16.0,
            "chunk_size": float("nan"),
        }
    )
    assert page == "model_lab" and (values["lab_question"], values["lab_point"]) == (QUESTION, "after-question")
    assert values["compress_every"] == 16


@pytest.mark.model
def test_a_model_study_runs_both_compression_points_as_kvviz_eval_does(monkeypatch, tmp_path):
    share_one_model_load(monkeypatch)
    from apptest_util import load_shared

    from kvviz.analysis.study import StudyDir, parse_study, run_study
    from kvviz.decode.quality import evaluate, reference, sample_text

    study = parse_study(
        STUDY.format(
            question=f'question = "{QUESTION}"', points='question_points = ["before-question", "after-question"]'
        ).replace('"snapkv", "h2o"', '"snapkv"')
    )
    report = run_study(study, tmp_path / "q")
    assert (report.cells, report.failures) == (2, [])
    rows = StudyDir(tmp_path / "q").rows().set_index("question_point")
    model, tok, _ = load_shared("bundled")
    ref = reference(model, tok, sample_text(), 64, 8, question=QUESTION)
    from kvviz.analysis.study.grid import model_spec

    spec = model_spec("snapkv", 0.5, 16, 64)  # 32 tokens: 4 sinks, 12 recent, 16 heavy
    for point in ("before-question", "after-question"):
        q = evaluate(model, ref, spec, question_point=point)
        assert rows.loc[point, "spec"] == spec.label() and rows.loc[point, "kl_mean"] == pytest.approx(q.kl_mean)
    assert rows.loc["before-question", "kl_mean"] != rows.loc["after-question", "kl_mean"]
