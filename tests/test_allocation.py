"""Budget allocation over heads and layers (AdaKV, PyramidKV) and the budget ledger (issue #12)."""

import csv
import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvviz import Spec, SpecError, View, compare, memory_for
from kvviz.analysis.ledger import budget_ledger
from kvviz.policies.allocation import adakv_heavy, pyramid_budgets

from test_policies_new import random_trace


def layer_mass(trace, spec, layer):
    """Attention mass kept, summed over the query heads of a layer."""
    c = compare(trace, spec, View(layer=layer, ensemble="heads", ensemble_size=trace.n_q_heads))
    return sum(r.metrics.mass_retained for r in c.members), c


@given(seed=st.integers(0, 100_000), alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]), sink=st.integers(0, 3),
       recent=st.integers(1, 6), temp=st.floats(0.5, 4.0))
def test_adakv_over_the_oracle_keeps_at_least_the_uniform_mass_at_every_budget(seed, alpha, sink, recent, temp):
    trace = random_trace(seed, L=1, c=24, steps=2, D=8)
    trace.q[...] *= np.float32(temp)                                 # sharper or flatter attention
    n = trace.n_positions
    for heavy in range(0, n - sink - recent + 1):
        base = dict(sink=sink, recent=recent, heavy=heavy, scorer="oracle")
        uni, _ = layer_mass(trace, Spec(**base), 0)
        ada, c = layer_mass(trace, Spec(**base, allocation="adakv", adakv_alpha=alpha), 0)
        assert ada >= uni - 1e-9, (heavy, ada, uni)
        kept = {r.kv_head: int(r.kept.sum()) for r in c.members}
        assert sum(kept.values()) == trace.n_kv_heads * min(sink + recent + heavy, n)   # the layer's budget
        # the safeguard (kvpress): each head's top int(alpha * budget) tokens, sinks and window first
        floor = min(max(0, int(min(sink + recent + heavy, n) * alpha) - (sink + recent)), n - sink - recent, heavy)
        assert min(kept.values()) >= sink + recent + floor


@given(heavy=st.integers(0, 500), layers=st.integers(1, 64), beta=st.floats(1.0, 100.0))
def test_pyramid_budgets_sum_to_the_uniform_total_and_fall_from_the_bottom(heavy, layers, beta):
    b = pyramid_budgets(heavy, layers, beta)
    assert len(b) == layers and b.sum() == layers * heavy
    assert np.all(np.diff(b) <= 0) and b.min() >= 0
    if beta == 1.0:
        assert np.all(b == heavy)


def test_pyramid_matches_the_kvpress_linear_rule():
    """kvpress PyramidKVPress: min = A / beta, max = 2A - min, linear over layers."""
    b = pyramid_budgets(100, 5, 20.0)
    want = np.array([195, 147.5, 100, 52.5, 5])
    assert np.all(np.abs(b - want) <= 1) and b.sum() == 500


def test_adakv_safeguard_and_cross_head_top():
    spec = Spec(sink=0, recent=1, heavy=4, scorer="knorm", allocation="adakv", adakv_alpha=0.5)
    scores = np.array([[9, 8, 7, 6, 5, 4, 3, 2, 0.0],
                       [1, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.0]])
    # kvpress: the safeguard is each head's top int(0.5 * 5) = 2 of all its tokens, the window (1) first:
    # 1 heavy hitter each, then the 6 best left are head 0's
    assert adakv_heavy(scores, spec).tolist() == [7, 1]
    old = spec.with_(adakv_floor="outside-window")                  # kvviz before #24: 2 heavy each on top
    assert adakv_heavy(scores, old).tolist() == [6, 2]


