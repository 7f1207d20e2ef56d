"""kvviz.decode.lab, labsettings and labstore: the Model lab's compute outside Streamlit (tiny random
Llama), its JSON results on disk, the estimate, and the page opening on a stored result without loading a
model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz import decode as gen  # noqa: E402
from kvviz.decode import hook  # noqa: E402
from kvviz.decode import lab, labsettings, labstore  # noqa: E402
from kvviz.spec import Spec, SpecError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAB_PAGE = str(ROOT / "pages" / "3_model-lab.py")


class Tok:
    """A tokenizer for the tiny model: the text is space-separated token ids."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [int(w) for w in text.split()]}

    def decode(self, ids):
        return f" {ids[0]}"


@pytest.fixture(scope="module")
def tiny():
    model, ids = tiny_llama()
    return model, " ".join(map(str, ids))


@pytest.fixture(autouse=True)
def lab_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVVIZ_LAB_DIR", str(tmp_path / "lab"))
    lab._FULL.clear()
    labstore._RUNS.clear()


@pytest.mark.parametrize(
    "spec",
    [Spec(sink=2, recent=6, heavy=4, scorer="snapkv"), Spec(sink=2, recent=6, heavy=4, scorer="h2o")],
    ids=lambda s: s.scorer,
)
def test_a_run_equals_the_separate_functions(tiny, spec):
    model, text = tiny
    settings = labsettings.LabSettings("tiny", text, 24, 20, 8, spec)
    streamed = []
    result = lab.run(model, Tok(), "tiny", settings, on_token=lambda i, t: streamed.append(t))
    ids = Tok()(text)["input_ids"]
    q = gen.evaluate(model, gen.reference(model, Tok(), ids, 24, 20), spec, block=False)
    np.testing.assert_allclose(result.quality.nll, q.nll, atol=1e-5)
    np.testing.assert_allclose(result.quality.kl, q.kl, atol=1e-5)
    pair = gen.side_by_side(model, Tok(), ids[:24], spec, 8)
    assert result.pair.full_ids == pair.full_ids and result.pair.compressed_ids == pair.compressed_ids
    assert tuple(streamed) == pair.compressed_ids
    assert lab.full_cached(model, Tok(), settings)  # the full-cache side is kept per text
    again = lab.run(model, Tok(), "tiny", settings.__class__(**{**settings.__dict__, "spec": Spec(sink=1, recent=4)}))
    assert again.pair.full_ids == pair.full_ids
    assert labstore.estimate(settings) > 0  # measured step times now exist


@pytest.mark.parametrize(
    "n_ids, asked, fitted",
    [
        (177, (206, 57), (120, 57)),  # the Bakery story at the page's defaults: the continuation kept
        (300, (206, 57), (206, 57)),  # a longer text: unchanged
        (207, (206, 57), (206, 57)),  # one token left to score is enough: unchanged
        (206, (206, 57), (149, 57)),
        (40, (206, 57), (20, 20)),  # at most half the text is scored
        (3, (8, 2), (2, 1)),
        (1, (8, 2), (8, 2)),  # cannot be split: left to the run's own error
    ],
)
def test_fit_to_text_shortens_only_a_prompt_the_text_cannot_hold(n_ids, asked, fitted):
    settings = labsettings.LabSettings("tiny", "", *asked, 0, Spec())
    got = labsettings.fit_to_text(settings, n_ids)
    assert (got.prompt_tokens, got.continuation) == fitted
    assert (got is settings) == (fitted == asked)
    if got is not settings:  # the whole text: prompt, then what is scored
        assert got.prompt_tokens + got.continuation == n_ids


def test_a_text_shorter_than_the_prompt_runs_on_the_fitted_settings_and_says_what_was_asked(tiny):
    model, text = tiny  # 60 tokens
    asked = labsettings.LabSettings("tiny", text, 64, 20, 0, Spec(sink=2, recent=6))
    result = lab.run(model, Tok(), "tiny", asked)
    fitted = labsettings.fit_to_text(asked, 60)
    assert result.asked == asked and (fitted.prompt_tokens, fitted.continuation) == (40, 20)
    same = lab.run(model, Tok(), "tiny", fitted)
    assert same.asked is None
    np.testing.assert_array_equal(result.quality.nll, same.quality.nll)


