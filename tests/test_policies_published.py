"""Policies against small independent re-computations of their published rules:
SnapKV never spends heavy slots on its own window, H2O's normalised form, the budget a query sees."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvviz import Spec, SpecError, View, compare, keep_masks
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from synthetic_util import small_synthetic
from kvviz.policies.snapkv import observation_window

SMALL = small_synthetic(context=120, steps=10, layers=2, n_anchors=5)


@pytest.fixture(scope="module")
def trace():
    return make_synthetic(SMALL)


def query_logits(trace, layer, q_head, r, keys):
    """Query r's logits over the given key positions: the trace's own logits where it has them (a logit-only
    source), else q . k / sqrt(d)."""
    if trace.logits is not None:
        return trace.logits[layer, q_head, r, keys].astype(np.float64)
    k = trace.k[layer, trace.kv_head(q_head), keys].astype(np.float64)
    return k @ trace.q[layer, q_head, r].astype(np.float64) / np.sqrt(trace.head_dim)


def causal_attention(trace, layer, q_head, rows, n_keys):
    """softmax(q . K^T / sqrt(d)) of the queries at `rows` over keys 0..n_keys-1, causal."""
    out = []
    for r in rows:
        p = int(trace.query_positions[r])
        logits = query_logits(trace, layer, q_head, r, np.arange(p + 1))
        a = np.zeros(n_keys)
        a[: p + 1] = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        out.append(a)
    return np.array(out)


def snapkv_votes(trace, layer, window, kernel=5):
    """SnapKV as kvpress computes it: the window's queries' mean attention to the prefix,
    avg_pool1d(kernel, stride 1, padding kernel // 2, zeros counted), mean over the GQA group."""
    c = trace.context_len
    rows = [i for i, p in enumerate(trace.query_positions) if c - window <= p < c]
    per_head = []
    for h in range(trace.n_q_heads):
        votes = causal_attention(trace, layer, h, rows, c).mean(axis=0)[: c - window]
        padded = np.concatenate([np.zeros(kernel // 2), votes, np.zeros(kernel // 2)])
        per_head.append([padded[i : i + kernel].mean() for i in range(c - window)])
    per_head = np.array(per_head).reshape(trace.n_kv_heads, trace.group_size, -1)
    return per_head.mean(axis=1)  # (kv_heads, c - window)


@given(sink=st.integers(0, 6), recent=st.integers(1, 40), heavy=st.integers(1, 50), window=st.integers(0, 40))
def test_snapkv_heavy_slots_go_to_the_top_voted_tokens_before_the_window(trace, sink, recent, heavy, window):
    """At every budget, including heavy < window - recent (where the old +inf window filled every
    heavy slot with the window's first tokens), the heavy hitters are the top votes of the prefix."""
    if window > recent:
        with pytest.raises(SpecError, match="must fit inside the recent window"):
            Spec(sink=sink, recent=recent, heavy=heavy, scorer="snapkv", snapkv_window=window)
        return
    spec = Spec(sink=sink, recent=recent, heavy=heavy, scorer="snapkv", snapkv_window=window or None)
    w = observation_window(spec)
    assert w == (window or min(recent, 64))
    c = trace.context_len
    kept = keep_masks(trace, spec, 1, [c - 1])[0]  # at the compression point
    votes = snapkv_votes(trace, 1, w)
    for g in range(trace.n_kv_heads):
        candidates = np.arange(min(sink, c), max(min(sink, c), c - recent))
        assert np.all(candidates < c - w)  # nothing inside the window competes
        order = sorted(candidates, key=lambda i: (-votes[g, i], i))
        want = set(order[:heavy])
        got = set(np.flatnonzero(kept[g])) - set(range(min(sink, c))) - set(range(c - recent, c))
        assert got == want
        assert np.all(kept[g, c - w : c])  # the window itself is kept


@pytest.mark.parametrize("window, kernel, chunk_rows", [(1, 5, None), (7, 3, 2), (119, 5, None), (40, 1, 3)])
def test_snapkv_scores_are_the_pooled_votes_of_its_window(trace, monkeypatch, window, kernel, chunk_rows):
    """The scores themselves, not only their order: the window's mean attention to each token before it,
    average-pooled (zeros counted) and averaged over the GQA group, the same when the window's rows come
    in several chunks; down to a window of one query and a prefix of one token. Tokens in the window and
    after the context get no score."""
    from kvviz import attention
    from kvviz.policies import POLICIES, ScoreContext

    if chunk_rows is not None:  # context_rows: chunk_rows rows a chunk (heads x rows x keys floats)
        monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * trace.n_q_heads * trace.context_len * chunk_rows)
    c = trace.context_len
    spec = Spec(sink=0, recent=window, heavy=4, scorer="snapkv", snapkv_window=window, snapkv_kernel=kernel)
    got = POLICIES["snapkv"].score(ScoreContext(trace, 1, spec))  # (kv_heads, positions)
    np.testing.assert_allclose(got[:, : c - window], snapkv_votes(trace, 1, window, kernel), rtol=1e-5)
    assert np.isneginf(got[:, c - window :]).all()


@pytest.mark.parametrize("window", [120, 125])
def test_snapkv_window_over_the_whole_context_ranks_nothing(trace, window):
    from kvviz.policies import POLICIES, ScoreContext

    spec = Spec(sink=0, recent=window, heavy=4, scorer="snapkv", snapkv_window=window)
    assert np.isneginf(POLICIES["snapkv"].score(ScoreContext(trace, 0, spec))).all()


def test_snapkv_needs_a_recent_window_that_holds_its_observation_window():
    with pytest.raises(SpecError, match="recent window of at least 1"):
        Spec(sink=4, heavy=8, scorer="snapkv")
    assert observation_window(Spec(sink=4, recent=23, heavy=24, scorer="snapkv")) == 23
    assert observation_window(Spec(sink=4, recent=200, heavy=24, scorer="snapkv")) == 64


def test_snapkv_synthetic_default_keeps_no_block_of_its_window():
    """The issue's case: synthetic default, sink 4 + recent 23 + heavy 24 kept 448-471 as 'heavy'."""
    t = make_synthetic(SyntheticSpec())
    row = compare(t, Spec(sink=4, recent=23, heavy=24, scorer="snapkv")).primary
    heavy = np.flatnonzero(row.reason == 3)
    assert len(heavy) == 24
    assert not set(range(448, 472)) <= set(heavy.tolist())  # no tie-broken block of a window
    assert np.all(heavy < t.context_len - 23)  # all before the observation window
    votes = snapkv_votes(t, 0, 23)[0]
    others = np.setdiff1d(np.arange(4, t.context_len - 23), heavy)
    assert votes[heavy].min() >= votes[others].max()  # the top votes, as kvpress ranks


def h2o_reference(trace, spec, layer, positions, normalized):
    """Streaming H2O from its definition, one KV head at a time, with plain loops."""
    c, P, g = trace.context_len, trace.n_positions, trace.group_size
    ctx_rows = [i for i, p in enumerate(trace.query_positions) if p < c]
    later = {int(p): i for i, p in enumerate(trace.query_positions) if p >= c}
    out = np.zeros((len(positions), trace.n_kv_heads, P), bool)
    for kv in range(trace.n_kv_heads):
        heads = range(kv * g, (kv + 1) * g)
        total = sum(causal_attention(trace, layer, h, ctx_rows, P).sum(axis=0) for h in heads)
        count = np.array([sum(trace.query_positions[r] >= i for r in ctx_rows) for i in range(P)], float)
        score = lambda i: total[i] / max(count[i], 1) if normalized else total[i]  # noqa: E731
        ranked = sorted(range(spec.sink, c - spec.recent), key=lambda i: (-score(i), i))
        kept = sorted(set(range(spec.sink)) | set(range(c - spec.recent, c)) | set(ranked[: spec.heavy]))
        unseen = set()
        for p in range(c, max(positions) + 1):
            kept.append(p)
            unseen.add(p)
            if len(kept) > spec.budget:
                free = [i for i in kept if spec.sink <= i <= p - spec.recent]
                seen_free = [i for i in free if i not in unseen]
                pool = seen_free or free
                victim = min(pool, key=lambda i: (score(i), i)) if seen_free else min(pool)
                kept.remove(victim)
            if p in positions:
                out[list(positions).index(p), kv, kept] = True
            if p in later:
                ks = np.array(kept)
                for h in heads:
                    logits = query_logits(trace, layer, h, later[p], ks)
                    a = np.exp(logits - logits.max())
                    total[ks] += a / a.sum()
                count[: p + 1] += 1
                unseen.clear()
    return out


@pytest.mark.parametrize("normalized", [False, True])
def test_h2o_sum_and_mean_forms_follow_their_definitions(trace, normalized):
    spec = Spec(sink=2, recent=6, heavy=9, scorer="h2o", h2o_normalized=normalized)
    positions = [int(p) for p in trace.query_positions[trace.later_queries]]
    got = keep_masks(trace, spec, 0, positions)
    want = h2o_reference(trace, spec, 0, positions, normalized)
    np.testing.assert_array_equal(got, want)


def test_h2o_mean_form_changes_the_decision(trace):
    last = [trace.n_positions - 1]
    a = keep_masks(trace, Spec(sink=2, recent=6, heavy=9), 0, last)
    b = keep_masks(trace, Spec(sink=2, recent=6, heavy=9, h2o_normalized=True), 0, last)
    assert (a != b).any()


@pytest.mark.parametrize("scorer", ["h2o", "tova", "snapkv", "streaming", "knorm", "oracle"])
def test_the_budget_shown_is_what_a_query_attends_over(trace, scorer):
    """Streaming policies count the arriving token inside the budget: a decode query attends over
    exactly sink + recent + heavy tokens, its own among them, and 'Tokens kept' says that number."""
    spec = Spec(sink=3, recent=5, heavy=7, scorer=scorer)
    for step in range(len(trace.later_queries)):
        c = compare(trace, spec, View(head=1, step=step))
        row = c.primary
        attended = np.flatnonzero(row.compressed > 0)
        assert len(attended) == spec.budget == c.memory.kept_tokens == row.kept.sum()
        assert row.kept[row.position]


def test_snapkv_sweep_points_spend_heavy_slots_on_voted_tokens_at_every_budget():
    """The Trade-offs sweep at 5-20%: each SnapKV point keeps exactly its budget, and every heavy
    hitter is a voted token before the observation window (before, small budgets degenerated to a
    tie-broken block of the window)."""
    from kvviz.analysis.sweep import split_budget

    t = make_synthetic(SyntheticSpec(context=256, steps=8))
    n = t.n_positions
    for f in (0.05, 0.1, 0.2, 0.3):
        spec = Spec(scorer="snapkv", **split_budget("snapkv", round(f * n)))
        row = compare(t, spec, View(head=1)).primary
        heavy = np.flatnonzero(row.reason == 3)
        assert row.kept.sum() == spec.budget and len(heavy) == spec.heavy
        assert np.all(heavy < t.context_len - observation_window(spec))
    assert "mean over the queries that saw each token" in Spec(sink=1, recent=2, heavy=3, h2o_normalized=True).label()


# The H2O sources below: one layer, head_dim 40, a few of each feature (3 heavy hitters, 1 shift token, 1 outlier)
FEW_FEATURES = dict(layers=1, head_dim=40, n_anchors=3, n_shift_tokens=1, outlier_channels=1)
LONG = SyntheticSpec(context=600, steps=2, q_heads=2, kv_heads=1, **FEW_FEATURES)


@pytest.mark.parametrize("normalized", [False, True])
def test_h2o_compression_scores_are_the_attention_each_token_received(normalized, monkeypatch):
    """A context of 600 queries, longer than one chunk of rows (512): each context token's score is the
    attention it received from every context query, summed over the query heads of its KV group (mean
    form: divided by the queries that could see it, the last token by 1), against softmax(q . K^T / sqrt d)
    in float64 here, to float32's precision; and the sum runs in float64: it equals the float64 sum of the
    very float32 chunks H2O was given to 1e-12 (a float32 sum of 512 rows drifts by ~1e-6). Those chunks are
    recorded, not recomputed: a second computation with other shapes runs other BLAS kernels, whose last
    float32 bits differ by processor (OPENBLAS_CORETYPE), and would make this a test of the BLAS."""
    import kvviz.attention as attention
    from kvviz.policies.base import ScoreContext
    from kvviz.policies.h2o import H2O

    t = make_synthetic(LONG)
    c = t.context_len
    ctx = ScoreContext(t, 0, Spec(sink=2, recent=6, heavy=9, h2o_normalized=normalized))
    rows = [i for i, p in enumerate(t.query_positions) if p < c]
    assert len(rows) == c > 512
    count = np.array([sum(t.query_positions[r] >= i for r in rows) for i in range(c)], float)
    divide = np.maximum(count, 1) if normalized else 1.0
    chunks = []

    original = attention.context_rows

    def recording(*args, **kwargs):  # what H2O's attention_sums sums, chunk by chunk
        for idx, attn in original(*args, **kwargs):
            chunks.append(attn.copy())
            yield idx, attn

    monkeypatch.setattr(attention, "context_rows", recording)
    got = H2O().score(ctx)[0, :c]
    total = sum(causal_attention(t, 0, h, rows, c).sum(axis=0) for h in range(t.n_q_heads))
    np.testing.assert_allclose(got, total / divide, rtol=2e-5)
    assert len(chunks) >= 2 and sum(a.shape[1] for a in chunks) == c  # more than one chunk of rows
    exact = np.zeros(c)
    for attn in chunks:
        exact[: attn.shape[-1]] += attn.astype(np.float64).sum(axis=(0, 1))
    np.testing.assert_allclose(got, exact / divide, rtol=1e-12)
    if normalized:
        assert count[-1] == 1


SHORT_CONTEXT = SyntheticSpec(context=24, steps=40, q_heads=4, kv_heads=2, topic_shift=2.0, **FEW_FEATURES)


@pytest.mark.parametrize("normalized", [False, True])
def test_h2o_decode_steps_drive_the_decision_when_the_context_is_short(normalized):
    """24 context queries, then 40 decode steps: the later queries' attention outweighs the context's, so
    the kept sets depend on how every step is folded into the scores; they match the reference."""
    t = make_synthetic(SHORT_CONTEXT)
    spec = Spec(sink=1, recent=4, heavy=6, scorer="h2o", h2o_normalized=normalized)
    positions = [int(p) for p in t.query_positions[t.later_queries]]
    np.testing.assert_array_equal(keep_masks(t, spec, 0, positions), h2o_reference(t, spec, 0, positions, normalized))


# --- policies/base.py against plain references (mutation testing) -----------------------


def logit_only_trace(seed=3, c=20, steps=8, gap=(23,)):
    """A logit-only source (its own logits, unrelated to q . k) with later queries, some decode positions
    without a query (`gap`): the streaming policy reads the logits, and a position with no query scores
    nothing."""
    from trace_util import numbered_trace

    rng = np.random.default_rng(seed)
    P, L, Hq, Hkv, D = c + steps, 1, 4, 2, 8
    qp = np.array([p for p in range(P) if p not in gap])
    q = rng.standard_normal((L, Hq, len(qp), D)).astype(np.float32)
    k = rng.standard_normal((L, Hkv, P, D)).astype(np.float32)
    logits = (2.0 * rng.standard_normal((L, Hq, len(qp), P))).astype(np.float32)
    return numbered_trace(q, k, None, c, {"source": "test"}, qp, logits=logits)


@pytest.mark.parametrize("heavy", [5, 20])
@pytest.mark.parametrize("normalized", [False, True])
def test_h2o_on_a_logit_only_trace_with_a_position_without_query(heavy, normalized):
    """Streaming H2O over the source's own logits; position 23 has no query (nothing is folded in there, and
    the steps after it still are). heavy 20 (budget 27 > context 20): nothing is evicted before the cache
    holds the budget, then exactly the budget."""
    t = logit_only_trace()
    spec = Spec(sink=2, recent=5, heavy=heavy, scorer="h2o", h2o_normalized=normalized)
    positions = list(range(t.context_len, t.n_positions))
    got = keep_masks(t, spec, 0, positions)
    np.testing.assert_array_equal(got, h2o_reference(t, spec, 0, positions, normalized))
    for i, p in enumerate(positions):
        assert (got[i].sum(axis=1) == min(spec.budget, p + 1)).all()
    assert keep_masks(t, spec, 0, []).shape == (0, t.n_kv_heads, t.n_positions)


def test_no_eviction_keeps_exactly_the_tokens_a_query_sees(trace):
    masks = keep_masks(trace, Spec(), 0, [0, 5, trace.context_len + 2])
    for i, p in enumerate([0, 5, trace.context_len + 2]):
        assert (masks[i] == (np.arange(trace.n_positions) <= p)).all()


def test_a_decision_shared_by_four_kv_heads_is_taken_for_each():
    """StreamingLLM (position only, one decision for every head) on 4 KV heads, before and after the
    compression point: each head keeps the 2 sinks and the last recent + heavy = 14 tokens the query sees."""
    t = make_synthetic(SMALL.with_(kv_heads=4, q_heads=4))
    positions = [30, t.context_len - 1, t.context_len + 4]
    masks = keep_masks(t, Spec(sink=2, recent=4, heavy=10, scorer="streaming"), 0, positions)
    for i, p in enumerate(positions):
        want = np.zeros(t.n_positions, bool)
        want[:2] = want[p - 13 : p + 1] = True
        assert (masks[i] == want).all(), p


def test_one_shot_policy_with_its_own_kept_set_grows_by_hand():
    """A one-shot policy whose compression-time kept set is its own (as ChunkKV's whole chunks): a query
    before the point sees its part of that set; later tokens join, and past the budget the lowest score
    outside sink and window goes, the later token on a tie (as `select` keeps the earlier). Sink 1, recent 2,
    heavy 2 (budget 5), context 6, kept {0, 2, 4, 5} / {0, 3, 4, 5}, later tokens unscored (-inf):
    p 6: 5 tokens, none goes; p 7: head 0 drops 4 (score 1 < 2, 3), head 1 the later of the tie 3 = 4 (4);
    p 8: 6 (-inf) goes; p 9: 7 goes."""
    from kvviz import Trace
    from kvviz.policies import Policy, ScoreContext

    scores = np.full((2, 10), -np.inf)
    scores[0, :6] = [9, 0, 3, 0, 1, 2]
    scores[1, :6] = [9, 0, 0, 1, 1, 2]

    class OwnSet(Policy):
        name = "test-own-kept-set"

        def score(self, ctx):
            return scores

        def compression_kept(self, s, spec):
            own = np.zeros((2, 6), bool)
            own[0, [0, 2, 4, 5]] = own[1, [0, 3, 4, 5]] = True
            return own

    z = np.zeros((1, 2, 10, 4), np.float32)
    t = Trace(
        q=z,
        k=z,
        v=None,
        context_len=6,
        tokens=tuple("abcdefghij"),
        query_positions=np.arange(10),
        meta={"source": "test"},
    )
    positions = [9, 2, 6, 7, 8, 5]
    got = OwnSet().keep_masks(ScoreContext(t, 0, Spec(sink=1, recent=2, heavy=2)), positions)
    want = {
        2: [[0, 2], [0]],
        5: [[0, 2, 4, 5], [0, 3, 4, 5]],
        6: [[0, 2, 4, 5, 6], [0, 3, 4, 5, 6]],
        7: [[0, 2, 5, 6, 7], [0, 3, 5, 6, 7]],
        8: [[0, 2, 5, 7, 8], [0, 3, 5, 7, 8]],
        9: [[0, 2, 5, 8, 9], [0, 3, 5, 8, 9]],
    }
    for i, p in enumerate(positions):
        assert [np.flatnonzero(r).tolist() for r in got[i]] == want[p], p


def test_arrival_scores_and_the_budget_claim_of_the_shared_rule():
    """A token arriving after the compression point: +inf for a streaming policy (not evicted before a
    query has scored it), -inf for a one-shot one (kept only while in the window), one per KV head. The
    policies on the shared rule say they fill the budget, and their masks hold min(budget, tokens)."""
    from kvviz.policies import POLICIES

    key = np.ones((3, 8))
    assert POLICIES["h2o"].arrival_score(key, 0, 10, Spec()).tolist() == [np.inf] * 3
    assert POLICIES["snapkv"].arrival_score(key, 0, 10, Spec()).tolist() == [-np.inf] * 3
    t = make_synthetic(SMALL)
    for scorer in ("h2o", "tova", "snapkv", "streaming", "knorm"):
        spec = Spec(sink=2, recent=4, heavy=9, scorer=scorer)
        assert POLICIES[scorer].fills_budget(spec), scorer
        masks = keep_masks(t, spec, 1, [t.context_len - 1, t.n_positions - 1])
        assert (masks.sum(axis=2) == 15).all(), scorer


def test_arrival_scores_of_the_query_free_scorers_are_what_score_gives_that_key():
    """The decode cache scores an arriving token with arrival_score: KNorm the negated L2 norm of its key
    and StreamingLLM its position, the values `score` gives the same token of a trace, one per KV head."""
    from kvviz.policies import POLICIES, ScoreContext

    t = make_synthetic(SMALL)
    p = t.n_positions - 1
    key = t.k[1, :, p]  # (kv_heads, head_dim)
    ctx = ScoreContext(t, 1, Spec())
    knorm = POLICIES["knorm"].arrival_score(key, 1, p, Spec())
    np.testing.assert_allclose(knorm, -np.linalg.norm(key.astype(np.float64), axis=-1), rtol=1e-6)
    np.testing.assert_array_equal(knorm, POLICIES["knorm"].score(ctx)[:, p])
    streaming = POLICIES["streaming"].arrival_score(key, 1, p, Spec())
    assert streaming.tolist() == [float(p)] * t.n_kv_heads == POLICIES["streaming"].score(ctx)[:, p].tolist()


def test_random_scores_are_uniform_draws_fixed_by_seed_layer_and_position():
    """The random baseline: a fresh uniform draw in [0, 1) for every head and token, the same for the same
    seed (a run is reproducible, an ensemble over seeds is not one draw repeated), another for another
    seed or layer; an arriving token's draw is fixed by seed, layer and position, one per KV head."""
    from kvviz.policies import POLICIES, ScoreContext

    t = make_synthetic(SMALL)
    rand = POLICIES["random"]
    scores = rand.score(ScoreContext(t, 0, Spec(seed=3)))  # (kv_heads, positions)
    assert scores.shape == (t.n_kv_heads, t.n_positions)
    assert scores.min() >= 0 and scores.max() < 1 and len(np.unique(scores)) == scores.size
    np.testing.assert_array_equal(scores, rand.score(ScoreContext(t, 0, Spec(seed=3))))
    assert (scores != rand.score(ScoreContext(t, 0, Spec(seed=4)))).all()
    assert (scores != rand.score(ScoreContext(t, 1, Spec(seed=3)))).all()
    key = np.ones((3, 8))  # (kv_heads, head_dim)
    arrival = rand.arrival_score(key, 1, 10, Spec(seed=3))
    assert arrival.shape == (3,) and arrival.min() >= 0 and arrival.max() < 1 and len(set(arrival)) == 3
    np.testing.assert_array_equal(arrival, rand.arrival_score(key, 1, 10, Spec(seed=3)))
    for other in (
        rand.arrival_score(key, 1, 11, Spec(seed=3)),
        rand.arrival_score(key, 0, 10, Spec(seed=3)),
        rand.arrival_score(key, 1, 10, Spec(seed=4)),
    ):
        assert (other != arrival).all()


def test_the_oracle_has_no_compression_time_score():
    from kvviz.policies import POLICIES, ScoreContext

    t = make_synthetic(SMALL)
    with pytest.raises(TypeError, match="^the oracle is scored per evaluated query: use query_scores$"):
        POLICIES["oracle"].score(ScoreContext(t, 0, Spec(scorer="oracle")))


def tova_reference(trace, spec, layer, positions):
    """TOVA from its definition, with plain loops: the last query's attention averaged over every query
    head ranks the tokens, one decision for all KV heads; a token arrives unscored (+inf), the cache drops
    its lowest scorer outside the sinks and the recent window (ties: the earlier), and each later query's
    attention over what is kept, averaged over the heads, replaces the scores."""
    c, P, heads = trace.context_len, trace.n_positions, range(trace.n_q_heads)
    ctx_rows = [i for i, p in enumerate(trace.query_positions) if p < c]
    later = {int(p): i for i, p in enumerate(trace.query_positions) if p >= c}
    score = np.mean([causal_attention(trace, layer, h, ctx_rows[-1:], P)[0] for h in heads], axis=0)  # (P,)
    ranked = sorted(range(spec.sink, c - spec.recent), key=lambda i: (-score[i], i))
    kept = sorted(set(range(spec.sink)) | set(range(c - spec.recent, c)) | set(ranked[: spec.heavy]))
    out = np.zeros((len(positions), trace.n_kv_heads, P), bool)
    for p in range(c, max(positions) + 1):
        kept.append(p)
        score[p] = np.inf
        if len(kept) > spec.budget:
            free = [i for i in kept if spec.sink <= i <= p - spec.recent]
            kept.remove(min(free, key=lambda i: (score[i], i)))
        if p in positions:
            out[positions.index(p), :, kept] = True
        if p in later:
            ks = np.array(kept)
            attn = []
            for h in heads:
                logits = query_logits(trace, layer, h, later[p], ks)
                attn.append(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())
            score[ks] = np.mean(attn, axis=0)
    return out


def test_tova_later_steps_follow_its_definition(trace):
    """Every later query re-scores the kept tokens by its own attention averaged over all heads, and the
    next eviction follows those scores (not the compression point's, not one value shared by every token)."""
    spec = Spec(sink=2, recent=6, heavy=9, scorer="tova")
    positions = [int(p) for p in trace.query_positions[trace.later_queries]]
    for layer in range(trace.n_layers):
        np.testing.assert_array_equal(
            keep_masks(trace, spec, layer, positions), tova_reference(trace, spec, layer, positions)
        )


def test_a_streaming_plugin_under_adakv_and_a_one_shot_policy_asked_per_query_are_refused():
    """Spec refuses AdaKV for the built-in streaming scorers by name; a plug-in that decides at every step
    is refused where its masks are made, with the reason. A policy scored at the compression point has no
    per-query scores."""
    from kvviz.policies import POLICIES, Policy, ScoreContext
    from kvviz.policies.allocation import allocation_for

    class EveryStep(Policy):
        name = "test-every-step"
        streaming = True

        def score(self, ctx):
            return np.zeros((ctx.trace.n_kv_heads, ctx.n_positions))

    t = make_synthetic(SMALL)
    ctx = ScoreContext(t, 0, Spec(sink=1, recent=2, heavy=3, scorer="knorm", allocation="adakv"))
    with pytest.raises(SpecError, match="AdaKV allocates once from one-shot scores; test-every-step decides at"):
        allocation_for(ctx.spec).keep_masks(EveryStep(), ctx, [t.n_positions - 1])
    with pytest.raises(TypeError, match="h2o scores at the compression point: use score"):
        POLICIES["h2o"].query_scores(np.ones((4, 5)), ctx)
