"""Engine properties: no compression -> zero error, budgets, renormalisation, streaming H2O, ensembles."""

import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvviz import SCORERS, Spec, SpecError, View, compare, keep_masks
from kvviz.engine import REASONS
from kvviz.policies.registry import POLICIES
from kvviz.quant.rotation import rotate, unrotate
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from synthetic_util import small_synthetic
from floatbounds import logit_error_bound, softmax_rtol
from test_quant import _reference as reference_quantize  # docs/definitions.md's formulas, a group at a time

SMALL = small_synthetic(context=96, steps=12, layers=2, head_dim=48)
# Comparison.to_json's fields, every one (`kvviz compare --json` prints them and the metric definitions)
TO_JSON_KEYS = (
    "source",
    "spec",
    "layer",
    "layer_number",
    "layer_kind",
    "layer_window",
    "head",
    "kv_head",
    "position",
    "ensemble",
    "ensemble_members",
    "tokens",
    "original",
    "compressed",
    "kept",
    "reason",
    "error",
    "error_mean",
    "error_std_sample",
    "error_ci95_lo",
    "error_ci95_hi",
    "error_min",
    "error_max",
    "metrics",
    "metrics_mean",
    "notes",
)


@pytest.fixture(scope="module")
def trace():
    return make_synthetic(SMALL)


def test_no_compression_is_exact(trace):
    for ens in (None, "heads", "steps"):
        c = compare(trace, Spec(), View(layer=1, head=2, ensemble=ens))
        assert np.all(c.primary.error == 0)
        assert np.all(c.spread.mean == 0) and np.all(c.spread.std == 0)
        assert c.metrics["tv_distance"] == 0 and c.metrics["kl"] == pytest.approx(0, abs=1e-12)
        assert c.metrics["output_rel_error"] == 0


@given(
    sink=st.integers(0, 10),
    recent=st.integers(0, 40),
    heavy=st.integers(0, 120),
    scorer=st.sampled_from(SCORERS),
    head=st.integers(0, 3),
    step=st.integers(0, 11),
)
@example(sink=0, recent=36, heavy=0, scorer="chunkkv", head=0, step=0)  # a layer keeps more whole chunks than the mean
def test_budget_and_renormalisation(trace, sink, recent, heavy, scorer, head, step):
    ragged = POLICIES[scorer].ragged  # threshold, DuoAttention, KVzip: sinks and window hold a token at least
    if POLICIES[scorer].reconstructs:  # KVzip's scores come from the model's own pass: a synthetic trace has none
        with pytest.raises(SpecError, match="forward pass of the model"):
            compare(trace, Spec(sink=max(sink, 1), recent=recent, heavy=heavy, scorer=scorer), View(head=head))
        return
    snapkv_votes = scorer in ("snapkv", "chunkkv", "threshold")  # chunkkv, threshold: SnapKV's votes inside
    if (snapkv_votes or (ragged and sink == 0)) and recent == 0 and sink + heavy > 0:
        with pytest.raises(SpecError, match="recent window"):  # SnapKV's observation window lives there
            Spec(sink=sink, recent=recent, heavy=heavy, scorer=scorer)
        return
    spec = Spec(sink=sink, recent=recent, heavy=heavy, scorer=scorer)
    c = compare(trace, spec, View(head=head, step=step))
    row = c.primary
    n = row.position + 1
    assert np.all(row.compressed[~row.kept] == 0)
    assert row.compressed.sum() == pytest.approx(1.0, abs=1e-12)
    if ragged and spec.evicts:  # its own count: sinks and window at least, the memory card counts what it holds
        assert np.all(row.kept[: min(sink, n)]) and np.all(row.kept[n - min(recent, n) :])
        assert row.kept.sum() >= min(sink + recent, n)
        return
    if scorer == "chunkkv" and spec.evicts:  # kvpress's whole chunks: their own count, no separate sinks / window
        # each layer keeps its own number of whole chunks (the card's mean can differ from this row's layer)
        assert row.kept.sum() == c.memory.kept_per_layer[row.layer]
        return
    expected = min(spec.budget, n) if spec.evicts else n
    assert row.kept.sum() == expected
    assert np.all(row.kept[: min(sink, n)])
    if recent:
        assert np.all(row.kept[n - min(recent, n) :])
    if spec.evicts:  # Quest reads the budget but stores every token
        assert c.memory.kept_tokens == (n if scorer == "quest" else expected)


def test_evicted_mass_is_the_error(trace):
    """Without quantization, kept tokens scale up by 1/mass_retained."""
    row = compare(trace, Spec(sink=4, recent=8, heavy=8)).primary
    m = row.original[row.kept].sum()
    np.testing.assert_allclose(row.compressed[row.kept], row.original[row.kept] / m, atol=1e-12)


def test_more_budget_more_mass(trace):
    masses = [
        compare(trace, Spec(sink=4, recent=b, heavy=b), View(ensemble="heads")).metrics_mean["mass_retained"]
        for b in (2, 8, 24, 48)
    ]
    assert all(a < b for a, b in zip(masses, masses[1:]))


def test_more_bits_less_error(trace):
    errs = [
        compare(trace, Spec(key_bits=b, value_bits=b), View(ensemble="heads")).metrics_mean["tv_distance"]
        for b in (2, 3, 4, 8)
    ]
    assert all(a > b for a, b in zip(errs, errs[1:]))


def test_streaming_h2o_never_readmits(trace):
    spec = Spec(sink=2, recent=4, heavy=10, scorer="h2o")
    positions = trace.query_positions[trace.later_queries]
    masks = keep_masks(trace, spec, 0, positions)  # (steps, kv_heads, positions)
    for t in range(1, len(positions)):
        before, after = masks[t - 1], masks[t]
        readmitted = after & ~before
        readmitted[:, positions[t]] = False  # the new token arrives
        assert not readmitted.any()
        assert (after.sum(axis=1) == spec.budget).all()


