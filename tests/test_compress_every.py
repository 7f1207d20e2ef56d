"""Compression during decoding (`Spec.compress_every`; kvviz.policies.recompress).

Asserted: compress_every = 0 is today's compressing once; with N the kept count at every step is
exactly budget + (steps since the last compression) and never more than budget + N; the compression
after the N-th step keeps exactly `select`'s choice among the held tokens under scores computed from a
trace cut at that step (built here, independently); streaming scorers, the oracle, Quest, AdaKV and
ChunkKV's kvpress rule are refused; the real-model cache (a tiny random Llama) makes the engine's own
decisions on its recorded run, deleting equals masking, and logits differ from compressing once; on the
bundled model `kvviz eval --compress-every 16` runs and differs from compressing once.
"""

from __future__ import annotations


import numpy as np
import pytest

from kvviz import Spec, SpecError, keep_masks
from kvviz.policies import ScoreContext, get_policy, select
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.trace import Trace

C, STEPS = 64, 40
SPEC = dict(sink=2, recent=8, heavy=8)  # budget 18
ONE_SHOT = ("snapkv", "knorm", "random", "expected_attention", "keydiff", "streaming")


@pytest.fixture(scope="module")
def trace():
    return make_synthetic(SyntheticSpec(context=C, steps=STEPS, layers=2, q_heads=4, kv_heads=2, head_dim=64))


def _later(trace):
    return trace.query_positions[trace.later_queries]


def test_zero_is_compressing_once(trace):
    assert Spec(**SPEC, scorer="snapkv", compress_every=0) == Spec(**SPEC, scorer="snapkv")
    once = keep_masks(trace, Spec(**SPEC, scorer="snapkv"), 1, _later(trace))
    assert (once.sum(axis=2) == 18).all()  # compressing once: the budget at every step


@pytest.mark.parametrize("scorer", ONE_SHOT)
@pytest.mark.parametrize("every", [1, 5, 16])
def test_kept_count_is_budget_plus_steps_since_the_last_compression(trace, scorer, every):
    spec = Spec(**SPEC, scorer=scorer, compress_every=every)
    positions = np.arange(C - 3, C + STEPS)
    for layer in range(trace.n_layers):
        m = keep_masks(trace, spec, layer, positions)
        counts = m.sum(axis=2)  # (steps, kv_heads)
        for i, p in enumerate(positions):
            want = min(p + 1, 18) if p < C else 18 + (p - C) % every + 1
            assert (counts[i] == want).all(), (p, counts[i], want)
        assert counts.max() <= 18 + every
        # before the first compression during decoding: the prompt's kept set, then every arrival
        once = keep_masks(trace, spec.with_(compress_every=0), layer, [C - 1])[0]
        first = m[positions.tolist().index(C - 1 + min(every, STEPS))]
        assert (first[:, :C] == once[:, :C]).all() and first[:, C : C + every].all()


def test_a_plugins_own_rule_holds_until_the_first_compression_during_decoding(trace):
    """A scorer with its own compression rule (a plug-in's `compression_kept`; ChunkKV's whole chunks are
    refused here) under compress_every: the prompt's queries see that rule's set (not `select`'s top
    tokens), and the decode steps before the first new compression see it plus every arrival."""
    from kvviz.policies import Policy

    class FirstTokens(Policy):
        name = "test-first-tokens"

        def score(self, ctx):  # later tokens score higher: `select` keeps the last
            return np.broadcast_to(np.arange(ctx.n_positions, dtype=float), (ctx.trace.n_kv_heads, ctx.n_positions))

        def compression_kept(self, scores, spec):  # its own rule: the first `budget` tokens
            kept = np.zeros(scores.shape, bool)
            kept[:, : spec.budget] = True
            return kept

    spec = Spec(**SPEC, scorer="knorm", compress_every=5)
    positions = np.arange(C - 6, C + 4)  # the prompt's last queries, then 4 steps
    first = np.zeros((trace.n_kv_heads, C), bool)
    first[:, :18] = True
    for layer in range(trace.n_layers):
        m = FirstTokens().keep_masks(ScoreContext(trace, layer, spec), positions)
        for i, p in enumerate(positions):
            if p < C:
                assert np.array_equal(m[i][:, : p + 1], first[:, : p + 1]) and not m[i][:, p + 1 :].any(), p
            else:
                assert np.array_equal(m[i][:, :C], first) and m[i][:, C : p + 1].all() and not m[i][:, p + 1 :].any()


