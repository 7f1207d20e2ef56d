"""The synthetic source looks like real attention and its knobs do what they say."""

import tracemalloc

import numpy as np
import pytest

from kvviz import SpecError
from kvviz.attention import logit_row, softmax
from kvviz.metrics import top_share
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic


def _rows(trace):
    for layer in range(trace.n_layers):
        for head in range(trace.n_q_heads):
            for qi in trace.later_queries[::4]:
                yield softmax(logit_row(trace, layer, head, qi))


def test_defaults_look_like_real_attention():
    t = make_synthetic()
    rows = list(_rows(t))
    assert np.mean([top_share(a, 0.2) for a in rows]) >= 0.8
    first = np.mean([a[0] for a in rows])
    assert first > 10 * (1 / t.n_positions), "the first token is a visible sink"
    assert t.q.dtype == np.float32 and t.k.shape == t.v.shape == (2, 2, 544, 64)


def test_knobs_move_the_pattern():
    base = SyntheticSpec(context=256, steps=8)
    sink = lambda s: np.mean([a[0] for a in _rows(make_synthetic(s))])  # noqa: E731
    assert sink(base.with_(sink_strength=10)) > sink(base.with_(sink_strength=2))
    local = lambda s: np.mean([a[-4:].sum() for a in _rows(make_synthetic(s))])  # noqa: E731
    assert local(base.with_(local_strength=8)) > local(base.with_(local_strength=1))


def test_key_outlier_channels():
    t = make_synthetic(SyntheticSpec(outlier_channels=4, outlier_scale=12))
    channel_mag = np.abs(t.k).mean(axis=(0, 1, 2))
    assert np.sort(channel_mag)[-4:].min() > 5 * np.median(channel_mag)


def test_seed_reproducible_and_varies():
    a, b = make_synthetic(SyntheticSpec(seed=1)), make_synthetic(SyntheticSpec(seed=1))
    assert np.array_equal(a.k, b.k) and np.array_equal(a.q, b.q)
    assert not np.array_equal(a.k, make_synthetic(SyntheticSpec(seed=2)).k)


def test_long_context_single_query_is_cheap():
    """32k positions: making the trace and one query's attention row take memory in proportion to the
    positions (a few times the trace's own q, k, v; about 96 MB and 29 MB measured, 25 MB of arrays),
    never a positions x positions matrix (4.3 GB in float32 here). Memory, not time: no timing asserts."""
    tracemalloc.start()
    try:
        t = make_synthetic(SyntheticSpec(context=32768, steps=1, layers=1, q_heads=1, kv_heads=1))
        _, peak_make = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        row = softmax(logit_row(t, 0, 0, t.later_queries[0]))
        _, peak_row = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert t.n_positions == 32769 and row.shape == (32769,) and abs(row.sum() - 1) < 1e-9
    own = t.q.nbytes + t.k.nbytes + t.v.nbytes
    square = t.n_positions**2 * 4
    assert peak_make < 8 * own < square / 20
    assert peak_row < 4 * own


@pytest.mark.parametrize(
    "bad",
    [
        dict(context=4),
        dict(context=40000),
        dict(q_heads=3, kv_heads=2),
        dict(head_dim=8),
        dict(sparsity=-1),
        dict(steps=-1),
    ],
)
def test_bad_knobs(bad):
    with pytest.raises(SpecError):
        SyntheticSpec(**bad)