def test_ragged_caches_in_the_engine_and_memory():
    trace = random_trace(7)
    spec = Spec(sink=2, recent=4, heavy=10, scorer="snapkv", allocation="adakv")
    c = compare(trace, spec, View(layer=1, ensemble="heads", ensemble_size=4))
    counts = {r.kv_head: int(r.kept.sum()) for r in c.members}
    assert sum(counts.values()) == 2 * 16
    for r in c.members:
        assert r.compressed.sum() == pytest.approx(1.0, abs=1e-12)
        assert np.all(r.compressed[~r.kept] == 0)
    pyr = memory_for(trace, Spec(sink=2, recent=4, heavy=10, allocation="pyramid", pyramid_schedule="heavy"),
                     trace.n_positions)
    uni = memory_for(trace, Spec(sink=2, recent=4, heavy=10), trace.n_positions)
    assert pyr.kv_bytes == uni.kv_bytes and sum(pyr.kept_per_layer) == sum(uni.kept_per_layer)
    assert pyr.kept_per_layer[0] > pyr.kept_per_layer[1]


def test_streaming_scorers_refuse_adakv_but_take_the_pyramid():
    with pytest.raises(SpecError, match="AdaKV"):
        Spec(sink=2, recent=4, heavy=8, scorer="h2o", allocation="adakv")
    trace = random_trace(8)
    c = compare(trace, Spec(sink=2, recent=4, heavy=8, scorer="h2o", allocation="pyramid", pyramid_beta=4,
                            pyramid_schedule="heavy"), View(layer=1))
    assert c.primary.kept.sum() == 2 + 4 + pyramid_budgets(8, 2, 4)[1]


@pytest.mark.parametrize("scorer,allocation", [("snapkv", "uniform"), ("snapkv", "adakv"), ("snapkv", "pyramid"),
                                               ("oracle", "adakv"), ("h2o", "pyramid"), ("quest", "uniform"),
                                               ("expected_attention", "adakv"), ("chunkkv", "pyramid")])
def test_ledger_kept_tokens_equal_the_declared_budget_per_layer(scorer, allocation):
    trace = random_trace(9, L=3)
    spec = Spec(sink=2, recent=4, heavy=12, scorer=scorer, allocation=allocation, key_bits=4, value_bits=4,
                group_size=8, residual=3, page_size=4, chunk_rule="budget",     # (kvpress's chunks: below;
                quest_heads="kv")                                                 # Quest per query head: below)
    ledger = budget_ledger(trace, spec)
    np.testing.assert_array_equal(ledger.per_layer("kept_tokens"), ledger.per_layer("declared_tokens"))
    kept = ledger.column("kept_tokens")
    np.testing.assert_array_equal(kept, ledger.column("sink") + ledger.column("recent") + ledger.column("heavy"))
    assert ledger.column("overhead_bytes").sum() > 0 and ledger.column("residual_bytes").sum() > 0
    t = ledger.totals
    if scorer == "quest":
        assert t["stored_bytes"] > t["read_bytes"] and t["page_meta_bytes"] > 0
    else:
        assert t["stored_bytes"] == t["read_bytes"]
        if allocation != "adakv":   # the engine's memory counts the same bytes
            assert t["stored_bytes"] == pytest.approx(memory_for(trace, spec, ledger.n_tokens).kv_bytes)
    assert any("overhead" in n for n in ledger.notes())


def test_pyramid_rounding_is_kvpress_rounding_where_that_sums_exactly():
    assert pyramid_budgets(16, 2, 20.0).tolist() == [31, 1]          # kvpress: round(31.2), round(0.8)


