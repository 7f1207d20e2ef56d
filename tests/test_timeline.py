"""The decode timeline: kept sets per step, regret, evicted-and-later-needed, and its figures."""

from __future__ import annotations

import numpy as np
import pytest

from kvviz.attention import softmax
from kvviz.plots.decode import continuation_html, kl_strip, regret_chart, timeline_map
from kvviz.sources import SyntheticSpec, handbook_trace, make_synthetic
from kvviz.spec import Spec, SpecError
from kvviz.analysis.timeline import EVICTED, FUTURE, KEPT, MISSED, timeline
from kvviz.trace import TraceError

SPEC = Spec(sink=4, recent=16, heavy=16)


@pytest.fixture(scope="module")
def shifted():
    return make_synthetic(SyntheticSpec(context=256, steps=48, topic_shift=12.0))


@pytest.fixture(scope="module")
def calm():
    return make_synthetic(SyntheticSpec(context=256, steps=48, topic_shift=0.0))


def test_regret_is_the_full_attention_on_evicted_tokens(shifted):
    tl = timeline(shifted, SPEC, layer=1, kv_head=1)
    g = shifted.group_size
    for s in (0, 17, 47):
        qi = int(shifted.later_queries[s])
        p = int(shifted.query_positions[qi])
        heads = range(g, 2 * g)
        logits = np.stack(
            [
                shifted.q[1, h, qi].astype(np.float64)
                @ shifted.k[1, 1, : p + 1].astype(np.float64).T
                / np.sqrt(shifted.head_dim)
                for h in heads
            ]
        )
        a = softmax(logits).mean(axis=0)
        assert np.allclose(tl.attention[s, : p + 1], a)
        assert tl.attention[s, p + 1 :].sum() == 0
        for name, pt in tl.policies.items():
            evicted = ~pt.kept[s, : p + 1]
            assert pt.regret[s] == pytest.approx(a[evicted].sum(), abs=1e-12), name
            assert np.array_equal(pt.missed[s, : p + 1], evicted & (a >= tl.need))
            assert not pt.missed[s, p + 1 :].any()


def test_every_policy_holds_the_budget(shifted):
    tl = timeline(shifted, SPEC)
    for name, pt in tl.policies.items():
        assert np.array_equal(pt.kept.sum(axis=1), np.minimum(SPEC.budget, tl.positions + 1)), name
        # the newest token and the sinks are always held
        assert pt.kept[np.arange(tl.n_steps), tl.positions].all()
        assert pt.kept[:, :4].all()


def test_streamingllm_holds_sinks_and_the_window(shifted):
    tl = timeline(shifted, SPEC, policies=("streaming",))
    for s, p in enumerate(tl.positions):
        expected = np.zeros(shifted.n_positions, dtype=bool)
        expected[:4] = True
        expected[p + 1 - 32 : p + 1] = True  # the heavy budget widens the window
        assert np.array_equal(tl.policies["streaming"].kept[s], expected)


def test_oracle_regret_is_the_lower_bound(shifted, calm):
    for trace in (shifted, calm):
        for layer in range(trace.n_layers):
            tl = timeline(trace, SPEC, layer=layer)
            bound = tl.policies["oracle"].regret
            for name in ("h2o", "tova", "streaming"):
                assert (bound <= tl.policies[name].regret + 1e-12).all(), name
            assert not tl.policies["oracle"].evicted_needed.any()


def test_topic_shift_tokens_are_evicted_then_needed(shifted, calm):
    """Late anchors nobody looked at before the shift: H2O evicts them, then the queries
    after the shift need them - the handbook's warning, on the map."""
    shift_tokens = shifted.meta["shift_tokens"]
    shift_step = shifted.meta["shift_position"] - shifted.context_len
    tl = timeline(shifted, SPEC, layer=1)
    h2o = tl.policies["h2o"]
    late = [t for t in shift_tokens if t < shifted.context_len - SPEC.recent]
    assert late
    assert h2o.evicted_needed[late].all()
    assert (h2o.first_missed_step[late] >= shift_step).all()
    # regret jumps at the shift, and is higher than without a shift
    before = h2o.regret[:shift_step].mean()
    after = h2o.regret[shift_step:].mean()
    assert after > before + 0.1
    calm_tl = timeline(calm, SPEC, layer=1)
    assert after > calm_tl.policies["h2o"].regret[shift_step:].mean() + 0.1


def test_states_map(shifted):
    tl = timeline(shifted, SPEC)
    pt = tl.policies["h2o"]
    st = pt.states(tl.positions)
    assert st.shape == (48, shifted.n_positions)
    for s, p in enumerate(tl.positions):
        assert (st[s, p + 1 :] == FUTURE).all()
        assert ((st[s, : p + 1] == KEPT) == pt.kept[s, : p + 1]).all()
        assert ((st[s, : p + 1] == MISSED) == pt.missed[s, : p + 1]).all()
        assert set(np.unique(st[s, : p + 1])) <= {EVICTED, KEPT, MISSED}


def test_figures_show_what_was_computed(shifted):
    tl = timeline(shifted, SPEC, layer=1, kv_head=1)
    fig = timeline_map(tl, "tova", step=5)
    heat = fig.data[0]
    assert np.array_equal(np.asarray(heat.z), tl.policies["tova"].states(tl.positions))
    assert "layer 1" in fig.layout.title.text and "KV head 1" in fig.layout.title.text
    assert "tova" in fig.layout.title.text
    reg = regret_chart(tl, step=5)
    assert [t.name for t in reg.data] == list(tl.policies)
    for trace, pt in zip(reg.data, tl.policies.values()):
        assert np.allclose(trace.y, pt.regret)
    strip = kl_strip(["a", "b\n"], np.array([0.0, 0.5]))
    assert np.allclose(strip.data[0].z, [[0.0, 0.5]])


def test_continuation_html_marks_the_divergence_and_escapes():
    out = continuation_html(["Hello", " <b>", " world"], 1, "compressed")
    assert "&lt;b&gt;" in out and "<b>compressed</b>" in out
    assert out.count("first divergence") == 1
    assert "first divergence" not in continuation_html(["a", "b"], None, "full")


def test_errors_are_clear():
    with pytest.raises(TraceError, match="decode steps"):
        timeline(handbook_trace(), SPEC)
    trace = make_synthetic(SyntheticSpec(context=64, steps=4))
    with pytest.raises(SpecError, match="budget"):
        timeline(trace, Spec())
    with pytest.raises(SpecError, match="layer 5"):
        timeline(trace, SPEC, layer=5)
    with pytest.raises(SpecError, match="KV head 9"):
        timeline(trace, SPEC, kv_head=9)


def test_token_history_tells_when_a_token_was_evicted_and_needed(shifted):
    tl = timeline(shifted, SPEC, layer=1)
    h2o = tl.policies["h2o"]
    token = int(np.flatnonzero(h2o.evicted_needed)[0])
    text = h2o.history(token, tl.positions, tl.context_len)
    needed = np.flatnonzero(h2o.missed[:, token])
    from kvviz.analysis.frames import ranges_text

    assert f"needed at step{'s' if len(needed) > 1 else ''} {ranges_text(needed)} while evicted" in text
    if token < tl.context_len and not h2o.kept[0, token]:
        assert text.startswith("evicted at the compression point")
    assert tl.policies["oracle"].history(token, tl.positions, tl.context_len).count("needed") == 0