def _group_mass(c, group_size):
    """Attention mass each KV head's cache keeps, summed over the query heads reading it."""
    mass = {}
    for r in c.members:
        mass[r.head // group_size] = mass.get(r.head // group_size, 0.0) + r.metrics.mass_retained
    return mass


@pytest.mark.parametrize("step", [0, 5, 11])
def test_oracle_is_the_bound_for_every_kv_cache(trace, step):
    """One cache per KV head: no policy keeps more of a GQA group's attention mass."""
    view = View(layer=1, step=step, ensemble="heads")
    best = _group_mass(compare(trace, Spec(sink=4, recent=8, heavy=16, scorer="oracle"), view), trace.group_size)
    for scorer in [s for s in SCORERS if not POLICIES[s].ragged]:  # a ragged policy keeps its own count (KVzip too)
        got = _group_mass(compare(trace, Spec(sink=4, recent=8, heavy=16, scorer=scorer), view), trace.group_size)
        assert all(got[g] <= best[g] + 1e-12 for g in best), scorer


def test_oracle_keeps_one_cache_per_kv_head(trace):
    """Heads sharing a KV head keep the same tokens, and a one-head view decides as the
    whole group would (it reads the group's attention, not only its own)."""
    spec = Spec(sink=2, recent=4, heavy=6, scorer="oracle")
    g = trace.group_size
    rows = {r.head: r for r in compare(trace, spec, View(layer=1, head=1, ensemble="heads")).members}
    assert g > 1 and len(rows) == trace.n_q_heads
    for h, r in rows.items():
        np.testing.assert_array_equal(r.kept, rows[h // g * g].kept)
        single = compare(trace, spec, View(layer=1, head=h)).primary
        np.testing.assert_array_equal(single.kept, r.kept)
        np.testing.assert_allclose(single.compressed, r.compressed, rtol=1e-5, atol=1e-9)  # fp32 logits
    group = np.stack([rows[h].original for h in range(g)]).sum(axis=0)
    heavy = np.flatnonzero(rows[0].kept[2:-4]) + 2
    outside = np.setdiff1d(np.arange(2, len(group) - 4), heavy)
    assert group[heavy].min() >= group[outside].max()  # the top of the group's attention


def test_topic_shift_hurts_history_based_eviction():
    t = make_synthetic(SyntheticSpec(context=256, steps=32, topic_shift=10.0, shift_at=0.25))
    spec = dict(sink=4, recent=16, heavy=24)
    view = View(ensemble="steps", ensemble_size=16)
    h2o = compare(t, Spec(scorer="h2o", **spec), view).metrics_mean["mass_retained"]
    oracle = compare(t, Spec(scorer="oracle", **spec), view).metrics_mean["mass_retained"]
    assert oracle - h2o > 0.2, "late anchors were never attended in the context, so H2O dropped them"


def test_gqa_decisions_are_per_kv_head(trace):
    masks = keep_masks(trace, Spec(sink=1, recent=2, heavy=6, scorer="h2o"), 0, [trace.n_positions - 1])
    assert masks.shape == (1, trace.n_kv_heads, trace.n_positions)
    shared = keep_masks(trace, Spec(sink=1, recent=2, heavy=6, scorer="tova"), 0, [trace.n_positions - 1])
    assert (shared[0, 0] == shared[0, 1]).all()


def test_ensembles_give_error_bars(trace):
    spec = Spec(sink=4, recent=8, heavy=8, key_bits=2, value_bits=2)
    for ens, size in (("heads", 4), ("layers", 2), ("steps", 5), ("seeds", 3)):
        c = compare(trace, spec, View(ensemble=ens, ensemble_size=size))
        assert len(c.members) == size
        n = len(c.primary.error)
        errors = np.full((size, n), np.nan)  # an earlier step does not see the newest tokens
        for i, m in enumerate(c.members):
            errors[i, : min(n, len(m.error))] = m.error[:n]
        np.testing.assert_allclose(c.spread.mean, np.nanmean(errors, axis=0), atol=1e-12)
        seen = (~np.isnan(errors)).sum(axis=0)
        with warnings.catch_warnings():  # columns with one member: nanstd warns, np.where drops them
            warnings.simplefilter("ignore", RuntimeWarning)
            sample_std = np.where(seen > 1, np.nanstd(errors, axis=0, ddof=1), 0.0)  # one member: no spread
        np.testing.assert_allclose(c.spread.std, sample_std, atol=1e-12)
        assert c.spread.std.max() > 0
        np.testing.assert_array_equal(c.spread.member_min, np.nanmin(errors, axis=0))
        np.testing.assert_array_equal(c.spread.member_max, np.nanmax(errors, axis=0))
        two = c.spread.n > 1  # one member: no interval (NaN)
        assert np.all(np.isnan(c.spread.ci_lo[~two]))
        assert np.all(c.spread.ci_lo[two] <= c.spread.mean[two] + 1e-12)
        assert np.all(c.spread.mean[two] <= c.spread.ci_hi[two] + 1e-12)


def test_seed_ensemble_of_noise_has_spread_and_deterministic_has_none():
    from kvviz.sources.handbook import handbook_trace

    t = handbook_trace()
    noisy = compare(t, Spec(quant_model="noise", noise_sigma=0.05), View(ensemble="seeds", ensemble_size=10))
    assert noisy.spread.std.max() > 0
    fixed = compare(t, Spec(key_bits=4, value_bits=4), View(ensemble="seeds", ensemble_size=10))
    assert np.all(fixed.spread.std == 0)


def test_bad_views_and_specs(trace):
    with pytest.raises(SpecError, match="head 9"):
        compare(trace, Spec(), View(head=9))
    with pytest.raises(SpecError, match="layer"):
        compare(trace, Spec(), View(layer=5))
    with pytest.raises(SpecError, match="step"):
        compare(trace, Spec(), View(step=100))
    for bad in (
        dict(sink=-1),
        dict(key_bits=0),
        dict(value_bits=9),
        dict(scorer="nope"),
        dict(symmetric=True, key_bits=1),
        dict(noise_sigma=float("nan")),
        dict(group_size=0),
    ):
        with pytest.raises(SpecError):
            Spec(**bad)


def test_memory_counts_gqa(trace):
    c = compare(trace, Spec(sink=4, recent=8, heavy=8))
    n = c.primary.position + 1
    per_token = 2 * 2 * trace.n_layers * trace.n_kv_heads * trace.head_dim
    assert c.memory.kv_bytes_full == n * per_token
    assert c.memory.kv_bytes == 20 * per_token


def test_score_cache_is_per_trace_and_ignores_budgets():
    from kvviz.policies import base

    a = make_synthetic(SMALL)
    b = make_synthetic(SMALL.with_(seed=5))
    spec = Spec(sink=2, recent=4, heavy=12, scorer="h2o")
    first_a = compare(a, spec).primary.kept.copy()
    first_b = compare(b, spec).primary.kept.copy()
    assert not np.array_equal(first_a, first_b)
    base._SCORE_CACHE.clear()
    assert np.array_equal(compare(b, spec).primary.kept, first_b)
    # budgets and bits change the kept set / error, never the cached scores
    wider = compare(a, spec.with_(heavy=30, key_bits=4)).primary
    base._SCORE_CACHE.clear()
    fresh = compare(a, spec.with_(heavy=30, key_bits=4)).primary
    assert np.array_equal(wider.kept, fresh.kept) and np.array_equal(wider.compressed, fresh.compressed)


def test_head_grid_matches_single_rows(trace):
    from kvviz.engine import head_grid

    spec = Spec(sink=2, recent=6, heavy=6, key_bits=3, value_bits=3)
    grid = head_grid(trace, spec, step=3)
    assert grid.shape == (trace.n_layers, trace.n_q_heads)
    for layer, head in ((0, 0), (1, 3)):
        one = compare(trace, spec, View(layer=layer, head=head, step=3)).metrics["tv_distance"]
        assert grid[layer, head] == pytest.approx(one, abs=1e-6)  # float32 logits, batched vs one row
    np.testing.assert_allclose(head_grid(trace, Spec(), metric="mass_retained"), 1, atol=1e-12)


@given(
    scores=st.lists(st.sampled_from([0.0, 1.0, 2.0, -np.inf, np.inf, 0.5]), min_size=1, max_size=40),
    sink=st.integers(0, 5),
    recent=st.integers(0, 8),
    heavy=st.integers(0, 40),
)
def test_select_is_top_k_with_earliest_ties(scores, sink, recent, heavy):
    """select == a stable sort: best scores first, the earlier token on ties."""
    from kvviz.policies import select

    s = np.array([scores])
    n = s.shape[1]
    got = select(s, Spec(sink=sink, recent=recent, heavy=heavy))[0]
    want = np.zeros(n, bool)
    want[:sink] = True
    want[max(0, n - recent) :] = True
    cand = [i for i in range(n) if not want[i]]
    for i in sorted(cand, key=lambda i: (-s[0, i], i))[:heavy]:
        want[i] = True
    assert np.array_equal(got, want)


@given(
    scores=st.lists(
        st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 0.5, -np.inf]), min_size=12, max_size=12), min_size=2, max_size=4
    ),
    sink=st.integers(0, 3),
    recent=st.integers(0, 4),
    heavy=st.integers(1, 8),
)
def test_select_row_by_row_is_each_rows_own_top_k(scores, sink, recent, heavy):
    """Several KV heads at once: each row's kept set is the stable top-k of that row alone (the cut, the
    ties, the count of tied tokens are per row), the same as selecting it on its own."""
    from kvviz.policies import select

    spec = Spec(sink=sink, recent=recent, heavy=heavy)
    s = np.array(scores)
    got = select(s, spec)
    for h in range(len(s)):
        want = np.zeros(s.shape[1], bool)
        want[:sink] = True
        want[max(0, s.shape[1] - recent) :] = True
        cand = [i for i in range(s.shape[1]) if not want[i]]
        for i in sorted(cand, key=lambda i: (-s[h, i], i))[:heavy]:
            want[i] = True
        assert np.array_equal(got[h], want), h


