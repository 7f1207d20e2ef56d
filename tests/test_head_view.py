"""Scoring only the KV heads a view reads (kvviz.heads.view_masks: the Explorer on a big trace):
the same kept sets and the same numbers, bit for bit, as scoring every head and taking those."""

import numpy as np
import pytest

import kvviz.attention as attention
import kvviz.heads as heads
from kvviz.engine import compare
from kvviz.heads import head_separable, head_trace, view_masks
from kvviz.rows import keep_masks
from kvviz.sources.tracefile import load_trace, save_trace
from kvviz.spec import Spec, SpecError, View, scorer_names

from trace_util import every_query_trace


def gqa_trace(seed=0, L=2, Hq=8, Hkv=4, D=16, c=90, steps=6):
    rng = np.random.default_rng(seed)
    P = c + steps
    q = rng.standard_normal((L, Hq, P, D)).astype(np.float32)
    k = rng.standard_normal((L, Hkv, P, D)).astype(np.float32)
    k[..., 3] += 2.0 * rng.standard_normal((L, Hkv, 1))
    v = rng.standard_normal((L, Hkv, P, D)).astype(np.float32)
    meta = {
        "source": "test",
        "rope_inv_freq": (1.0 / 100.0 ** (np.arange(0, D, 2) / D)).tolist(),
        "kvzip_scores": rng.random((L, Hkv, c)).tolist(),
    }  # as a model's reconstruction pass gives
    return every_query_trace(q, k, v, c, meta)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # chunks of a few rows: every head's pass and one KV group's would chunk differently without full_q_heads
    monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * 8 * 96 * 7)
    heads._HEAD_TRACES.clear()


def specs():
    for scorer in scorer_names():
        for allocation in ("uniform", "pyramid", "adakv"):
            try:
                yield Spec(scorer=scorer, sink=2, recent=6, heavy=9, allocation=allocation)
            except SpecError:  # AdaKV with a streaming scorer
                pass
    yield Spec(scorer="h2o", sink=2, recent=6, heavy=9, h2o_normalized=True)
    yield Spec(scorer="h2o", sink=2, recent=6, heavy=9, key_bits=4, value_bits=4)


@pytest.mark.parametrize("spec", list(specs()), ids=lambda s: f"{s.scorer}-{s.allocation}")
def test_masks_of_some_heads_equal_every_heads(spec):
    t = gqa_trace()
    positions = [60, 89, 92, 95]
    full = keep_masks(t, spec, 1, positions)
    for kv in ([1], [0, 3], [2, 3]):
        part = view_masks(t, spec, 1, positions, kv)
        if full is None:
            assert part is None
            continue
        np.testing.assert_array_equal(part[:, kv], full[:, kv])


@pytest.mark.parametrize("spec", list(specs()), ids=lambda s: f"{s.scorer}-{s.allocation}")
def test_compare_equals_scoring_every_head(spec, monkeypatch):
    t = gqa_trace(seed=1)
    view = View(layer=1, head=3, ensemble="heads", ensemble_size=3)  # query heads 3-5: KV heads 1 and 2
    fast = compare(t, spec, view)
    monkeypatch.setattr(heads, "head_separable", lambda trace, spec, layer: False)  # every head scored
    slow = compare(t, spec, view)
    for a, b in zip(fast.members, slow.members, strict=True):
        np.testing.assert_array_equal(a.kept, b.kept)
        np.testing.assert_array_equal(a.reason, b.reason)
        np.testing.assert_array_equal(a.compressed, b.compressed)
        np.testing.assert_array_equal(a.error, b.error)
    assert fast.metrics == slow.metrics and fast.metrics_mean == slow.metrics_mean


def test_h2o_scores_only_the_group_it_shows(monkeypatch):
    t = gqa_trace()
    seen = []
    real = attention.context_rows

    def spy(trace, layer, heads, *a, **kw):
        seen.append(len(heads))
        return real(trace, layer, heads, *a, **kw)

    monkeypatch.setattr(attention, "context_rows", spy)
    spec = Spec(scorer="h2o", sink=2, recent=6, heavy=9)
    assert head_separable(t, spec, 0)
    compare(t, spec, View(layer=0, head=2))  # one query head: its KV head's group of 2
    assert seen and set(seen) == {2}
    seen.clear()
    compare(t, spec.with_(heavy=10), View(layer=0, head=2))  # a slider move: the scores are cached
    assert seen == []


def test_lazy_trace_reads_one_layer(tmp_path):
    t = gqa_trace(seed=2)
    save_trace(t, tmp_path / "t.safetensors")
    lazy = load_trace(tmp_path / "t.safetensors")
    spec = Spec(scorer="h2o", sink=2, recent=6, heavy=9)
    sub = head_trace(lazy, 1, [2])
    assert sub.n_q_heads == 2 and sub.n_kv_heads == 1 and sub.n_layers == 2
    np.testing.assert_array_equal(sub.k[1], t.k[1][[2]])
    np.testing.assert_array_equal(view_masks(lazy, spec, 1, [95], [2])[:, 2], keep_masks(t, spec, 1, [95])[:, 2])


def test_not_separable():
    t = gqa_trace()
    for spec in (
        Spec(scorer="tova"),
        Spec(scorer="random"),
        Spec(scorer="snapkv", allocation="adakv"),
        Spec(scorer="snapkv", compress_every=4),
    ):
        assert not head_separable(t, spec, 0)


def test_a_groups_rows_are_chunked_as_every_heads():
    # the same chunks, so the same products and sums, whatever the processor's BLAS does with their shapes
    t = gqa_trace()
    rows = t.context_queries
    every = [idx.tolist() for idx, _ in attention.context_rows(t, 1, np.arange(8), rows, t.context_len, trim=True)]
    sub = head_trace(t, 1, [3])
    group = [idx.tolist() for idx, a in attention.context_rows(sub, 1, np.arange(2), rows, t.context_len, trim=True)]
    assert len(every) > 3 and group == every