def _cut(trace: Trace, end: int) -> Trace:
    """The trace's first `end` positions as a prompt (every layer, queries at every position)."""
    return Trace(
        q=trace.q[:, :, :end],
        k=trace.k[:, :, :end],
        v=trace.v[:, :, :end],
        context_len=end,
        tokens=trace.tokens[:end],
        query_positions=np.arange(end),
        meta=trace.meta,
    )


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "expected_attention"])
def test_the_compression_at_step_n_keeps_select_over_the_rescored_held_tokens(trace, scorer):
    N, layer = 8, 1
    spec = Spec(**SPEC, scorer=scorer, compress_every=N)
    p = C - 1 + N  # the N-th decode step's query
    before, after = keep_masks(trace, spec, layer, [p, p + 1])
    H = trace.n_kv_heads
    held = np.stack([np.flatnonzero(r) for r in before])  # (H, 18 + N)
    assert held.shape == (H, 18 + N)
    scores = np.broadcast_to(get_policy(scorer).score(ScoreContext(_cut(trace, p + 1), layer, spec)), (H, p + 1))
    if scorer == "knorm":  # and by hand: the smallest key norms
        assert np.allclose(scores, -np.linalg.norm(trace.k[layer, :, : p + 1].astype(np.float64), axis=-1), rtol=1e-6)
    keep = held[select(np.take_along_axis(scores, held, axis=1), spec)].reshape(H, -1)
    expected = np.zeros_like(after)
    np.put_along_axis(expected, keep, True, axis=1)
    expected[:, p + 1] = True  # the next token has arrived
    assert np.array_equal(after, expected)
    assert (after.sum(axis=1) == 19).all()


def test_snapkv_compressed_again_keeps_other_tokens_than_once(trace):
    """Compressing again changes what is kept: after the first compression during decoding the heavy hitters
    are SnapKV's votes of the last queries (generated ones), no longer the prompt's last queries'."""
    spec = Spec(**SPEC, scorer="snapkv")
    p = C - 1 + 4  # the 4th decode step's query
    again = keep_masks(trace, spec.with_(compress_every=4), 1, [p + 1])[0]
    once = keep_masks(trace, spec, 1, [p + 1])[0]
    assert not np.array_equal(again, once)
    assert (again.sum(axis=1).tolist(), once.sum(axis=1).tolist()) == ([19, 19], [18, 18])  # + the arrival


def test_pyramid_layers_stay_within_their_own_budget_plus_n(trace):
    from kvviz.policies.allocation import layer_spec

    spec = Spec(**SPEC, scorer="knorm", allocation="pyramid", compress_every=6)
    for layer in range(trace.n_layers):
        budget = layer_spec(spec, layer, trace.n_layers, C).budget
        counts = keep_masks(trace, spec, layer, _later(trace)).sum(axis=2)
        assert counts.max() == budget + 6 and counts.min() == budget + 1


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(scorer="h2o"), "already decides at every decode step"),
        (dict(scorer="tova"), "already decides at every decode step"),
        (dict(scorer="oracle"), "chooses at every query"),
        (dict(scorer="quest"), "chooses at every query"),
        (dict(scorer="snapkv", allocation="adakv"), "AdaKV's head budgets"),
        (dict(scorer="chunkkv"), "ChunkKV's whole chunks"),
    ],
)
def test_refused_where_it_means_nothing(changes, match):
    with pytest.raises(SpecError, match=match):
        Spec(**SPEC, compress_every=4, **changes)
    Spec(**SPEC, **changes)  # compressing once is fine
    Spec(compress_every=4, **changes)  # without eviction: nothing to compress


def test_chunkkv_filling_the_budget_compresses_again(trace):
    spec = Spec(**SPEC, scorer="chunkkv", chunk_rule="budget", chunk_size=4, compress_every=8)
    assert keep_masks(trace, spec, 0, _later(trace)).sum(axis=2).max() == 18 + 8


def test_link_flag_and_study_axis(tmp_path, capsys):
    from kvviz import links
    from study_util import check_one_axis

    from kvviz.cli import main

    values, notes = links.parse_query("scorer=snapkv&sink=2&recent=8&heavy=8&compress_every=16")
    assert notes == [] and links.spec_from_values(values).compress_every == 16
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "--compress-every" in capsys.readouterr().out
    check_one_axis(
        tmp_path / "s", "every", context=64, steps=24, scorer="knorm", budget=0.2, axis="compress_every", values=[0, 8]
    )