@pytest.mark.parametrize("point", ["before-question", "after-question"])
@pytest.mark.parametrize(
    "spec",
    [Spec(sink=2, recent=6, heavy=4, scorer="snapkv"), Spec(sink=2, recent=6, heavy=4, scorer="h2o")],
    ids=lambda s: s.scorer,
)
def test_a_run_with_a_question_equals_the_separate_functions(tiny, spec, point):
    """A question after the context: the batched lab loop (question fed first when compressing before it) gives
    what evaluate and side_by_side give alone, and streams the answer from its first token."""
    model, text = tiny
    settings = labsettings.LabSettings("tiny", text, 20, 16, 6, spec, question="3 1 4 1 5", question_point=point)
    streamed = []
    result = lab.run(model, Tok(), "tiny", settings, on_token=lambda i, t: streamed.append((i, t)))
    ids = Tok()(text)["input_ids"]
    ref = gen.reference(model, Tok(), ids, 20, 16, question="3 1 4 1 5")
    assert ref.ids[:25] == (*ids[:20], 3, 1, 4, 1, 5) and ref.ids[25:] == tuple(ids[20:36])
    assert (ref.prompt_len, ref.question_start) == (25, 20)
    c = ref.compression_point(point)
    assert c == (20 if point == "before-question" else 25)
    q = gen.evaluate(model, ref, spec, block=False, question_point=point)
    np.testing.assert_allclose(result.quality.nll, q.nll, atol=1e-5)
    np.testing.assert_allclose(result.quality.kl, q.kl, atol=1e-5)
    assert result.quality.as_dict()["compressed_at"] == c and result.quality.as_dict()["question_tokens"] == 5
    pair = gen.side_by_side(model, Tok(), list(ref.ids[:25]), spec, 6, compress_at=c)
    assert result.pair.full_ids == pair.full_ids and result.pair.compressed_ids == pair.compressed_ids
    assert streamed == list(enumerate(pair.compressed_ids))
    assert len(pair.compressed_ids) == 6 and result.prompt_text == "".join(ref.tokens[:25])


def test_compressing_before_the_question_decodes_it_through_the_compressed_cache(tiny):
    """Without eviction both compression points are the full cache (the question fed step by step reads every
    token); with SnapKV the two points keep different tokens, so the scored logits differ."""
    model, text = tiny
    ids = Tok()(text)["input_ids"]
    ref = gen.reference(model, Tok(), ids, 20, 16, question="3 1 4 1 5")
    for point in ("before-question", "after-question"):
        q = gen.evaluate(model, ref, Spec(), question_point=point)
        assert q.kl.max() < 1e-6 and q.kept_tokens == q.total_tokens == 25 + 15
    spec = Spec(sink=2, recent=4, heavy=4, scorer="snapkv")
    before = gen.evaluate(model, ref, spec, question_point="before-question")
    after = gen.evaluate(model, ref, spec, question_point="after-question")
    assert not np.allclose(before.kl, after.kl)
    with pytest.raises(SpecError, match="compression point"):
        ref.compression_point("middle")


def test_a_callback_can_cancel_a_run(tiny):
    model, text = tiny
    settings = labsettings.LabSettings("tiny", text, 24, 20, 12, Spec(sink=2, recent=4, scorer="h2o"))

    def stop(i, t):
        if i == 4:
            raise lab.Cancelled

    with pytest.raises(lab.Cancelled):
        lab.run(model, Tok(), "tiny", settings, on_token=stop)
    assert model.config._attn_implementation == "eager" and not hook._ACTIVE


def test_results_round_trip_through_json(tiny):
    model, text = tiny
    settings = labsettings.LabSettings(
        "tiny", text, 24, 20, 6, Spec(sink=2, recent=6, heavy=4, scorer="knorm", key_bits=4)
    )
    result = lab.run(model, Tok(), "tiny", settings)
    assert labstore.load_result(settings) is None
    path = labstore.save_result(settings, result)
    assert path.is_file() and path.read_text().startswith("{")  # JSON, not a pickle
    back = labstore.load_result(settings)
    q, b = result.quality, back.quality
    assert b.spec == q.spec and b.tokens == q.tokens and np.array_equal(b.nll, q.nll) and np.array_equal(b.kl, q.kl)
    assert b.as_dict() == q.as_dict()
    assert back.pair == result.pair and back.precomputed
    other = labsettings.LabSettings("tiny", text, 24, 20, 6, Spec(sink=2, recent=6, heavy=4, scorer="knorm"))
    assert labstore.load_result(other) is None  # keyed by the settings
    path.write_text("{broken")
    assert labstore.load_result(settings) is None