def test_ledger_on_the_cli(capsys):
    from kvviz.cli import main
    assert main(["ledger", "--sink", "4", "--recent", "8", "--heavy", "8", "--scorer", "snapkv", "--allocation",
                 "adakv", "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    from kvviz.sources.handbook import handbook_trace
    ledger = budget_ledger(handbook_trace(), Spec(sink=4, recent=8, heavy=8, scorer="snapkv", allocation="adakv"))
    for column in ("kept_tokens", "stored_bytes", "read_bytes"):       # every row is the core's ledger row
        assert [float(r[column]) for r in rows] == [float(v) for v in ledger.column(column)], column
    assert main(["ledger", "--sink", "4", "--recent", "8", "--heavy", "8", "--bits", "4"]) == 0
    assert "scale / zero-point overhead" in capsys.readouterr().out


def test_sweep_under_adakv_leaves_out_the_methods_it_cannot_wrap():
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
    from kvviz.analysis.sweep import sweep

    t = make_synthetic(SyntheticSpec(context=64, steps=2))
    rows = sweep(t, ["h2o", "snapkv", "oracle"], [0.25], [16], View(ensemble="heads"),
                 Spec(scorer="oracle", allocation="adakv"))
    assert sorted(r["method"] for r in rows) == ["oracle", "snapkv"]


def test_pyramid_totals_are_kvpress_get_layer_budget():
    """kvpress PyramidKVPress on 261 tokens at ratio 0.5 (n(1 - ratio) = 130.5 = kvviz budget 130 + 1/2):
    max 2A - A/20 = 254.5 is clamped at 261 - 64 = 197, min = 2A - 197 = 64, round(197 - l * 133 / 29)."""
    from kvviz.policies.allocation import pyramid_totals
    got = pyramid_totals(130, 64, 261, 30, 20.0)
    assert got.tolist() == [round(197 - layer * 133 / 29) for layer in range(30)]
    assert got[0] == 197 and got[-1] == 64
    assert pyramid_totals(130, 64, 1000, 30, 20.0) is None           # min 6.5 < the window: kvpress falls back
    spec = Spec(sink=0, recent=64, heavy=66, scorer="snapkv", allocation="pyramid")
    from kvviz.policies.allocation import layer_spec
    assert [layer_spec(spec, layer, 30, 261).budget for layer in (0, 29)] == [197, 64]
    assert layer_spec(spec, 3, 30, 1000).budget == 130                  # the uniform budget


def test_ledger_says_chunkkv_holds_fewer_tokens_than_declared():
    """At the compression point (no later queries): int(10 chunks * 18.5 / 48) = 3 whole chunks of 5."""
    trace = random_trace(9, L=3, steps=0)
    spec = Spec(sink=2, recent=4, heavy=12, scorer="chunkkv", chunk_size=5)
    ledger = budget_ledger(trace, spec)
    assert ledger.column("declared_tokens").tolist() == [18] * 6
    kept = ledger.column("kept_tokens")
    assert set(kept.tolist()) <= {15, 13}                             # 3 chunks; the last chunk has 3 tokens
    assert any("whole chunks" in note for note in ledger.notes())
    result = compare(trace, spec, View(layer=2))
    assert result.memory.kv_bytes == pytest.approx(ledger.totals["stored_bytes"], rel=1e-12)


def test_quest_per_query_head_reads_its_own_pages_and_the_ledger_counts_the_union():
    """Quest as the paper: each query head's own top pages; a KV head serves (and the ledger counts as
    read) the union of its group's pages, at least the budget and at most group x budget."""
    from kvviz.engine import kept_at_query
    trace = random_trace(11, L=2, Hq=4, Hkv=2, c=64, steps=3)
    spec = Spec(sink=2, recent=6, heavy=8, scorer="quest", page_size=4)
    result = compare(trace, spec, View(layer=1, ensemble="heads"))
    reads = {r.head: r.kept for r in result.members}
    assert all(int(m.sum()) == spec.budget for m in reads.values())           # each head reads its budget
    qi = int(trace.evaluated_queries[-1])
    served = kept_at_query(trace, spec, 1, qi)
    for g in range(2):
        assert np.array_equal(served[g], reads[2 * g] | reads[2 * g + 1])
    assert any(not np.array_equal(reads[2 * g], reads[2 * g + 1]) for g in range(2))   # heads choose apart
    ledger = budget_ledger(trace, spec)
    kept = ledger.column("kept_tokens")
    assert (kept >= spec.budget).all() and (kept <= 2 * spec.budget).all() and (kept > spec.budget).any()
    assert result.memory.bytes_read == pytest.approx(ledger.totals["read_bytes"], rel=1e-12)
    per_kv = compare(trace, spec.with_(quest_heads="kv"), View(layer=1, ensemble="heads"))
    assert all(int(r.kept.sum()) == spec.budget for r in per_kv.members)