# --- the real-model cache: a tiny random Llama ----------------------------------------------------


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "keydiff"])
def test_real_run_compresses_as_the_engine_does(tiny, scorer):
    """The run's own queries replayed through Policy.keep_masks give the kept set of every step; the
    cache never holds more than budget + N; the logits differ from compressing once."""
    from kvviz.decode.loop import decode

    torch = pytest.importorskip("torch")
    model, ids = tiny
    N, n, steps = 5, 24, 20
    spec = Spec(sink=2, recent=5, heavy=7, scorer=scorer, compress_every=N)
    logits, _, cache = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], record=True)
    trace = cache.run_trace()
    positions = np.arange(n, n + steps)
    for layer in range(trace.n_layers):
        got = cache.kept_history(layer)
        assert np.array_equal(got, get_policy(scorer).keep_masks(ScoreContext(trace, layer, spec), positions))
        counts = got.sum(axis=2)
        assert counts.max() == 14 + N and (counts == (14 + (positions - n) % N + 1)[:, None]).all()
        assert cache.recompressed_at[layer] == [n - 1 + N * k for k in range(1, steps // N + 1)]
    masked, _, _ = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], mode="mask")
    assert torch.allclose(logits, masked, atol=1e-4)
    once, _, _ = decode(model, ids[:n], spec.with_(compress_every=0), steps, feed=ids[n : n + steps])
    assert torch.equal(logits[:1], once[:1]) and (logits - once).abs().max() > 1e-4


def test_real_run_pyramid_and_block_fallback(tiny):
    """PyramidKV's layers compress again within their own budgets; a block request runs the step loop."""
    from kvviz.decode.loop import decode
    from kvviz.policies.allocation import layer_spec
    from kvviz.rows import keep_masks

    torch = pytest.importorskip("torch")
    model, ids = tiny
    spec = Spec(sink=2, recent=5, heavy=9, scorer="knorm", allocation="pyramid", compress_every=4)
    stepped, _, cache = decode(model, ids[:24], spec, 12, feed=ids[24:36], record=True)
    trace = cache.run_trace()
    for layer in range(2):
        expected = keep_masks(trace, spec, layer, np.arange(24, 36))  # the engine, allocation included
        assert np.array_equal(cache.kept_history(layer), expected)
        assert expected.sum(axis=2).max() == layer_spec(spec, layer, 2, 24).budget + 4
    block, _, c2 = decode(model, ids[:24], spec, 12, feed=ids[24:36], block=True)
    assert not c2.block and torch.allclose(block, stepped, atol=1e-5)


# --- the bundled model ------------------------------------------------------------------------------


@pytest.mark.model
def test_kvviz_eval_compress_every_16_differs_from_once(capsys, monkeypatch):
    from apptest_util import share_one_model_load
    from cli_util import eval_json, run_cli

    share_one_model_load(monkeypatch)  # both runs read the model this process loaded once

    window = ("--scorer", "snapkv", "--sink", 4, "--recent", 16, "--heavy", 32)
    argv = (*window, "--prompt-tokens", 96, "--continuation-tokens", 48)
    once = eval_json(capsys, *argv)
    again = eval_json(capsys, *argv, "--compress-every", 16)
    assert (again["compress_every"], once["compress_every"]) == (16, 0)
    assert again["spec"] == once["spec"] + ", compressed again every 16 steps"
    assert again["kl_mean"] != once["kl_mean"] and again["per_token"]["kl"] != once["per_token"]["kl"]
    # the first continuation token is predicted by the prefill, before any decode step
    assert again["per_token"]["kl"][:1] == once["per_token"]["kl"][:1]
    code, _, err = run_cli(capsys, "eval", *argv, "--scorer", "h2o", "--compress-every", 16, "--quiet", "--json")
    assert code == 2 and "already decides at every decode step" in err  # refused: one line
    # 47 decode steps at positions 96..142, compressed again after 111 and 127: 52 + 15 held at the end
    assert (once["kept_tokens"], again["kept_tokens"]) == (52, 67)