def test_select_on_a_long_context_keeps_exactly_the_top_scores():
    """2048 distinct scores, 512 heavy hitters and no sink or window: the kept set is exactly the 512
    highest (numpy's introselect on a long row is where a cut read at the wrong rank shows)."""
    from kvviz.policies import select

    scores = np.random.default_rng(2).permutation(2048).astype(np.float64)[None]
    kept = select(scores, Spec(sink=0, recent=0, heavy=512))[0]
    assert np.array_equal(kept, scores[0] >= 2048 - 512)


def test_evict_one_by_hand():
    """kept (H, m+1) -> (H, m): per head, the lowest score outside the first `sink` positions and the last
    `recent` (positions > p - recent) goes; on a tie the later token goes, for every policy (the token select
    would rank last); a token no query has scored (+inf) goes before any protected one."""
    from kvviz.policies.select import evict_one

    spec = Spec(sink=1, recent=2, heavy=3)
    kept = np.array([[0, 1, 2, 3, 4, 5], [0, 2, 3, 4, 5, 6], [0, 1, 2, 3, 5, 6]])
    scores = np.array(
        [
            [9, 1.0, 0.5, 1.0, 0.0, -5, 9],  # position 4 lowest (5 is recent: protected)
            [-9, 9, 2.0, 2.0, 9, -9, -9],  # 2 and 3 tie; 0 is a sink, 5 and 6 recent
            [-9, np.inf, np.inf, np.inf, 9, -9, -9],
        ]
    )  # unscored: the latest of them goes
    assert evict_one(kept, scores, spec, 6).tolist() == [[0, 1, 2, 3, 5], [0, 2, 4, 5, 6], [0, 1, 2, 5, 6]]
    tied = np.array([[0, 1, 2, 3, 4, 5]])  # every unprotected score equal: the last goes
    assert evict_one(tied, np.zeros((1, 6)), spec, 5).tolist() == [[0, 1, 2, 4, 5]]
    one = np.array([[0, 1, 2, 3]])  # sink 1: position 1 is not protected
    assert evict_one(one, np.array([[-1.0, 5.0, 6.0, 7.0]]), spec, 3).tolist() == [[0, 2, 3]]


def test_sweep_split_rule_keeps_a_recent_token_and_the_budget():
    from kvviz.analysis.sweep import split_budget

    for budget in range(1, 40):
        for scorer in ("h2o", "streaming", "snapkv"):
            s = split_budget(scorer, budget)
            assert s["sink"] + s["recent"] + s["heavy"] == budget and s["recent"] >= 1 and s["sink"] <= 4
            Spec(scorer=scorer, **s)  # every sweep point is a valid spec (SnapKV included)


# --- policies/base.py by hand and against plain references (mutation testing) ----------


def test_score_cache_hits_per_trace_and_keeps_the_32_most_recent():
    """cached_on_trace computes once per (trace, layer, name, key): a second ask is a hit, two traces
    asked in turn both stay cached, and the cache holds the 32 entries used last (least recently used
    goes first; the entry just stored stays)."""
    from kvviz.policies import base

    a, b = make_synthetic(SMALL), make_synthetic(SMALL.with_(seed=5))
    calls = []

    def ask(trace, key):
        return base.cached_on_trace(trace, 0, "test-cache", (key,), lambda: calls.append(key) or f"v{key}")

    base._SCORE_CACHE.clear()
    assert ask(a, 0) == "v0" and ask(b, 0) == "v0" and ask(a, 0) == "v0" and ask(b, 0) == "v0"
    assert calls == [0, 0]  # a and b once each, then hits
    base._SCORE_CACHE.clear()
    calls.clear()
    for key in range(32):
        ask(a, key)
    ask(a, 0)  # 32 entries fit: key 0 is a hit, now the newest
    assert calls == list(range(32))
    ask(a, 32)  # the 33rd pushes out the least recent: key 1
    ask(a, 32)
    ask(a, 0)
    assert calls == list(range(33))
    ask(a, 1)
    assert calls == list(range(33)) + [1]
    base._SCORE_CACHE.clear()