def test_the_page_opens_on_the_stored_default_result(tiny, monkeypatch):
    """The default settings' stored result shows at once, without loading a model."""
    import kvviz.models
    from apptest_util import run_app

    model, text = tiny
    tiny_result = lab.run(
        model, Tok(), "tiny", labsettings.LabSettings("tiny", text, 24, 20, 6, Spec(sink=4, recent=8))
    )
    default = labsettings.default_settings()
    labstore.save_result(default, dataclasses.replace(tiny_result, model="stored model"))
    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    at = run_app(LAB_PAGE, 300)
    assert not at.exception
    shown = {m.label: m.value for m in at.metric}
    assert shown["Perplexity (compressed)"] == f"{tiny_result.quality.perplexity:.2f}"
    assert any("Precomputed for the default settings" in c.value for c in at.caption)
    assert "Run again (live)" in [b.label for b in at.button]


def test_the_estimate_is_the_median_of_the_last_runs_of_the_same_size():
    """Not "About 5 s" for a run that took 94 s on a busy server. The estimate is what runs of this
    size took on this server lately: the median of the last five, a different size not mixed in."""
    settings = labsettings.default_settings()
    labstore.record_time("step", 0.01)
    labstore.record_time("forward_token", 0.001)
    by_steps = labstore.step_estimate(settings)
    assert labstore.estimate(settings) == pytest.approx(by_steps) and labstore.recent_runs(settings) == (None, 0)
    for seconds in (90.0, 6.0, 7.0):
        labstore.record_run(settings, seconds)
    assert labstore.recent_runs(settings) == (7.0, 3) and labstore.estimate(settings) == 7.0
    other = labsettings.LabSettings(
        settings.model,
        settings.text,
        settings.prompt_tokens * 2,
        settings.continuation,
        settings.greedy_tokens,
        settings.spec,
    )
    labstore.record_run(other, 500.0)
    assert labstore.estimate(settings) == 7.0 and labstore.recent_runs(other) == (500.0, 1)
    for seconds in (30.0, 31.0, 32.0, 33.0):  # only the last five count: 7, 30, 31, 32, 33
        labstore.record_run(settings, seconds)
    assert labstore.recent_runs(settings) == (31.0, 5)
    stepwise = labsettings.LabSettings(
        settings.model,
        settings.text,
        settings.prompt_tokens,
        settings.continuation,
        settings.greedy_tokens,
        Spec(sink=4, recent=8, heavy=2, scorer="h2o"),
    )
    assert labsettings.one_pass(stepwise.spec) != labsettings.one_pass(Spec())
    assert labstore.recent_runs(
        labsettings.LabSettings(
            settings.model, settings.text, settings.prompt_tokens, settings.continuation, settings.greedy_tokens, Spec()
        )
    ) == (None, 0)


def test_a_run_records_its_time(tiny):
    model, text = tiny
    settings = labsettings.LabSettings("tiny", text, 24, 20, 4, Spec(sink=2, recent=6))
    result = lab.run(model, Tok(), "tiny", settings)
    assert isinstance(result, labstore.LabResult)  # a frozen result with named fields
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.seconds = 0.0
    assert labstore.recent_runs(settings) == (pytest.approx(result.seconds), 1)


def test_the_page_says_where_its_estimate_comes_from_and_when_the_server_is_busy(monkeypatch):
    from apptest_util import run_app

    from kvviz.app import guard

    def caption(at) -> str:
        return next(c.value for c in at.caption if c.value.startswith(("About", "The first run")))

    assert caption(run_app(LAB_PAGE, 120)).startswith("The first run also measures")
    for seconds in (12.0, 95.0, 14.0):
        labstore.record_run(labsettings.default_settings(), seconds)
    text = caption(run_app(LAB_PAGE, 120))
    assert text.startswith("About 14 s (the median of the last 3 runs of this size on this server)"), text
    assert "busy" not in text
    busy = guard.Pool(4)  # another visitor's run holds a slot of this server
    busy.acquire(object(), lambda: None)
    monkeypatch.setattr(guard, "pool", lambda: busy)
    text = caption(run_app(LAB_PAGE, 120))
    assert "The server is busy (1 other run in progress or waiting)" in text, text