@pytest.mark.model
def test_bundled_cache_never_holds_more_than_budget_plus_n():
    from apptest_util import load_shared

    from kvviz.decode.loop import decode
    from kvviz.decode.quality import sample_text, tokenize

    model, tokenizer, _ = load_shared("bundled")
    ids = tokenize(tokenizer, sample_text())
    spec = Spec(sink=4, recent=16, heavy=32, scorer="snapkv", compress_every=16)
    _, _, cache = decode(model, ids[:96], spec, 47, feed=ids[96:143], record=True)
    steps = np.arange(47)
    trace = cache.run_trace()
    for layer in range(cache.L):
        counts = cache.kept_history(layer).sum(axis=2)  # (steps, KV heads)
        assert counts.max() <= 52 + 16
        assert (counts == (52 + steps % 16 + 1)[:, None]).all()
        assert cache.recompressed_at[layer] == [111, 127]
    for layer in (0, 15, 29):  # the engine, replaying the run's own queries, keeps the same tokens
        expected = get_policy("snapkv").keep_masks(ScoreContext(trace, layer, spec), np.arange(96, 143))
        assert np.array_equal(cache.kept_history(layer), expected)


# --- the Decode timeline and the app's widgets ------------------------------------------------------


def test_the_timeline_marks_the_compressions(trace):
    from kvviz.analysis.timeline import timeline
    from kvviz.plots.decode import RECOMPRESS_LINE, timeline_map
    from kvviz.plots.timeline import timeline_animation

    spec = Spec(**SPEC, scorer="oracle")
    tl = timeline(trace, spec, layer=1, policies=("h2o", "snapkv", "knorm", "oracle"), compress_every=8)
    assert tl.skipped == {} and tl.decides_every_step == ("h2o", "oracle")
    for name in ("snapkv", "knorm"):
        pt = tl.policies[name]
        assert pt.compressed_after.tolist() == [7, 15, 23, 31]  # after the 8th, 16th, ... step's query
        assert pt.kept.sum(axis=1).max() == 18 + 8
        assert np.array_equal(
            pt.kept, keep_masks(trace, spec.with_(scorer=name, compress_every=8), 1, tl.positions)[:, 0]
        )
    for name in ("h2o", "oracle"):  # they decide at every step: as always
        assert len(tl.policies[name].compressed_after) == 0
        assert np.array_equal(
            tl.policies[name].kept, timeline(trace, spec, layer=1, policies=(name,)).policies[name].kept
        )
    lines = [s for s in timeline_animation(tl).layout.shapes if s.line.color == RECOMPRESS_LINE["color"]]
    assert sorted(s.y0 for s in lines) == sorted([7.5, 15.5, 23.5, 31.5] * 2)
    assert len([s for s in timeline_map(tl, "knorm").layout.shapes if s.line.color == RECOMPRESS_LINE["color"]]) == 4
    once = timeline(trace, spec, layer=1, policies=("snapkv",))
    assert len(once.policies["snapkv"].compressed_after) == 0


def test_the_timeline_page_has_the_widget_and_draws_the_compressions():
    from pathlib import Path

    from apptest_util import run_app

    page = str(Path(__file__).resolve().parents[1] / "pages" / "4_decode-timeline.py")
    at = run_app(
        page,
        120,
        sink=2,
        recent=8,
        heavy=8,
        compress_every=8,
        tl_policies="snapkv,h2o",
        **{"source": "synthetic", "context": "96", "steps": "24"},
    )
    box = at.number_input(key="compress_every")
    assert box.value == 8 and box.label.startswith("Compress again every N decode steps")
    assert any("compress again every 8 decode steps" in c.value for c in at.caption)
    box.set_value(0).run()
    assert not at.exception and at.session_state["_kvviz_state"]["compress_every"] == 0
    assert not any("compress again every" in c.value for c in at.caption)


def test_advanced_shows_the_widget_for_one_shot_scorers():
    from pathlib import Path

    from apptest_util import run_app

    from kvviz.app.compression import ADVANCED

    app = str(Path(__file__).resolve().parents[1] / "app.py")
    at = run_app(app, opened=(ADVANCED,), scorer="snapkv", sink=2, recent=8, heavy=8, compress_every=16)
    assert at.number_input(key="compress_every").value == 16
    at = run_app(app, opened=(ADVANCED,), scorer="h2o")
    assert "compress_every" not in [w.key for w in at.number_input]
    lab = str(Path(__file__).resolve().parents[1] / "pages" / "3_model-lab.py")  # the decode path's page
    at = run_app(lab, 120, opened=(ADVANCED,), scorer="knorm", sink=4, recent=8, heavy=8, compress_every=4)
    assert at.number_input(key="compress_every").value == 4