def test_cached_scores_are_float64_read_only_and_per_layer_and_policy():
    """scores_at_compression caches each (layer, policy) on its own: layer 0 and 1 of H2O and TOVA / KNorm
    on one layer each equal their definitions (accumulated context attention; the last context query's
    attention averaged over heads; minus the key norm), in float64 (KNorm's keys are float32), and the
    cached array cannot be written."""
    from kvviz.policies import POLICIES, ScoreContext, base

    t = make_synthetic(SMALL)
    c, g, P = t.context_len, t.group_size, t.n_positions
    base._SCORE_CACHE.clear()

    def attention(layer, h, r):  # causal softmax of query r over keys 0..c-1
        k = t.k[layer, h // g, : int(t.query_positions[r]) + 1].astype(np.float64)
        x = k @ t.q[layer, h, r].astype(np.float64) / np.sqrt(t.head_dim)
        a = np.zeros(c)
        a[: len(x)] = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        return a

    rows = [r for r in range(t.n_queries) if t.query_positions[r] < c]
    for layer in (0, 1):
        got = POLICIES["h2o"].scores_at_compression(ScoreContext(t, layer, Spec(scorer="h2o")))
        want = np.zeros((t.n_kv_heads, P))
        for h in range(t.n_q_heads):
            want[h // g, :c] += sum(attention(layer, h, r) for r in rows)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    tova = POLICIES["tova"].scores_at_compression(ScoreContext(t, 1, Spec(scorer="tova")))
    last = np.mean([attention(1, h, rows[-1]) for h in range(t.n_q_heads)], axis=0)
    np.testing.assert_allclose(tova[:, :c], np.broadcast_to(last, (t.n_kv_heads, c)), rtol=1e-5, atol=1e-9)
    knorm = POLICIES["knorm"].scores_at_compression(ScoreContext(t, 1, Spec(scorer="knorm")))
    np.testing.assert_allclose(knorm, -np.linalg.norm(t.k[1].astype(np.float64), axis=-1), rtol=1e-6)
    for scores in (tova, knorm):
        assert scores.dtype == np.float64 and not scores.flags.writeable
        with pytest.raises(ValueError):
            scores[0, 0] = 1.0
    base._SCORE_CACHE.clear()


def test_context_attention_chunks_are_causal_softmax_rows():
    """ScoreContext.context_attention: (rows, attention (heads, rows, n_context)) of the context queries,
    zero on future keys; heads= picks query heads; trim=True leaves out the keys no row of the chunk sees."""
    from kvviz.policies import ScoreContext

    t = make_synthetic(SMALL)
    ctx = ScoreContext(t, 1, Spec())
    c, g = t.context_len, t.group_size
    rows = np.array([3, 10, 40])
    idx, attn = next(ctx.context_attention(rows=rows, heads=np.array([3])))
    assert idx.tolist() == [3, 10, 40] and attn.shape == (1, 3, c)
    for i, r in enumerate(rows):
        k = t.k[1, 3 // g, : r + 1].astype(np.float64)
        x = k @ t.q[1, 3, r].astype(np.float64) / np.sqrt(t.head_dim)
        np.testing.assert_allclose(attn[0, i, : r + 1], np.exp(x - x.max()) / np.exp(x - x.max()).sum(), rtol=2e-5)
        assert not attn[0, i, r + 1 :].any()
    _, trimmed = next(ctx.context_attention(rows=rows, trim=True))
    assert trimmed.shape == (t.n_q_heads, 3, 41)
    whole = next(ctx.context_attention(rows=rows))[1]
    assert not whole[..., 41:].any()  # what trimming leaves out is the zeros
    # the same products, but another shape, so BLAS may take another kernel: equal to float32's precision
    heads = np.arange(t.n_q_heads)
    q = t.q[1][heads][:, rows]  # (H, 3, D)
    k = t.k[1][t.kv_head(heads), :41]  # (H, 41, D)
    bound = max(logit_error_bound(q[h], k[h]).max() for h in heads)
    np.testing.assert_allclose(trimmed, whole[..., :41], rtol=softmax_rtol(2 * bound, 41), atol=0)
    assert next(ctx.context_attention())[1].shape == (t.n_q_heads, c, c)  # every context row, every key


# --- every row against docs/definitions.md's formulas, recomputed in plain numpy (mutation testing) ------

LN2 = np.log(2.0)


def _reference_row(t, spec, layer, head, qi, kept, whole=False, stored=None):
    """One row from docs/definitions.md alone, in float64: a = softmax(q.K^T / sqrt(d)) over tokens 0..p; the
    kept tokens' keys / values quantized by the plain-loop quantizer over the compacted kept cache (or,
    whole=True, Quest's: over the whole cache, then read), or logits + sigma eps for the noise model;
    a_hat = softmax over the kept tokens; o = a V, o_hat = a_hat V_hat; the metrics by their definitions.
    stored: (K_hat, V_hat) of the kept tokens where the caller quantized them itself."""
    p = int(t.query_positions[qi])
    n, g, d = p + 1, head // t.group_size, t.head_dim
    idx = np.flatnonzero(kept[:n])
    q = t.q[layer, head, qi].astype(np.float64)
    logits = t.k[layer, g, :n].astype(np.float64) @ q / np.sqrt(d)
    a = np.exp(logits - logits.max())
    a /= a.sum()

    def hat(x, which):  # the stored (quantized) rows of the kept tokens
        if stored is not None:
            return stored[which].astype(np.float64)
        bits, axis = (spec.key_bits, spec.key_axis) if which == 0 else (spec.value_bits, spec.value_axis)
        if spec.quant_model != "kv" or bits >= 16:
            return x[idx].astype(np.float64)
        part = x if whole else x[idx]
        return reference_quantize(
            part, bits, axis, spec.group_size, spec.residual, spec.symmetric, spec.zero_point, spec.partial
        )[idx if whole else slice(None)].astype(np.float64)

    kept_logits = hat(t.k[layer, g, :n], 0) @ q / np.sqrt(d)
    if spec.quant_model == "noise":
        if t.noise_eps is not None and spec.seed == 0:
            eps = t.noise_eps[:n]
        else:
            eps = np.random.default_rng([spec.seed, layer, head, p]).standard_normal(n)
        kept_logits = logits[idx] + spec.noise_sigma * eps[idx]
    a_hat = np.zeros(n)
    e = np.exp(kept_logits - kept_logits.max())
    a_hat[idx] = e / e.sum()
    mass = a[idx].sum()
    kl = float(np.sum(a_hat[idx] * np.log(a_hat[idx] / a[idx])))
    mid = (a + a_hat) / 2
    js = 0.5 * np.sum(a * np.log(a / mid)) + 0.5 * np.sum(a_hat[idx] * np.log(a_hat[idx] / mid[idx]))
    metrics = dict(
        mass_retained=mass,
        tv_distance=0.5 * np.abs(a_hat - a).sum(),
        tv_quantization=0.5 * np.abs(a_hat[idx] - a[idx] / mass).sum() if spec.quantizes else 0.0,
        kl=kl,
        kl_forward=np.inf if len(idx) < n else float(np.sum(a * np.log(a / a_hat))),
        js=js,
        max_abs_error=np.abs(a_hat - a).max(),
        output_rel_error=None,
        output_cosine=None,
    )
    out = out_hat = None
    if t.v is not None:
        v = t.v[layer, g, :n].astype(np.float64)
        out, out_hat = a @ v, a_hat[idx] @ hat(t.v[layer, g, :n], 1)
        metrics["output_rel_error"] = np.linalg.norm(out_hat - out) / np.linalg.norm(out)
        metrics["output_cosine"] = out @ out_hat / (np.linalg.norm(out) * np.linalg.norm(out_hat))
    return a, a_hat, out, out_hat, metrics


def _stored(x, spec, which, residual, rotated=False):
    """A layer's kept keys (which 0) or values (1), x (kv_heads, m, D), as the formats path stores them:
    the plain-loop quantizer per head on all but the last `residual` tokens, in the Hadamard basis when
    rotated; in the trace's float32, as the engine quantizes (a float64 copy rounds a few ties otherwise)."""
    bits, axis = (spec.key_bits, spec.key_axis) if which == 0 else (spec.value_bits, spec.value_axis)
    n = x.shape[1] - residual
    y = rotate(x[:, :n]) if rotated else x[:, :n]
    q = np.stack(
        [
            reference_quantize(h, bits, axis, spec.group_size, 0, spec.symmetric, spec.zero_point, spec.partial)
            for h in y
        ]
    )
    return np.concatenate([unrotate(q) if rotated else q, x[:, n:]], axis=1)


def _reason_names(kept, spec):
    """docs/definitions.md's reasons: the first sink tokens, the last recent ones, heavy hitters, evicted; all
    kept: no eviction."""
    n = len(kept)
    if not spec.evicts:
        return ["kept (no eviction)"] * n
    return [
        "sink" if i < spec.sink else "recent" if i >= n - spec.recent else "heavy hitter" if kept[i] else "evicted"
        for i in range(n)
    ]


def _check_row(t, spec, row, kept, whole=False, tol=2e-5, stored=None):
    a, a_hat, out, out_hat, metrics = _reference_row(t, spec, row.layer, row.head, row.query, kept, whole, stored)
    assert row.kv_head == row.head // t.group_size and row.position == t.query_positions[row.query]
    assert row.kept.dtype == bool and row.reason.dtype == np.int8
    np.testing.assert_array_equal(row.kept, kept)
    assert [REASONS[int(r)] for r in row.reason] == _reason_names(kept, spec)
    np.testing.assert_allclose(row.original, a, rtol=tol, atol=1e-9)
    np.testing.assert_allclose(row.compressed, a_hat, rtol=tol, atol=1e-9)
    np.testing.assert_allclose(row.error, a_hat - a, rtol=0, atol=tol * max(a.max(), a_hat.max()))  # a difference
    if out is None:
        assert row.out_original is None and row.out_compressed is None
    else:
        np.testing.assert_allclose(row.out_original, out, rtol=tol, atol=1e-6)
        np.testing.assert_allclose(row.out_compressed, out_hat, rtol=tol, atol=1e-6)
    got = row.metrics.as_dict()
    assert got.keys() == metrics.keys()
    for key, want in metrics.items():
        if want is None or want == np.inf:
            assert got[key] == want, key
        else:
            assert got[key] == pytest.approx(want, rel=1e-3, abs=1e-7), key


def _select_reference(scores, sink, recent, heavy):
    """docs/definitions.md's budget rule for one row of scores: first sink, last recent, the top heavy of the rest
    (ties: the earlier token)."""
    n = len(scores)
    keep = np.zeros(n, bool)
    keep[:sink] = True
    keep[max(0, n - recent) :] = True
    rest = [i for i in range(n) if not keep[i]]
    keep[sorted(rest, key=lambda i: (-scores[i], i))[:heavy]] = True
    return keep


def _attention(t, layer, head, qi):
    p = int(t.query_positions[qi])
    x = t.k[layer, head // t.group_size, : p + 1].astype(np.float64) @ t.q[layer, head, qi].astype(np.float64)
    x /= np.sqrt(t.head_dim)
    return np.exp(x - x.max()) / np.exp(x - x.max()).sum()


def _oracle_kept(t, spec, layer, qi):
    """The oracle's kept mask per KV head: the top of the group's summed attention (docs/definitions.md's `oracle`)."""
    g = t.group_size
    return np.stack(
        [
            _select_reference(
                sum(_attention(t, layer, h, qi) for h in range(kv * g, kv * g + g)), spec.sink, spec.recent, spec.heavy
            )
            for kv in range(t.n_kv_heads)
        ]
    )


def _quest_reads(t, spec, layer, qi):
    """Quest per query head: every token carries its page's bound U = sum_d max(q_d m_d, q_d M_d) over the
    page's keys (pages of page_size tokens from 0); each head reads its top pages (quest.py's docstring)."""
    p = int(t.query_positions[qi])
    reads = []
    for h in range(t.n_q_heads):
        k = t.k[layer, h // t.group_size, : p + 1].astype(np.float64)
        q = t.q[layer, h, qi].astype(np.float64)
        score = np.empty(p + 1)
        for start in range(0, p + 1, spec.page_size):
            page = k[start : start + spec.page_size]
            score[start : start + spec.page_size] = np.maximum(q * page.min(axis=0), q * page.max(axis=0)).sum()
        reads.append(_select_reference(score, spec.sink, spec.recent, spec.heavy))
    return np.stack(reads)


KIVI = dict(key_bits=2, value_bits=3, group_size=8, residual=5)
ORACLE = dict(sink=3, recent=6, heavy=9, scorer="oracle")  # the oracle's budget in the tests below


@pytest.mark.parametrize(
    "settings",
    [
        dict(**ORACLE, **KIVI),  # evict, then quantize the kept cache
        dict(**ORACLE),  # eviction alone: V read as stored
        dict(key_bits=3, value_bits=16, group_size=6, key_axis="token"),  # keys only, nothing evicted
        dict(key_bits=16, value_bits=2, group_size=4, symmetric=False, zero_point="int", partial="quantize"),
        dict(sink=2, recent=4, heavy=7, scorer="oracle", quant_model="noise", noise_sigma=0.3, seed=4),
        dict(quant_model="noise", noise_sigma=0.5),  # seed 0, a source with no draw
        dict(quant_model="noise", noise_sigma=0.2, key_bits=3, value_bits=3),  # bits count memory only
        dict(
            **ORACLE,
            key_bits=3,
            value_bits=4,
            group_size=6,
            residual=2,
            symmetric=True,
            key_axis="token",
            value_axis="channel",
        ),
        dict(**ORACLE, key_bits=2, value_bits=3, group_size=5, zero_point="int", partial="quantize"),
    ],
    ids=[
        "oracle-kivi",
        "oracle",
        "keys",
        "values",
        "oracle-noise",
        "noise",
        "noise-bits",
        "oracle-symmetric",
        "oracle-int-zero-point",
    ],
)
@pytest.mark.parametrize("step", [2, 11])
def test_every_row_is_the_design_formulas(trace, settings, step):
    """Every member of a heads ensemble (both KV heads batched) against _reference_row, the kept set
    against the oracle's definition; kept_at_query, read_masks and kept_counts say the same."""
    from kvviz.engine import kept_at_query, kept_counts, read_masks

    spec = Spec(**settings)
    c = compare(trace, spec, View(layer=1, head=1, step=step, ensemble="heads"))
    qi = int(trace.evaluated_queries[step])
    n = int(trace.query_positions[qi]) + 1
    kept = _oracle_kept(trace, spec, 1, qi) if spec.evicts else np.ones((trace.n_kv_heads, n), bool)
    assert [r.head for r in c.members] == [1, 2, 3, 0]
    for row in c.members:
        _check_row(trace, spec, row, kept[row.head // trace.group_size])
    held = kept_at_query(trace, spec, 1, qi)
    assert held.dtype == bool and held.shape == (trace.n_kv_heads, n)
    np.testing.assert_array_equal(held, kept)
    np.testing.assert_array_equal(read_masks(trace, spec, 1, qi), np.repeat(kept, trace.group_size, axis=0))
    counts = kept_counts(trace, spec, qi)
    assert counts.dtype == np.int64 and counts.shape == (trace.n_layers, trace.n_kv_heads)
    assert counts.tolist() == [[int(min(spec.budget, n)) if spec.evicts else n] * trace.n_kv_heads] * trace.n_layers


@pytest.mark.parametrize("bits", [16, 3])
def test_quest_rows_read_their_own_pages_of_the_whole_cache(trace, bits):
    """Quest per query head: each row's kept set is its own top pages, and its keys / values are read
    from the whole cache quantized as stored (not a compacted cache of its reads)."""
    from kvviz.engine import kept_at_query, kept_counts, read_masks

    spec = Spec(
        sink=2,
        recent=5,
        heavy=16,
        scorer="quest",
        page_size=8,
        key_bits=bits,
        value_bits=bits,
        group_size=8,
        residual=3,
    )
    qi = int(trace.evaluated_queries[4])
    reads = _quest_reads(trace, spec, 0, qi)
    c = compare(trace, spec, View(layer=0, head=2, step=4, ensemble="heads"))
    assert not np.array_equal(reads[0], reads[1]) and not np.array_equal(reads[2], reads[3])  # own pages
    for row in c.members:
        _check_row(trace, spec, row, reads[row.head], whole=True)
    np.testing.assert_array_equal(read_masks(trace, spec, 0, qi), reads)
    union = reads.reshape(trace.n_kv_heads, trace.group_size, -1).any(axis=1)
    np.testing.assert_array_equal(kept_at_query(trace, spec, 0, qi), union)
    counts = kept_counts(trace, spec, qi)
    assert counts.dtype == np.int64 and counts[0].tolist() == union.sum(axis=1).tolist()


def test_quest_under_adakv_reads_a_different_number_of_tokens_per_query_head(trace):
    """Quest per query head with AdaKV's budget spread: rows read different numbers of tokens (evaluated one
    at a time), each its own reads as the policy gives them, from the whole cache quantized as stored."""
    from kvviz.policies import ScoreContext, get_policy

    spec = Spec(sink=2, recent=5, heavy=16, scorer="quest", page_size=8, allocation="adakv", **KIVI)
    qi = int(trace.evaluated_queries[4])
    n = int(trace.query_positions[qi]) + 1
    reads = get_policy("quest").query_reads(
        None, ScoreContext(trace, 0, spec), query=trace.q[0, :, qi], keys=trace.k[0, :, :n]
    )
    assert len(set(reads.sum(axis=1).tolist())) > 1  # ragged
    for row in compare(trace, spec, View(layer=0, head=2, step=4, ensemble="heads")).members:
        _check_row(trace, spec, row, reads[row.head], whole=True)


def test_adakv_rows_of_ragged_caches_each_quantize_their_own(trace):
    """AdaKV: KV heads of different sizes are evaluated one at a time, each over its own compacted cache."""
    from kvviz.engine import kept_at_query

    spec = Spec(sink=2, recent=6, heavy=20, scorer="snapkv", allocation="adakv", **KIVI)
    c = compare(trace, spec, View(layer=1, head=0, ensemble="heads"))
    kept = kept_at_query(trace, spec, 1, int(trace.evaluated_queries[-1]))
    assert kept.sum(axis=1)[0] != kept.sum(axis=1)[1]  # ragged here
    for row in c.members:
        _check_row(trace, spec, row, kept[row.kv_head])


def test_noise_model_draws_the_sources_eps_at_seed_0_and_seeded_normals_otherwise():
    """The handbook's noise draw (docs/definitions.md: legacy seed 42, the 64 normals after the logits') at seed 0;
    at another seed default_rng([seed, layer, head, position])'s normals, on the source's own logits."""
    from kvviz.sources.handbook import handbook_trace

    t = handbook_trace()
    legacy = np.random.RandomState(42)
    legacy.randn(1, 64)
    for seed, eps in ((0, legacy.randn(64)), (3, np.random.default_rng([3, 0, 0, 63]).standard_normal(64))):
        row = compare(t, Spec(quant_model="noise", noise_sigma=0.7, seed=seed)).primary
        x = t.logits[0, 0, 0].astype(np.float64) + 0.7 * eps
        np.testing.assert_allclose(row.compressed, np.exp(x - x.max()) / np.exp(x - x.max()).sum(), rtol=1e-12)


def test_seed_members_from_another_trace_take_its_step_at_the_same_index(trace):
    """A seed ensemble whose source draws a trace per seed: each member is evaluated on its own trace at the
    primary's step index, the last step where that trace has fewer; the spread covers only what each sees."""
    others = {r: make_synthetic(SMALL.with_(seed=r, steps=6)) for r in (1, 2)}
    spec = Spec(key_bits=3, value_bits=3, group_size=8)
    for step, want in ((3, 3), (9, 5)):
        c = compare(trace, spec, View(step=step, ensemble="seeds", ensemble_size=3), trace_for_seed=others.get)
        assert [m.query for m in c.members] == [int(trace.evaluated_queries[step])] + [
            int(others[r].evaluated_queries[want]) for r in (1, 2)
        ]
        for r, row in zip((1, 2), c.members[1:]):
            _check_row(others[r], spec.with_(seed=r), row, np.ones(row.position + 1, bool))
        n = c.primary.position + 1
        errors = np.full((3, n), np.nan)
        for i, m in enumerate(c.members):
            errors[i, : len(m.error)] = m.error
        np.testing.assert_allclose(c.spread.mean, np.nanmean(errors, axis=0), atol=1e-15)
        assert c.spread.n.tolist() == (~np.isnan(errors)).sum(axis=0).tolist()


def test_evaluate_row_decides_as_compare_does(trace):
    """evaluate_row alone: a history policy's mask at that query, the oracle's from it, none without eviction."""
    from kvviz import evaluate_row
    from kvviz.engine import kept_at_query, read_masks

    qi = int(trace.evaluated_queries[7])
    p = int(trace.query_positions[qi])
    for spec in (
        Spec(sink=2, recent=5, heavy=9, scorer="h2o", **KIVI),
        Spec(sink=2, recent=5, heavy=9, scorer="oracle", **KIVI),
        Spec(**KIVI),
    ):
        row = evaluate_row(trace, spec, 1, 3, qi)
        if spec.scorer == "oracle":
            kept = _oracle_kept(trace, spec, 1, qi)[1]
        elif spec.evicts:
            kept = keep_masks(trace, spec, 1, [p])[0, 1, : p + 1]
            assert kept.sum() == spec.budget
            held = kept_at_query(trace, spec, 1, qi)
            assert held.shape == (trace.n_kv_heads, p + 1) and held[1].tolist() == kept.tolist()
            np.testing.assert_array_equal(read_masks(trace, spec, 1, qi), np.repeat(held, trace.group_size, axis=0))
        else:
            kept = np.ones(p + 1, bool)
        _check_row(trace, spec, row, kept)


def test_to_json_holds_every_field_of_the_comparison(trace):
    from scipy import stats

    spec = Spec(**ORACLE, **KIVI)
    c = compare(trace, spec, View(layer=1, head=2, step=5, ensemble="heads", ensemble_size=3))
    got = c.to_json()
    assert c.view == View(layer=1, head=2, step=5, ensemble="heads", ensemble_size=3) and c.spec == spec
    assert sorted(got) == sorted(TO_JSON_KEYS)
    assert got["layer_kind"] == "full_attention" and got["layer_window"] is None
    qi = int(trace.evaluated_queries[5])
    n = int(trace.query_positions[qi]) + 1
    kept = _oracle_kept(trace, spec, 1, qi)[1]
    a, a_hat, *_ = _reference_row(trace, spec, 1, 2, qi, kept)
    errors = np.stack([m.error for m in c.members])
    mean, std = errors.mean(axis=0), errors.std(axis=0, ddof=1)
    half = stats.t.ppf(0.975, 2) * std / np.sqrt(3)
    assert got["source"] == "synthetic" and got["spec"] == spec.__dict__ and got["notes"] == []
    assert (got["layer"], got["head"], got["kv_head"], got["position"]) == (1, 2, 1, n - 1)
    assert (got["ensemble"], got["ensemble_members"]) == ("heads", 3)
    assert got["tokens"] == list(trace.tokens[:n]) and got["kept"] == kept.tolist()
    assert got["reason"] == _reason_names(kept, spec)
    for key, want in (
        ("original", a),
        ("compressed", a_hat),
        ("error", a_hat - a),
        ("error_mean", mean),
        ("error_std_sample", std),
        ("error_ci95_lo", mean - half),
        ("error_ci95_hi", mean + half),
        ("error_min", errors.min(axis=0)),
        ("error_max", errors.max(axis=0)),
    ):
        assert isinstance(got[key], list) and len(got[key]) == n, key
        np.testing.assert_allclose(got[key], want, rtol=2e-5, atol=1e-9, err_msg=key)
    assert got["metrics"] == {
        **c.primary.metrics.as_dict(),
        "kv_bytes": c.memory.kv_bytes,
        "kv_bytes_full": c.memory.kv_bytes_full,
        "compression_ratio": c.memory.compression_ratio,
        "memory_ratio": c.memory.ratio,
        "kept_tokens": 18,
        "total_tokens": n,
        "kv_bytes_read": c.memory.bytes_read,
        "kv_bytes_peak": c.memory.peak,
        "key_bytes": c.memory.key_bytes,
        "value_bytes": c.memory.kv_bytes - c.memory.key_bytes,
    }
    for key, value in got["metrics_mean"].items():
        assert value == pytest.approx(np.mean([getattr(m.metrics, key) for m in c.members]), rel=1e-12), key
    assert got["metrics_mean"]["kl_forward"] == np.inf


def test_head_grid_is_each_rows_metric(trace):
    from kvviz.engine import head_grid

    spec = Spec(sink=2, recent=4, heavy=5, scorer="oracle", **KIVI)
    qi = int(trace.evaluated_queries[-1])
    grid = head_grid(trace, spec, metric="js")
    for layer in range(trace.n_layers):
        kept = _oracle_kept(trace, spec, layer, qi)
        for head in range(trace.n_q_heads):
            want = _reference_row(trace, spec, layer, head, qi, kept[head // trace.group_size])[4]["js"]
            assert grid[layer, head] == pytest.approx(want, rel=1e-3), (layer, head)
    with pytest.raises(SpecError, match="unknown metric 'nope'"):
        head_grid(trace, spec, metric="nope")


@pytest.mark.parametrize("ensemble", ["steps", "layers"])
def test_rows_of_other_layers_and_steps_quantize_their_own_caches(trace, ensemble):
    """One quantized-cache store serves a comparison's batches: each (layer, query) still gets its own
    kept keys quantized (integer path: per KV head; formats path: the layer's heads together)."""
    for spec in (Spec(**ORACLE, **KIVI), Spec(**ORACLE, rotate="keys", **KIVI)):
        c = compare(trace, spec, View(layer=1, head=3, step=10, ensemble=ensemble, ensemble_size=4))
        assert len({(m.layer, m.query) for m in c.members}) == len(c.members) > 1
        for row in c.members:
            kept = _oracle_kept(trace, spec, row.layer, row.query)
            if spec.rotate == "none":
                _check_row(trace, spec, row, kept[row.kv_head])
                continue
            at = [np.flatnonzero(k) for k in kept]
            rows = np.arange(trace.n_kv_heads)[:, None]
            residual = min(spec.residual, len(at[0]))
            k_hat = _stored(trace.k[row.layer][rows, np.stack(at)], spec, 0, residual, rotated=True)
            v_hat = _stored(trace.v[row.layer][rows, np.stack(at)], spec, 1, residual)
            _check_row(trace, spec, row, kept[row.kv_head], stored=(k_hat[row.kv_head], v_hat[row.kv_head]))


@pytest.mark.parametrize("step", [4, 6])
def test_hf_residual_keeps_the_tokens_since_the_last_flush_exact(trace, step):
    """residual_mode 'hf' through the formats path: at decode step s past the prompt the tokens since the
    last flush, (s mod r) + 1 of them, stay exact; every earlier kept token is quantized (HF QuantizedCache)."""
    spec = Spec(**ORACLE, key_bits=3, value_bits=2, group_size=8, residual=4, residual_mode="hf")
    c = compare(trace, spec, View(layer=0, head=0, step=step, ensemble="heads"))
    qi = int(trace.evaluated_queries[step])
    assert int(trace.query_positions[qi]) == trace.context_len + step
    kept = _oracle_kept(trace, spec, 0, qi)
    where = np.stack([np.flatnonzero(k) for k in kept])
    rows = np.arange(trace.n_kv_heads)[:, None]
    k_hat = _stored(trace.k[0][rows, where], spec, 0, step % 4 + 1)
    v_hat = _stored(trace.v[0][rows, where], spec, 1, step % 4 + 1)
    for row in c.members:
        _check_row(trace, spec, row, kept[row.kv_head], stored=(k_hat[row.kv_head], v_hat[row.kv_head]))


def test_a_sources_own_noise_draw_is_cut_to_the_tokens_each_query_sees(trace):
    """A source with its own draw (one per position): at seed 0 every head of a query reads its first p + 1
    values, at an earlier step too; at another seed the seeded normals."""
    import dataclasses

    drawn = dataclasses.replace(trace, noise_eps=np.random.default_rng(7).standard_normal(trace.n_positions))
    for seed in (0, 2):
        spec = Spec(sink=2, recent=4, heavy=7, scorer="oracle", quant_model="noise", noise_sigma=0.4, seed=seed)
        c = compare(drawn, spec, View(layer=0, head=0, step=3, ensemble="heads"))
        kept = _oracle_kept(drawn, spec, 0, c.primary.query)
        for row in c.members:
            _check_row(drawn, spec, row, kept[row.kv_head])


def test_oracle_asked_for_its_masks_first_computes_every_heads_attention():
    """kept_at_query / read_masks before any row: the oracle computes every query head's attention itself,
    and the shared decision it caches cannot be written to."""
    from kvviz.engine import kept_at_query, read_masks

    t = make_synthetic(SMALL.with_(seed=11))  # a fresh trace: nothing cached for it
    spec = Spec(sink=2, recent=5, heavy=9, scorer="oracle")
    qi = int(t.evaluated_queries[6])
    held = kept_at_query(t, spec, 1, qi)
    np.testing.assert_array_equal(held, _oracle_kept(t, spec, 1, qi))
    assert not held.flags.writeable
    np.testing.assert_array_equal(read_masks(t, spec, 0, qi), np.repeat(_oracle_kept(t, spec, 0, qi), 2, axis=0))
    everything = read_masks(t, Spec(scorer="oracle"), 0, qi)  # no budget: nothing evicted
    assert everything.shape == (t.n_q_heads, int(t.query_positions[qi]) + 1) and everything.all()


def test_formats_path_quantizes_only_the_tensors_the_spec_and_the_source_have(trace):
    """Rotated keys with values at 16 bits, and a source with no values: keys quantized, nothing else."""
    import dataclasses

    spec = Spec(**ORACLE, key_bits=3, value_bits=16, group_size=8, residual=2, rotate="keys-values")
    no_values = dataclasses.replace(trace, v=None)
    kivi = Spec(**ORACLE, **KIVI)  # the integer path, no values
    for row in compare(no_values, kivi, View(layer=1, head=2, step=8, ensemble="heads")).members:
        _check_row(no_values, kivi, row, _oracle_kept(no_values, kivi, 1, row.query)[row.kv_head])
    for t, s in ((trace, spec), (no_values, spec.with_(value_bits=2))):
        c = compare(t, s, View(layer=1, head=2, step=8, ensemble="heads"))
        kept = _oracle_kept(t, s, 1, c.primary.query)
        where = np.stack([np.flatnonzero(k) for k in kept])
        k_hat = _stored(t.k[1][np.arange(2)[:, None], where], s, 0, 2, rotated=True)
        for row in c.members:
            v_kept = None if t.v is None else t.v[1, row.kv_head, where[row.kv_head]]
            _check_row(t, s, row, kept[row.kv_head], stored=(k_hat[row.kv_head], v_kept))
    fp8_values = spec.with_(key_bits=16, rotate="none", value_format="e4m3")  # keys exact, values FP8
    c = compare(trace, fp8_values, View(layer=1, head=2, step=8, ensemble="heads"))
    kept = _oracle_kept(trace, spec, 1, c.primary.query)
    for row in c.members:
        a_hat = _reference_row(trace, Spec(sink=3, recent=6, heavy=9), 1, row.head, row.query, kept[row.kv_head])[1]
        np.testing.assert_allclose(row.compressed, a_hat, rtol=2e-5, atol=1e-9)
        assert row.metrics.output_rel_error > 0  # the values were quantized


def test_head_grid_covers_more_heads_than_the_default_ensemble():
    from kvviz.engine import head_grid

    t = make_synthetic(SMALL.with_(q_heads=10, kv_heads=2, context=40, steps=2))
    spec = Spec(key_bits=2, value_bits=2, group_size=8)  # nothing evicted: every token kept
    grid = head_grid(t, spec, step=0, metric="tv_distance")
    qi = int(t.evaluated_queries[0])
    kept = np.ones(int(t.query_positions[qi]) + 1, bool)
    want = [[_reference_row(t, spec, layer, h, qi, kept)[4]["tv_distance"] for h in range(10)] for layer in (0, 1)]
    np.testing.assert_allclose(grid, want, rtol=1e-3)


def test_ensemble_sizes_for_the_work_budget(trace):
    from kvviz.engine import n_members

    assert n_members(trace, View()) == 1
    assert [n_members(trace, View(ensemble=e, ensemble_size=3)) for e in ("heads", "layers", "steps", "seeds")] == [
        3,
        2,
        3,
        3,
    ]  # 2 layers: no more than there are
    assert [n_members(trace, View(ensemble=e, ensemble_size=20)) for e in ("heads", "steps", "seeds")] == [4, 12, 20]


def test_compare_work_counts_what_a_comparison_holds_at_its_peak(trace):
    """The work budget's parts, as compare_work's docstring lists them: the trace's bytes, 12 float64 arrays per
    row and token, (evicting) the policy's inputs, attention chunks and kept masks, (seeds) the other traces."""
    from kvviz.attention import chunk_rows
    from kvviz.engine import compare_work
    from kvviz.limits import Part

    size = trace.q.nbytes + trace.k.nbytes + trace.v.nbytes  # no stored logits
    P = trace.n_positions
    work = compare_work(trace, True, View(ensemble="seeds", ensemble_size=3), seeds=True)
    assert (work.what, work.lower) == ("this comparison", "the ensemble size or the source's size")
    assert work.parts == (
        Part("the trace", ((size, "bytes"),), item_bytes=1),
        Part("attention rows", ((3, "rows"), (P, "tokens"), (12, "arrays")), item_bytes=8),
        Part("policy inputs", ((2, ""), (4, "query heads"), (P, "positions"), (48, "dims")), item_bytes=4),
        Part("attention chunks", ((2, ""), (4, "query heads"), (chunk_rows(4, P), "rows"), (P, "keys")), item_bytes=4),
        Part("kept masks", ((3, "queries"), (2, "KV heads"), (P, "positions")), item_bytes=1),
        Part("seed traces", ((2, "more traces"), (size, "bytes")), item_bytes=1),
    )
    assert work.bytes == size * 3 + 3 * P * 12 * 8 + 2 * 4 * P * 48 * 4 + 2 * 4 * chunk_rows(4, P) * P * 4 + 3 * 2 * P
    assert compare_work(trace, False, View()).parts == (
        work.parts[0],
        Part("attention rows", ((1, "rows"), (P, "tokens"), (12, "arrays")), item_bytes=8),
    )
    same_trace = compare_work(trace, True, View(ensemble="seeds", ensemble_size=3))  # seeds of one trace
    assert same_trace.parts == work.parts[:-1]
    two = compare_work(trace, True, View(ensemble="seeds", ensemble_size=2), seeds=True).parts
    assert two[-1] == Part("seed traces", ((1, "more traces"), (size, "bytes")), item_bytes=1)
    for view in (View(ensemble="seeds", ensemble_size=1), View(ensemble="heads", ensemble_size=3)):
        assert [p.what for p in compare_work(trace, True, view, seeds=True).parts][-1] == "kept masks"


def test_ensemble_members_in_order_primary_first():
    """heads: the next heads round; layers: the next layers round (3 layers tell + from -); steps: this step and
    the ones before it, newest first, as many as exist; positions='cache' is refused with the reason."""
    from kvviz.engine import ensemble_members

    t = make_synthetic(SMALL.with_(layers=3, steps=5))
    spec = Spec(key_bits=4)
    q = [int(x) for x in t.evaluated_queries]

    def members(**view):
        return [(layer, head, qi) for _, _, layer, head, qi in ensemble_members(t, spec, View(**view), q[view["step"]])]

    assert members(layer=1, head=3, step=2, ensemble="heads", ensemble_size=3) == [
        (1, 3, q[2]),
        (1, 0, q[2]),
        (1, 1, q[2]),
    ]
    assert members(layer=1, head=2, step=2, ensemble="layers", ensemble_size=3) == [
        (1, 2, q[2]),
        (2, 2, q[2]),
        (0, 2, q[2]),
    ]
    assert members(layer=0, head=0, step=3, ensemble="steps", ensemble_size=3) == [
        (0, 0, q[3]),
        (0, 0, q[2]),
        (0, 0, q[1]),
    ]
    assert members(layer=0, head=0, step=1, ensemble="steps", ensemble_size=4) == [(0, 0, q[1]), (0, 0, q[0])]
    with pytest.raises(
        SpecError,
        match=r"^re-rotating keys to their cache slots needs the model's RoPE: it applies "
        r"to real-model decoding \(Model lab, kvviz eval\), not to attention traces$",
    ):
        compare(t, spec.with_(positions="cache"))


def test_compare_checks_its_work_budget_counting_eviction_and_seed_traces():
    """compare_work's estimate for this request (an ensemble of 4 seeds over 1,500 tokens): 9.8 MB plain,
    65 MB with a policy's inputs, 37 MB with three more traces drawn per seed."""
    from kvviz.limits import BudgetError, set_max_bytes

    t = make_synthetic(SyntheticSpec(context=1500, steps=2, layers=2, q_heads=8, kv_heads=2, head_dim=64))
    view = View(ensemble="seeds", ensemble_size=4)
    try:
        set_max_bytes(50_000_000)
        compare(t, Spec(key_bits=4), view)
        with pytest.raises(BudgetError):
            compare(t, Spec(sink=4, recent=8, heavy=8), view)
        set_max_bytes(20_000_000)
        compare(t, Spec(key_bits=4), view)  # one trace: its seeds draw no traces
        with pytest.raises(BudgetError):
            compare(t, Spec(key_bits=4), view, trace_for_seed=lambda r: t)
    finally:
        set_max_bytes(None)


def test_views_outside_the_trace_are_refused_word_for_word(trace):
    import dataclasses
    from kvviz.sources.handbook import handbook_trace

    for view, message in (
        (View(layer=2), "layer 2 does not exist: this trace has layers 0-1"),
        (View(head=4), "head 4 does not exist: this trace has query heads 0-3"),
        (View(step=12), "step 12 does not exist: this trace has 12 evaluated queries (steps 0-11)"),
    ):
        with pytest.raises(SpecError) as info:
            compare(trace, Spec(), view)
        assert str(info.value) == message
    with pytest.raises(SpecError) as info:
        compare(handbook_trace(), Spec(), View(step=1))
    assert str(info.value) == "step 1 does not exist: this trace has 1 evaluated query (steps 0-0)"
    assert compare(dataclasses.replace(trace, meta={}), Spec()).to_json()["source"] == ""
    everything_recent = compare(trace, Spec(recent=200), View(step=0)).primary  # a window past the start
    assert [REASONS[int(r)] for r in everything_recent.reason] == ["recent"] * (trace.context_len + 1)


def test_blas_runs_single_threaded_inside_a_comparison_and_is_set_once(monkeypatch):
    """BLAS's thread count is the process's: the first small_blas context in sets it to 1, contexts inside it
    (and in other threads meanwhile) change nothing, the last one out restores it."""
    import threading

    from kvviz import attention

    class Lib:
        def __init__(self):
            self.num_threads, self.sets = 4, []

        def set_num_threads(self, n):
            self.sets.append(n)
            self.num_threads = n

    lib = Lib()
    monkeypatch.setattr(attention, "_blas_libraries", lambda: (lib,))
    seen = []
    with attention.small_blas():
        with attention.small_blas():
            seen.append(lib.num_threads)
        other = threading.Thread(target=lambda: attention.small_blas()(lambda: seen.append(lib.num_threads))())
        other.start()
        other.join()
        seen.append(lib.num_threads)
    assert seen == [1, 1, 1] and lib.sets == [1, 4] and lib.num_threads == 4
    trace = make_synthetic(small_synthetic(context=64, steps=2, layers=1))
    compare(trace, Spec(sink=2, recent=4, heavy=2), View(ensemble="heads"))
    assert lib.sets == [1, 4, 1, 4] and lib.num_threads == 4  # a whole comparison: set once, restored
