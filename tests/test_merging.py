"""Merging evicted values into kept tokens (Spec.merge, kvviz.policies.merging; kvpress's MergingPress).

The fold on hand-made vectors, where the formula gives the numbers; then what merging may and may not change:
the kept tokens, the attention weights and the bytes stay those of dropping, only the outputs move; nothing
moves without eviction. The real-model cache holds the fold of its own prompt values, deleting equals masking,
and the decoded logits change. (The agreement with kvpress's own MergingPress is in test_kvpress_reference.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from kvviz import Spec, SpecError, View, compare
from kvviz.policies import select
from kvviz.policies.merging import EPS, fold_evicted, merged_values
from kvviz.sources.handbook import handbook_trace


def test_an_evicted_value_folds_into_its_nearest_kept_token_by_the_formula():
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, -3.0]], np.float32)
    values = np.array([[6.0, 8.0], [1.0, 1.0], [3.0, 4.0], [5.0, 5.0]], np.float32)
    kept = np.array([True, True, False, False])
    out = fold_evicted(keys, values, kept)
    # token 2 points as token 0 does (cos 1): w = 1 * |v2| / (|v2| + |v0|) = 5 / 15
    w = 5.0 / (5.0 + 10.0 + EPS)
    np.testing.assert_allclose(out[0], (values[0] + w * values[2]) / (1 + w), rtol=1e-6)
    # token 3's best match (token 1) points the other way: similarity -1, weight 0, token 1 unchanged
    np.testing.assert_array_equal(out[1], values[1])
    np.testing.assert_array_equal(out[2:], values[2:])  # evicted rows are left as they were


def test_several_evicted_tokens_into_one_and_nothing_to_fold():
    keys = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    values = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 4.0]], np.float32)
    out = fold_evicted(keys, values, np.array([True, False, False]))
    w1, w2 = 2.0 / (2.0 + 2.0 + EPS), 4.0 / (4.0 + 2.0 + EPS)  # both against the target's own norm
    want = (values[0] + w1 * values[1] + w2 * values[2]) / (1 + w1 + w2)
    np.testing.assert_allclose(out[0], want, rtol=1e-6)
    for kept in (np.ones(3, bool), np.zeros(3, bool)):  # nothing evicted / nothing kept: unchanged
        np.testing.assert_array_equal(fold_evicted(keys, values, kept), values)


def test_a_layer_merges_each_head_before_the_compression_point_only():
    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(2, 10, 4)), rng.normal(size=(2, 10, 4))
    kept = rng.random((2, 6)) < 0.5
    out = merged_values(keys, values, kept)
    np.testing.assert_array_equal(out[:, 6:], values[:, 6:])  # arrivals after the point: as they come
    for g in range(2):
        np.testing.assert_array_equal(out[g, :6], fold_evicted(keys[g, :6], values[g, :6], kept[g]))


@pytest.fixture(scope="module")
def handbook():
    return handbook_trace()


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "expected_attention", "threshold"])
def test_merging_moves_the_outputs_only(handbook, scorer):
    """Same kept tokens, same attention weights, same bytes as dropping them; another output."""
    settings = dict(sink=2, recent=6, heavy=8, scorer=scorer)
    drop = compare(handbook, Spec(**settings), View())
    merge = compare(handbook, Spec(**settings, merge=True), View())
    for a, b in zip(drop.members, merge.members):
        np.testing.assert_array_equal(a.kept, b.kept)
        np.testing.assert_array_equal(a.compressed, b.compressed)
        np.testing.assert_array_equal(a.out_original, b.out_original)
    assert drop.metrics["kv_bytes"] == merge.metrics["kv_bytes"]
    assert drop.metrics["tv_distance"] == merge.metrics["tv_distance"]
    assert merge.metrics["output_rel_error"] != drop.metrics["output_rel_error"]


def test_merging_without_eviction_changes_nothing(handbook):
    plain = compare(handbook, Spec(merge=True), View())
    assert plain.metrics["output_rel_error"] == 0.0
    wide = compare(handbook, Spec(sink=60, recent=4, scorer="snapkv", merge=True), View())  # the budget holds it all
    assert wide.metrics["output_rel_error"] == pytest.approx(0.0, abs=1e-12)


def test_merging_then_quantizing_quantizes_the_merged_values(handbook):
    """Merge first, then store the kept values in 4 bits: not the same as quantizing the dropped cache."""
    settings = dict(sink=2, recent=6, heavy=8, scorer="snapkv", value_bits=4, group_size=8)
    drop = compare(handbook, Spec(**settings), View())
    merge = compare(handbook, Spec(**settings, merge=True), View())
    assert merge.metrics["output_rel_error"] != drop.metrics["output_rel_error"]
    assert merge.metrics["kv_bytes"] == drop.metrics["kv_bytes"]


@pytest.mark.parametrize(
    "settings, says",
    [
        (dict(scorer="h2o"), "every decode step"),
        (dict(scorer="oracle"), "from each query"),
        (dict(scorer="snapkv", compress_every=8), "compress every to 0"),
    ],
)
def test_merging_needs_one_compression_point(settings, says):
    with pytest.raises(SpecError, match=says):
        Spec(sink=2, recent=4, heavy=4, merge=True, **settings)
    Spec(sink=2, recent=4, heavy=4, **settings)  # the same without merging is fine


def test_the_label_says_so():
    assert Spec(sink=2, recent=4, heavy=4, scorer="knorm", merge=True).label().endswith("evicted values merged")
    assert "merged" not in Spec(sink=2, recent=4, heavy=4, scorer="knorm").label()


# --- the real-model cache ---------------------------------------------------------------------


def test_the_decode_cache_holds_the_fold_of_its_prompt_values(tiny):
    torch = pytest.importorskip("torch")
    from kvviz.decode.loop import decode

    model, ids = tiny
    settings = dict(sink=2, recent=5, heavy=7, scorer="snapkv")
    n, steps = 24, 12
    drop_logits, _, drop = decode(model, ids[:n], Spec(**settings), steps, feed=ids[n : n + steps])
    merge_logits, _, merged = decode(model, ids[:n], Spec(**settings, merge=True), steps, feed=ids[n : n + steps])
    masked, _, _ = decode(model, ids[:n], Spec(**settings, merge=True), steps, feed=ids[n : n + steps], mode="mask")
    spec = Spec(**settings)
    for layer in range(drop.L):
        np.testing.assert_array_equal(drop.kept[layer], merged.kept[layer])  # the same tokens kept
        np.testing.assert_array_equal(drop.k[layer, :, :n].numpy(), merged.k[layer, :, :n].numpy())  # prompt keys
        at_point = select(drop.scores[layer, :, :n], spec)  # (kv_heads, n): the compression point's kept set
        want = merged_values(drop.k[layer, :, :n].numpy(), drop.v[layer, :, :n].numpy(), at_point)
        np.testing.assert_allclose(merged.v[layer, :, :n].numpy(), want, rtol=1e-6, atol=1e-7)
        assert not np.array_equal(want, drop.v[layer, :, :n].numpy())
    assert torch.allclose(merge_logits, masked, atol=1e-4)  # deleting equals masking, merged too
    assert (merge_logits - drop_logits).abs().max() > 1e-4  # the outputs really moved


def test_a_sweep_merges_where_the_method_takes_it():
    """The Trade-offs sweep from a base that merges: the one-shot methods merge, H2O (which cannot) drops."""
    from kvviz.analysis.sweep import point_spec

    base = Spec(sink=2, recent=4, heavy=4, scorer="snapkv", merge=True)
    assert point_spec("knorm", 16, 16, base=base).merge
    assert not point_spec("h2o", 16, 16, base=base).merge
    assert point_spec("full", 16, 16, base=base).label() == "no compression"


def test_sweep_methods_name_merging_beside_each_scorer():
    from kvviz.decode.eval_sweep import SWEEP_METHODS

    assert SWEEP_METHODS["merge-snapkv"](32) == SWEEP_METHODS["snapkv"](32).with_(merge=True)
    assert "merge-h2o" not in SWEEP_METHODS and "merge-oracle" not in SWEEP_METHODS