@pytest.mark.parametrize(
    "spec",
    [
        Spec(sink=2, recent=5, heavy=7, scorer="snapkv", compress_every=4),
        Spec(sink=2, recent=5, heavy=9, scorer="knorm", allocation="pyramid", compress_every=4),
        Spec(sink=2, recent=5, heavy=9, scorer="h2o", allocation="pyramid"),
    ],
)
def test_decode_many_runs_each_spec_as_decode_does(tiny, spec):
    """The Model lab's batched loop (decode_many) gives a run what decode gives it alone: compressing again every
    N steps, and PyramidKV's per-layer budgets (its own cache class)."""
    from kvviz.decode.loop import decode, decode_many

    torch = pytest.importorskip("torch")
    model, ids = tiny
    alone, _, c1 = decode(model, ids[:24], spec, 12, feed=ids[24:36])
    ((batched, _, c2),) = decode_many(model, ids[:24], [spec], [12], [ids[24:36]])
    assert torch.allclose(alone, batched, atol=1e-4)
    assert [k.shape for k in c1.kept] == [k.shape for k in c2.kept]


def test_a_layer_trace_is_checked_as_its_one_layer(trace):
    from kvviz.policies.recompress import layer_trace
    from kvviz.trace import TraceError

    q, k, v = trace.q[1], trace.k[1], trace.v[1]
    t = layer_trace(q, k, v, 1, 5, trace.tokens, trace.meta)
    assert t.n_layers == 5 and t.k.strides[0] == 0 and np.array_equal(t.k[3], k)
    bad = k.copy()
    bad[0, 3, 0] = np.nan
    with pytest.raises(TraceError, match="k contains NaN"):
        layer_trace(q, bad, v, 1, 5, trace.tokens, trace.meta)


def test_the_memory_card_counts_what_the_cache_holds(trace):
    """Between compressions the cache holds more than the budget: the bytes are counted from the kept sets."""
    from kvviz import View, compare
    from kvviz.engine import kept_counts

    spec = Spec(**SPEC, scorer="knorm", compress_every=8)
    for j, qi in enumerate(trace.later_queries[:10]):
        assert (kept_counts(trace, spec, int(qi)) == 18 + j % 8 + 1).all()
    view = View(step=4)  # 5 tokens since the prompt: 23 held
    again = compare(trace, spec, view).memory
    once = compare(trace, spec.with_(compress_every=0), view).memory
    assert (again.kept_tokens, once.kept_tokens) == (23, 18)
    assert again.kv_bytes * 18 == once.kv_bytes * 23  # 16-bit: bytes in proportion to tokens


@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "channel")])
def test_quantized_kept_tokens_after_a_compression_are_quantize_of_what_is_kept(tiny, monkeypatch, axes):
    """The incremental quantizer reuses groups across steps; a compression during decoding removes tokens from
    the middle of the cache, and what is attended is still kvviz.quant.quantize of the kept K/V at every step."""
    from decode_util import check_every_quantization, two_and_three_bit_spec

    from kvviz.decode.loop import decode

    model, ids = tiny
    spec = two_and_three_bit_spec(axes, sink=2, recent=5, heavy=6, scorer="knorm", compress_every=4)
    checked = check_every_quantization(monkeypatch)
    decode(model, ids[:20], spec, 16, feed=ids[20:36])
    assert len(checked) == 2 * 2 * 16 and sorted(set(checked)) == [14, 15, 16, 17]


def test_solve_does_not_claim_the_global_smallest_when_compressing_again(trace):
    """Kept sets of growing budgets are nested when compressing once, not when compressing again (each budget
    holds its own tokens at each compression): solve's answer then only promises that one token less misses."""
    from kvviz import View
    from kvviz.analysis.solve import solve

    once = solve(trace, Spec(scorer="knorm"), View(step=20), target_mass=0.8)
    again = solve(trace, Spec(scorer="knorm", compress_every=8), View(step=20), target_mass=0.8)
    assert once.exact and not again.exact
    assert again.value >= 0.8 and (again.below is None or again.below < 0.8)
