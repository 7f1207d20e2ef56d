"""KVzip: one budget over the whole cache from the model's reconstruction scores (kvviz.policies.kvzip), and the
reconstruction pass itself (kvviz.decode.reconstruct). Its kept sets against kvpress's: test_kvpress_reference."""

from __future__ import annotations

import numpy as np
import pytest

from kvviz import Spec, SpecError, View, compare, keep_masks
from kvviz.policies.allocation import kvpress_kept
from kvviz.policies.kvzip import META, kept_everywhere
from kvviz.trace import Trace, trace_with

from trace_util import every_query_trace


def scored_trace(seed=0, L=3, H=2, g=2, c=40, steps=4, D=8) -> Trace:
    rng = np.random.default_rng(seed)
    P = c + steps
    q = rng.standard_normal((L, H * g, P, D)).astype(np.float32)
    k = rng.standard_normal((L, H, P, D)).astype(np.float32)
    v = rng.standard_normal((L, H, P, D)).astype(np.float32)
    return every_query_trace(q, k, v, c, {"source": "test", META: rng.random((L, H, c)).tolist()})


def test_the_global_cut_keeps_the_budget_over_every_layer_and_head():
    t = scored_trace()
    scores = np.asarray(t.meta[META])
    L, H, c = scores.shape
    spec = Spec(sink=2, recent=0, heavy=10, scorer="kvzip")
    keep = kept_everywhere(scores, spec)
    assert keep.sum() == L * H * c - int(L * H * (c - kvpress_kept(spec.budget)))  # kvpress's count
    assert keep[..., :2].all()  # the sinks
    dropped, kept = scores[..., 2:][~keep[..., 2:]], scores[..., 2:][keep[..., 2:]]
    assert dropped.max() < kept.min()  # the lowest go, anywhere
    counts = keep.sum(axis=2)
    assert counts.min() < counts.max()  # each head its own count


def test_the_trace_path_keeps_the_cut_then_every_later_token():
    t = scored_trace()
    spec = Spec(sink=2, recent=3, heavy=10, scorer="kvzip")
    keep = kept_everywhere(np.asarray(t.meta[META]), spec)
    assert keep[..., -3:].all()  # the prompt's last tokens
    for layer in range(t.n_layers):
        masks = keep_masks(t, spec, layer, [39, 41, 43])
        assert np.array_equal(masks[0, :, :40], keep[layer])
        assert np.array_equal(masks[2, :, :40], keep[layer]) and masks[2, :, 40:44].all()
    c = compare(t, spec, View(layer=1, head=3, step=2))
    assert c.primary.kept.sum() == keep[1, 1].sum() + 3


def test_a_source_without_the_reconstruction_pass_says_where_to_get_one():
    t = scored_trace()
    bare = trace_with(t, meta={"source": "test"})
    with pytest.raises(SpecError, match="the needle test, the leaderboard, and a capture with KVzip.s pass"):
        compare(bare, Spec(sink=2, recent=3, heavy=10, scorer="kvzip"), View())
    with pytest.raises(SpecError, match="sink or a recent window"):
        Spec(sink=0, recent=0, heavy=10, scorer="kvzip")
    with pytest.raises(SpecError, match="no budget for adakv"):
        Spec(sink=2, recent=3, heavy=10, scorer="kvzip", allocation="adakv")


@pytest.mark.model
def test_the_decode_side_runs_the_pass_and_refuses_without_the_tokenizer():
    from apptest_util import load_shared

    from kvviz.decode.loop import decode
    from kvviz.decode.quality import sample_text
    from kvviz.decode.reconstruct import kvzip_scores, repeat_prompt

    model, tok, _ = load_shared("bundled")
    ids = list(tok(sample_text())["input_ids"])[:72]
    spec = Spec(sink=4, recent=4, heavy=16, scorer="kvzip")
    repeat = repeat_prompt(tok)
    _, _, cache = decode(model, ids[:64], spec, 8, feed=ids[64:72], repeat=repeat)
    keep = kept_everywhere(kvzip_scores(model, repeat, ids[:64]), spec)
    for layer in range(keep.shape[0]):
        held = cache.kept_positions(layer)
        for h, positions in enumerate(held):  # the cut at the prompt, then every decoded token
            assert np.array_equal(positions, np.r_[np.flatnonzero(keep[layer, h]), 64:72])
    with pytest.raises(SpecError, match="needs the model to repeat the prompt"):
        decode(model, ids[:64], spec, 2)


def test_the_explorer_on_the_handbook_says_why_kvzip_cannot_run_there():
    from pathlib import Path

    from apptest_util import run_app

    at = run_app(str(Path(__file__).resolve().parents[1] / "pages" / "0_explorer.py"), 120, scorer="kvzip")
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "repeating the context" in errors[0] and "the Model lab" in errors[0]


@pytest.mark.model
def test_a_capture_with_kvzips_pass_keeps_its_scores_in_memory_in_a_file_and_for_some_layers(tmp_path):
    """`kvviz capture --kvzip` and the Real model source's box: the scores of every layer ride in the trace's
    meta (6 significant digits), through a trace file too; a capture of some layers keeps what the whole
    model's cut keeps there, as the decode side's pass does."""
    from apptest_util import load_shared

    from kvviz.decode.reconstruct import kvzip_meta, kvzip_scores, repeat_prompt
    from kvviz.decode.quality import sample_text
    from kvviz.sources.capture import capture
    from kvviz.sources.tracefile import load_trace

    model, tok, info = load_shared("bundled")
    text = " ".join(sample_text().split()[:60])
    spec = Spec(sink=4, recent=4, heavy=24, scorer="kvzip")
    whole = capture(model, tok, info, text, new_tokens=2, more_meta=kvzip_meta(model, tok))
    c = whole.context_len
    direct = kvzip_scores(model, repeat_prompt(tok), list(whole.meta["token_ids"])[:c])
    np.testing.assert_allclose(np.asarray(whole.meta[META]), direct, rtol=1e-5)
    want = kept_everywhere(direct, spec)
    for layer in range(whole.n_layers):
        assert np.array_equal(keep_masks(whole, spec, layer, [c - 1])[0, :, :c], want[layer])
    some = capture(
        model,
        tok,
        info,
        text,
        new_tokens=2,
        layers="0,7,29",
        out=tmp_path / "some.safetensors",
        more_meta=kvzip_meta(model, tok),
    )
    opened = load_trace(tmp_path / "some.safetensors")
    for trace in (some, opened):
        assert trace.layer_numbers == (0, 7, 29) and np.asarray(trace.meta[META]).shape[0] == 30
        for i, number in enumerate(trace.layer_numbers):
            assert np.array_equal(keep_masks(trace, spec, i, [c - 1])[0, :, :c], want[number])
    plain = capture(model, tok, info, text, new_tokens=0)
    with pytest.raises(SpecError, match="kvviz capture --kvzip"):
        keep_masks(plain, spec, 0, [c - 1])
