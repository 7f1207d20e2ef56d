"""The later scorers against small independent re-computations of their published rules:
Expected Attention, KeyDiff, ChunkKV (whole chunks) and Quest (page reads; all pages = exact)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvviz import Spec, SpecError, View, compare, keep_masks
from kvviz.policies import POLICIES
from kvviz.policies.quest import page_bounds
from kvviz.trace import trace_with

from trace_util import every_query_trace


def random_trace(seed=0, L=2, Hq=4, Hkv=2, D=16, c=48, steps=6, rope=True):
    rng = np.random.default_rng(seed)
    P = c + steps
    q = rng.standard_normal((L, Hq, P, D)).astype(np.float32)
    k = rng.standard_normal((L, Hkv, P, D)).astype(np.float32)
    k[..., 3] += 2.0 * rng.standard_normal((L, Hkv, 1))  # a shared direction: cosines differ
    v = rng.standard_normal((L, Hkv, P, D)).astype(np.float32) * rng.uniform(0.5, 2, (L, Hkv, P, 1)).astype(np.float32)
    meta = {"source": "test"}
    if rope:
        meta["rope_inv_freq"] = (1.0 / 100.0 ** (np.arange(0, D, 2) / D)).tolist()
    return every_query_trace(q, k, v, c, meta)


def heavy_set(kept_row, spec, n):
    return set(np.flatnonzero(kept_row)) - set(range(min(spec.sink, n))) - set(range(n - spec.recent, n))


def top_set(scores, first, end, k):
    order = sorted(range(first, end), key=lambda i: (-scores[i], i))
    return set(order[:k])


# --- Expected Attention ----------------------------------------------------------------------


def rope_matrix(pos, inv_freq):
    """The explicit (d, d) rotate-half RoPE matrix at one position."""
    d = 2 * len(inv_freq)
    R = np.zeros((d, d))
    for i, w in enumerate(inv_freq):
        c, s = np.cos(pos * w), np.sin(pos * w)
        R[i, i], R[i, i + d // 2] = c, -s
        R[i + d // 2, i], R[i + d // 2, i + d // 2] = s, c
    return R


def expected_attention_reference(trace, layer, horizon, covariance=True):
    """kvpress ExpectedAttentionPress written out with explicit rotation matrices, per head. (c,) per KV head.
    Contexts too short for kvpress's rule: the statistics leave out the first 4 queries only when at least
    2 are left (one query has no covariance), and a context of 4 tokens or fewer has no sinks."""
    c, d, g = trace.context_len, trace.head_dim, trace.group_size
    sinks = 4 if c > 4 else 0
    rows = range(4, c) if c > 5 else range(c)
    freq = trace.meta.get("rope_inv_freq")
    rope = (lambda p: rope_matrix(p, np.array(freq))) if freq is not None else (lambda p: np.eye(d))
    Rbar = np.mean([rope(p) for p in range(c, c + horizon)], axis=0)
    out = np.zeros((trace.n_kv_heads, c))
    for h in range(trace.n_q_heads):
        pre = np.array([rope(p).T @ trace.q[layer, h, p].astype(np.float64) for p in rows])
        mu = pre.mean(0)
        cov = (pre - mu).T @ (pre - mu) / len(pre)
        mu, cov = Rbar @ mu, Rbar @ cov @ Rbar.T
        K = trace.k[layer, h // g, sinks:c].astype(np.float64)
        z = K @ mu / np.sqrt(d) + (0.5 / d * np.einsum("ni,ij,nj->n", K, cov, K) if covariance else 0)
        a = np.exp(z - z.max())
        out[h // g, sinks:] += a / a.sum() / g
    out[:, sinks:] *= np.linalg.norm(trace.v[layer, :, sinks:c].astype(np.float64), axis=-1)
    out[:, :sinks] = out[:, sinks:].max() + 1.0  # kvpress pads the sinks with max + 1
    return out


def score_ea(trace, layer, **settings):
    from kvviz.policies import ScoreContext

    return POLICIES["expected_attention"].score(
        ScoreContext(trace, layer, Spec(scorer="expected_attention", **settings))
    )


@pytest.mark.parametrize("covariance", [True, False])
def test_expected_attention_matches_the_kvpress_rule(covariance):
    trace = random_trace(1)
    spec = Spec(sink=0, recent=4, heavy=12, scorer="expected_attention", ea_horizon=32, ea_covariance=covariance)
    c = trace.context_len
    for layer in (0, 1):  # each layer its own query statistics (cached per layer)
        ref = expected_attention_reference(trace, layer, 32, covariance)
        got = score_ea(trace, layer, ea_horizon=32, ea_covariance=covariance)
        np.testing.assert_allclose(got[:, 4:c], ref[:, 4:], rtol=1e-6, atol=1e-12)
        assert np.all(got[:, :4] == got[:, 4:c].max() + 1.0)  # the first 4 rank first: kvpress's max + 1
        assert np.all(np.isneginf(got[:, c:]))
    kept = keep_masks(trace, spec, 1, [c - 1])[0]
    ref = expected_attention_reference(trace, 1, 32, covariance)
    for h in range(trace.n_kv_heads):
        ranked = np.concatenate([np.full(4, np.inf), ref[h, 4:]])
        assert heavy_set(kept[h], spec, c) == top_set(ranked, 0, c - 4, 12)


@pytest.mark.parametrize("c", [1, 3, 4, 5, 6, 7])
def test_expected_attention_on_contexts_too_short_for_the_sinks(c):
    trace = random_trace(4, c=c)  # 1 to 7 context tokens, 6 later queries
    for layer in (0, 1):
        got = score_ea(trace, layer, ea_horizon=16)
        np.testing.assert_allclose(got[:, :c], expected_attention_reference(trace, layer, 16), rtol=1e-6)


def test_expected_attention_of_a_float16_trace_is_that_of_its_values():
    """A trace file may hold float16 tensors: the key mean and the value norms are taken in float64, so
    the scores are those of the same values in float64."""
    base = random_trace(1)
    half = trace_with(
        base, q=base.q.astype(np.float16), k=(3 * base.k).astype(np.float16), v=(40 * base.v).astype(np.float16)
    )
    c = half.context_len
    for covariance in (False, True):
        got = score_ea(half, 0, ea_horizon=8, ea_covariance=covariance)
        np.testing.assert_allclose(got[:, :c], expected_attention_reference(half, 0, 8, covariance), rtol=1e-5)


@pytest.mark.parametrize(
    "rows",
    [np.arange(40), np.arange(5), np.arange(1), np.array([0, 1, 2, 3, 5, 6, 9, 10, 17, 30]), np.array([2, 4, 7])],
)
def test_query_statistics_are_the_pre_rope_mean_and_covariance_after_the_sinks(rows):
    """query_statistics(rows) against numpy: the queries un-rotated at their own positions, the first 4 left
    out when at least 2 remain; rows in any order of positions (a gather) or a run (a view)."""
    from kvviz.policies.expected_attention import query_statistics

    trace = random_trace(5, c=40)  # a fresh trace: the statistics are cached on it
    used = rows[4:] if len(rows) > 5 else rows
    freq = np.array(trace.meta["rope_inv_freq"])
    for layer in (0, 1):
        mu, cov = query_statistics(trace, layer, rows)  # (Hq, d), (Hq, d, d)
        for h in range(trace.n_q_heads):
            pre = np.array([rope_matrix(p, freq).T @ trace.q[layer, h, p].astype(np.float64) for p in used])
            np.testing.assert_allclose(mu[h], pre.mean(0), rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(cov[h], np.cov(pre.T, bias=True).reshape(cov[h].shape), rtol=1e-5, atol=1e-6)


def test_query_statistics_of_queries_with_a_large_offset_keep_the_mean_and_the_covariance():
    """Real queries have outlier channels far from 0: the float32 estimate of the mean is off by more than
    the spread's own rounding, and the correction (the mean of what is left) must be added back, its square
    taken off the covariance."""
    from kvviz.policies.expected_attention import query_statistics

    rng = np.random.default_rng(8)
    base = random_trace(8, L=1, c=200, rope=False)
    q = base.q.copy()  # (1, 4, 206, 16)
    q[..., :8] = 3000.0 + 0.05 * rng.standard_normal(q[..., :8].shape)  # half the channels: a big offset
    trace = trace_with(base, q=q, context_len=200)
    mu, cov = query_statistics(trace, 0, np.arange(200))
    pre = q[0, :, 4:200].astype(np.float64)  # (4, 196, 16)
    want_mu = pre.mean(1)
    np.testing.assert_allclose(mu, want_mu, rtol=0, atol=2e-6)
    centred = pre - want_mu[:, None]
    want_cov = np.einsum("hni,hnj->hij", centred, centred) / 196
    np.testing.assert_allclose(cov, want_cov, rtol=0, atol=1e-5)
    # the offset channels: the float32 sums of what is centred are exact there, so the covariance is too
    np.testing.assert_allclose(cov[:, :8, :8], want_cov[:, :8, :8], rtol=0, atol=1e-6 * 0.05**2)


def test_expected_attention_softmax_per_head_and_group_with_logits_far_apart():
    """Each (KV head, query head) has its own softmax: one head's logits spanning thousands, another's a few
    units, give each its own finite distribution (no shared or wrong-signed shift that overflows or
    underflows)."""
    from kvviz.policies.expected_attention import expected_attention

    rng = np.random.default_rng(9)
    keys = rng.standard_normal((2, 30, 8))  # (Hkv, n, d)
    keys[1] *= 200.0  # head 1: logits of hundreds to thousands
    mu = rng.standard_normal((2, 2, 8))  # (Hkv, g, d)
    got = expected_attention(keys, mu, None)  # (Hkv, n)
    z = np.einsum("hnd,hgd->hgn", keys, mu) / np.sqrt(8)
    a = np.exp(z - z.max(-1, keepdims=True))
    want = (a / a.sum(-1, keepdims=True)).mean(1)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300)


def test_expected_attention_horizon_matters_only_with_rope():
    with_rope, without = random_trace(2), random_trace(2, rope=False)
    from kvviz.policies import ScoreContext

    ea = POLICIES["expected_attention"]
    a, b = (ea.score(ScoreContext(with_rope, 0, Spec(ea_horizon=h))) for h in (1, 400))
    assert not np.allclose(a[:, :48], b[:, :48])
    a, b = (ea.score(ScoreContext(without, 0, Spec(ea_horizon=h))) for h in (1, 400))
    np.testing.assert_array_equal(a, b)


# --- KeyDiff ----------------------------------------------------------------------------------


def test_keydiff_keeps_the_keys_least_similar_to_the_mean_normalised_key():
    trace = random_trace(3)
    c = trace.context_len
    spec = Spec(sink=2, recent=6, heavy=10, scorer="keydiff")
    kept = keep_masks(trace, spec, 0, [c - 1])[0]
    for h in range(trace.n_kv_heads):
        K = [trace.k[0, h, i].astype(np.float64) for i in range(c)]
        anchor = sum(k / np.linalg.norm(k) for k in K) / c
        dis = [-(k @ anchor) / (np.linalg.norm(k) * np.linalg.norm(anchor)) for k in K]
        assert heavy_set(kept[h], spec, c) == top_set(dis, 2, c - 6, 10)


def keydiff_reference(keys):
    """-cos(k_i, a), a = mean_i k_i / ||k_i||, in float64: keys (kv_heads, c, d) -> (kv_heads, c)."""
    K = keys.astype(np.float64)
    norms = np.linalg.norm(K, axis=-1)  # (kv_heads, c)
    anchor = (K / norms[..., None]).mean(axis=1)  # (kv_heads, d)
    return -np.einsum("hcd,hd->hc", K, anchor) / (norms * np.linalg.norm(anchor, axis=-1)[:, None])


@pytest.mark.parametrize(
    "dtype, scale, rtol", [(np.float64, 1.0, 1e-12), (np.float32, 1e-3, 1e-5), (np.float16, 1.0, 1e-5)]
)
def test_keydiff_scores_are_the_negated_cosine_to_the_anchor(dtype, scale, rtol):
    """The scores themselves, not only their order: float64 keys scored in float64, float16 ones in float32
    (as kvpress, not in float16), short keys (norms under 1) normalised by their own norm; the tokens
    after the compression point get no score."""
    from kvviz.policies import ScoreContext

    trace = random_trace(4)
    k = (trace.k * scale).astype(dtype)  # (L, kv_heads, P, d)
    trace = trace_with(trace, k=k)
    c = trace.context_len
    got = POLICIES["keydiff"].score(ScoreContext(trace, 1, Spec(sink=2, recent=6, heavy=10, scorer="keydiff")))
    np.testing.assert_allclose(got[:, :c], keydiff_reference(k[1, :, :c]), rtol=rtol)
    assert np.isneginf(got[:, c:]).all()


# --- ChunkKV ----------------------------------------------------------------------------------


def test_chunkkv_keeps_whole_top_chunks_by_summed_mean_score():
    trace = random_trace(4, c=60)
    c, C = 60, 5
    spec = Spec(
        sink=0, recent=10, heavy=15, scorer="chunkkv", chunk_size=C, chunk_scorer="keydiff", chunk_rule="budget"
    )
    kept = keep_masks(trace, spec, 1, [c - 1])[0]
    # kvpress: token scores summed over heads, mean per chunk of C, top chunks, kept whole
    K = trace.k[1, :, :c].astype(np.float64)
    unit = K / np.linalg.norm(K, axis=-1, keepdims=True)
    anchor = unit.mean(1, keepdims=True)
    token = -(unit * anchor).sum(-1) / np.linalg.norm(anchor, axis=-1)
    chunk = token.sum(0).reshape(-1, C).mean(1)  # (12,)
    eligible = [j for j in range(len(chunk)) if (j + 1) * C <= c - 10]  # the window's chunks are kept anyway
    best = sorted(eligible, key=lambda j: -chunk[j])[:3]
    want = {i for j in best for i in range(j * C, (j + 1) * C)}
    assert np.array_equal(kept[0], kept[1])  # one decision for every head
    assert heavy_set(kept[0], spec, c) == want


def test_chunkkv_keeps_kvpress_count_of_whole_chunks_and_nothing_else():
    """kvpress ChunkKVPress: int(n_chunks * (1 - ratio)) whole chunks, n(1 - ratio) = budget + 1/2."""
    trace = random_trace(4, c=62)
    c, C = 62, 5  # 12 whole chunks + one of 2 tokens
    spec = Spec(sink=0, recent=10, heavy=15, scorer="chunkkv", chunk_size=C, chunk_scorer="keydiff")
    kept = keep_masks(trace, spec, 1, [c - 1])[0]
    K = trace.k[1, :, :c].astype(np.float64)
    unit = K / np.linalg.norm(K, axis=-1, keepdims=True)
    anchor = unit.mean(1, keepdims=True)
    token = (-(unit * anchor).sum(-1) / np.linalg.norm(anchor, axis=-1)).sum(0)  # summed over heads
    chunks = [token[j : j + C].mean() for j in range(0, c, C)]  # 13 chunks, the last of 2 tokens
    n_keep = int(13 * (25.5 / 62))  # = 5
    best = sorted(range(13), key=lambda j: -chunks[j])[:n_keep]
    want = {i for j in best for i in range(j * C, min((j + 1) * C, c))}
    assert np.array_equal(kept[0], kept[1])
    assert set(np.flatnonzero(kept[0]).tolist()) == want  # no separate window: whole chunks only
    assert kept[0].sum() < spec.budget


def test_chunkkv_pads_snapkv_window_with_max_plus_one():
    """The chunk straddling SnapKV's window scores with its window tokens at max + 1 (kvpress)."""
    trace = random_trace(5, c=80)
    spec = Spec(sink=0, recent=16, heavy=24, scorer="chunkkv", chunk_size=10, chunk_scorer="snapkv", snapkv_window=16)
    from kvviz.policies import get_policy
    from kvviz.policies.base import ScoreContext

    scores = get_policy("chunkkv").score(ScoreContext(trace, 0, spec))[0, :80]
    snap = get_policy("snapkv").score(ScoreContext(trace, 0, spec))[:, :80]
    top = snap[np.isfinite(snap)].max() + 1
    token = np.where(np.isfinite(snap), snap, top).sum(0)
    assert scores[60] == pytest.approx(token[60:70].mean())  # tokens 64..69 are window tokens
    assert scores[79] == pytest.approx(2 * top)


@pytest.mark.parametrize("c, size", [(48, 8), (48, 10), (7, 7), (5, 2)])
def test_chunk_scores_are_the_mean_of_each_chunks_head_summed_token_scores(c, size):
    """Every token carries its chunk's mean of the token scores summed over the KV heads, the last chunk
    shorter where size does not divide c; no warning (a context of whole chunks has no short chunk)."""
    import warnings

    from kvviz.policies.chunkkv import chunk_scores

    token = np.random.default_rng(c + size).standard_normal((2, c + 3))  # (kv_heads, >= c)
    summed = token[:, :c].sum(axis=0)
    want = [summed[j - j % size : j - j % size + size].mean() for j in range(c)]  # (c,) plain slices
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = chunk_scores(token, c, size)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_chunkkv_scores_its_inner_scorers_chunks_and_leaves_arrivals_unscored():
    from kvviz.policies.base import ScoreContext
    from kvviz.policies.chunkkv import chunk_scores

    trace = random_trace(4)
    c = trace.context_len
    spec = Spec(sink=0, recent=6, heavy=10, scorer="chunkkv", chunk_size=5, chunk_scorer="knorm")
    got = POLICIES["chunkkv"].score(ScoreContext(trace, 0, spec))  # (kv_heads, positions)
    knorm = -np.linalg.norm(trace.k[0].astype(np.float64), axis=-1)  # (kv_heads, positions)
    np.testing.assert_allclose(got[:, :c], np.broadcast_to(chunk_scores(knorm, c, 5), (2, c)), rtol=1e-6)
    assert np.isneginf(got[:, c:]).all()  # an arrival has no chunk score


def test_chunkkv_with_nothing_ranked_by_its_inner_scorer_ties_every_chunk():
    """SnapKV's window over the whole context ranks no token: every token is padded alike, so every chunk
    ties (the window then lies in the recent window: the budget holds the whole context)."""
    from kvviz.policies.base import ScoreContext

    trace = random_trace(4)
    c = trace.context_len
    spec = Spec(sink=0, recent=c, heavy=0, scorer="chunkkv", chunk_size=5, chunk_scorer="snapkv", snapkv_window=c)
    scores = POLICIES["chunkkv"].score(ScoreContext(trace, 0, spec))  # (kv_heads, positions)
    assert np.isfinite(scores[:, :c]).all() and len(np.unique(scores[:, :c])) == 1
    assert keep_masks(trace, spec, 0, [c - 1])[0, :, :c].all()


def chunkkv_reference_kept(per_chunk, c, size, budget):
    """kvpress ChunkKVPress: the top max(1, int(n_chunks (1 - ratio))) chunks whole, n_chunks counting a
    short last chunk, n (1 - ratio) = budget + 1/2; ties: the earlier chunk. -> (c,) bool"""
    n_chunks = len(per_chunk)
    keep = max(1, int(n_chunks * (budget + 0.5) / c))
    best = sorted(range(n_chunks), key=lambda j: (-per_chunk[j], j))[:keep]
    return np.array([i // size in best for i in range(c)])


@pytest.mark.parametrize(
    "c, size, budget, per_chunk",
    [
        (48, 10, 29, [0.3, 0.9, 0.1, 0.5, 0.7]),  # 5 chunks, not 4.8: 3 kept, not 2
        (48, 10, 3, [0.3, 0.9, 0.1, 0.5, 0.7]),  # int(...) = 0: still one chunk
        (10, 10, 4, [0.2]),  # one whole chunk: kvpress keeps it
        (80, 2, 20, np.random.default_rng(0).integers(0, 3, 40).astype(float).tolist()),  # 10 of 40, ties
    ],
)
def test_chunkkv_compression_kept_is_kvpress_count_of_top_chunks(c, size, budget, per_chunk):
    spec = Spec(sink=0, recent=min(4, budget), heavy=budget - min(4, budget), scorer="chunkkv", chunk_size=size)
    scores = np.broadcast_to(np.repeat(per_chunk, size)[:c], (2, c))  # every token carries its chunk's
    kept = POLICIES["chunkkv"].compression_kept(scores, spec)  # (kv_heads, c)
    assert kept.dtype == bool and kept.shape == (2, c)
    want = chunkkv_reference_kept(per_chunk, c, size, budget)
    assert kept[0].tolist() == kept[1].tolist() == want.tolist()


# --- Quest ------------------------------------------------------------------------------------


@given(seed=st.integers(0, 10_000), page=st.integers(1, 9), n=st.integers(1, 40))
def test_quest_page_bound_is_an_upper_bound_of_every_key_in_the_page(seed, page, n):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((4, 8)), rng.standard_normal((2, n, 8))
    bound = page_bounds(q, k, page)
    for h in range(4):
        logits = k[h // 2] @ q[h]
        for j in range(bound.shape[1]):
            assert bound[h, j] >= logits[j * page : (j + 1) * page].max() - 1e-12


def test_quest_reading_every_page_is_exact_and_stores_the_whole_cache():
    trace = random_trace(5)
    n = trace.n_positions
    exact = compare(trace, Spec(sink=0, recent=1, heavy=n, scorer="quest"), View(layer=1, head=2))
    assert exact.primary.kept.all()
    np.testing.assert_array_equal(exact.primary.compressed, exact.primary.original)
    np.testing.assert_array_equal(exact.primary.out_compressed, exact.primary.out_original)
    assert exact.metrics["mass_retained"] == pytest.approx(1.0, abs=1e-12)
    part = compare(trace, Spec(sink=0, recent=4, heavy=16, scorer="quest", page_size=8), View(layer=1, head=2))
    assert part.memory.kept_tokens == n  # stored: all of it, plus page min / max
    assert part.memory.kv_bytes > part.memory.kv_bytes_full
    assert part.memory.kv_bytes_read < part.memory.kv_bytes_full  # what it saves: bytes read per step


def test_quest_reads_the_top_pages_by_the_bound_of_the_query():
    trace = random_trace(6)
    spec = Spec(sink=0, recent=1, heavy=16, scorer="quest", page_size=8)
    c = compare(trace, spec, View(layer=0, head=1))
    p, n = c.primary.position, c.primary.position + 1
    g = trace.group_size
    kv = 1 // g
    bounds = []
    for j in range(-(-n // 8)):
        K = trace.k[0, kv, j * 8 : min(n, (j + 1) * 8)].astype(np.float64)
        per_head = [
            np.maximum(trace.q[0, h, p] * K.min(0), trace.q[0, h, p] * K.max(0)).sum()
            for h in range(kv * g, (kv + 1) * g)
        ]
        bounds.append(max(per_head))
    token = np.repeat(bounds, 8)[:n]
    assert heavy_set(c.primary.kept, spec, n) == top_set(token, 0, n - 1, 16)
    assert len(heavy_set(c.primary.kept, spec, n)) == 16


@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_quest_reads_its_pages_from_the_whole_cache_quantized_as_stored(key_axis):
    """Quest stores the whole cache, so its quantization groups run over every stored token (not over
    the pages a head happens to read, as an evicting policy's compacted cache would); each query head
    then reads its own pages of that one quantized cache."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_quant import _reference as reference_quantize  # docs/definitions.md's formulas, a group at a time

    trace = random_trace(8)
    spec = Spec(
        sink=0,
        recent=4,
        heavy=16,
        scorer="quest",
        page_size=8,
        key_bits=3,
        value_bits=3,
        key_axis=key_axis,
        value_axis="token",
        group_size=8,
        residual=0,
    )
    c = compare(trace, spec, View(layer=1, head=0, ensemble="heads", ensemble_size=4))
    p = c.primary.position
    n = p + 1
    reads = [row.kept for row in c.members]
    assert any((a != b).any() for a, b in zip(reads, reads[1:]))  # the heads read different pages
    for row in c.members:
        g = row.head // trace.group_size
        k = trace.k[1, g, :n].astype(np.float64)
        k_hat = reference_quantize(k, 3, key_axis, 8, 0, False)  # the stored cache, whole
        v_hat = reference_quantize(trace.v[1, g, :n].astype(np.float64), 3, "token", 8, 0, False)
        at = np.flatnonzero(row.kept)
        logits = k_hat[at] @ trace.q[1, row.head, p].astype(np.float64) / np.sqrt(trace.head_dim)
        a = np.exp(logits - logits.max())
        a /= a.sum()
        np.testing.assert_allclose(row.compressed[at], a, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(row.out_compressed, a @ v_hat[at], rtol=1e-5, atol=1e-6)
        assert not row.compressed[~row.kept].any()


def test_new_scorers_say_how_they_decide_paper_and_press():
    for name in ("expected_attention", "keydiff", "chunkkv", "quest"):
        p = POLICIES[name]
        assert p.description and p.paper and p.kvpress
    assert POLICIES["quest"].kind == "read" and POLICIES["snapkv"].kind == "evict"


def test_bad_settings_are_refused_with_a_reason():
    with pytest.raises(SpecError, match="chunk size"):
        Spec(scorer="chunkkv", chunk_size=0)
    with pytest.raises(SpecError, match="page size"):
        Spec(scorer="quest", page_size=0)
    with pytest.raises(SpecError, match="horizon"):
        Spec(ea_horizon=0)
    with pytest.raises(SpecError, match="chunk_scorer must be one of"):
        Spec(scorer="chunkkv", chunk_scorer="quest")


def test_expected_attention_on_a_config_only_trace_with_llama3_scaled_rope():
    """A Llama-3-style config (rope_scaling llama3) and no captured frequencies: the frequencies are
    transformers' own (the model's rotary embedding starts with them), and Expected Attention scores
    exactly as on the same trace carrying them."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvviz.policies.base import ScoreContext
    from kvviz.policies.expected_attention import ExpectedAttention, rope_inv_freq

    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    model_freq = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})).inv_freq
    base = random_trace(6, D=16, rope=False)
    only_config = trace_with(base, meta={"source": "test", "config": config})
    got = rope_inv_freq(only_config)
    np.testing.assert_allclose(got, model_freq.double().numpy(), rtol=1e-6)
    unscaled = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    assert not np.allclose(got, unscaled)  # llama3 really rescales the low ones
    carried = trace_with(base, meta={"source": "test", "rope_inv_freq": model_freq.double().numpy().tolist()})
    spec = Spec(heavy=8, scorer="expected_attention")
    a = ExpectedAttention().score(ScoreContext(only_config, 0, spec))
    b = ExpectedAttention().score(ScoreContext(carried, 0, spec))
    np.testing.assert_allclose(a, b, rtol=1e-6)


def config_trace(config):
    """random_trace(6)'s tensors (head_dim 16) with only a model config in the meta, no RoPE frequencies."""
    base = random_trace(6, D=16, rope=False)
    return trace_with(base, meta={"config": config})


@pytest.mark.parametrize(
    "config",
    [
        {"rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},  # transformers 4
        {"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}},
    ],
)  # transformers 5
def test_a_scaled_rope_trace_without_frequencies_is_refused_not_scored_unrotated(monkeypatch, config):
    import re

    import kvviz.models.config as model_config
    from kvviz.policies.expected_attention import rope_inv_freq

    monkeypatch.setattr(model_config, "inv_freq_from_config", lambda config, head_dim: None)  # no transformers
    with pytest.raises(
        SpecError,
        match=re.escape(
            "this trace's model uses a scaled RoPE and carries no RoPE frequencies; Expected Attention needs "
            "transformers installed to compute them from its config"
        ),
    ):
        rope_inv_freq(config_trace(config))


@pytest.mark.parametrize(
    "config",
    [
        {"rope_theta": 1e4},  # transformers 4
        {"rope_theta": 1e4, "rope_scaling": None},
        {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}},  # transformers 5
        {"rope_parameters": {"rope_theta": 1e4}},  # rope_type "default" implied
        {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default"}},
    ],
)  # the top-level theta counts
def test_an_unscaled_rope_from_the_config_is_llamas_own(monkeypatch, config):
    """theta^(-2i/d) for i < d/2 (RoFormer, Llama), computed without transformers."""
    import kvviz.models.config as model_config
    from kvviz.policies.expected_attention import rope_inv_freq

    def refuse(config, head_dim):
        raise AssertionError("an unscaled RoPE needs no transformers")

    monkeypatch.setattr(model_config, "inv_freq_from_config", refuse)
    want = np.array([1e4 ** (-2 * i / 16) for i in range(8)])
    np.testing.assert_allclose(rope_inv_freq(config_trace(config)), want, rtol=1e-14)
    assert rope_inv_freq(config_trace({"hidden_size": 64})) is None  # no RoPE in the config


def test_a_scaled_rope_is_computed_for_the_traces_head_dim(monkeypatch):
    """A config may carry only its RoPE settings: the scaled frequencies are asked for the trace's head_dim
    (transformers' own computation is checked against the model in the llama3 test above)."""
    import kvviz.models.config as model_config
    from kvviz.policies.expected_attention import rope_inv_freq

    asked = []
    monkeypatch.setattr(
        model_config,
        "inv_freq_from_config",
        lambda config, head_dim: asked.append(head_dim) or np.full(head_dim // 2, 0.5),
    )
    config = {"rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    np.testing.assert_array_equal(rope_inv_freq(config_trace(config)), np.full(8, 0.5))
    assert asked == [16]


def test_quest_query_kept_is_the_union_of_each_heads_own_top_pages():
    """Quest per query head through Policy.query_kept (the decode cache's path): a KV head serves the union
    of its query heads' own reads, each head's top 2 pages of 4 by its own bound max(q * k_min, q * k_max)."""
    from kvviz.policies import ScoreContext

    trace = random_trace(7, L=1, Hq=4, Hkv=2, c=20, steps=4)
    spec = Spec(sink=0, recent=1, heavy=8, scorer="quest", page_size=4)
    n = 17
    query, keys = trace.q[0, :, n - 1], trace.k[0, :, :n]
    kept = POLICIES["quest"].query_kept(None, ScoreContext(trace, 0, spec), query=query, keys=keys)
    want = np.zeros((2, n), bool)
    for h in range(4):
        bounds = [
            np.maximum(query[h] * K.min(0), query[h] * K.max(0)).sum()
            for K in (keys[h // 2, j * 4 : min(n, j * 4 + 4)].astype(np.float64) for j in range(5))
        ]
        token = np.repeat(bounds, 4)[:n]
        want[h // 2, n - 1] = True  # the window: the query's own token
        want[h // 2, sorted(top_set(token, 0, n - 1, 8))] = True
    assert kept.shape == (2, n) and (kept == want).all()


@pytest.mark.parametrize(
    "scorer, setting, fills",
    [
        ("quest", {"quest_heads": "kv"}, True),
        ("quest", {"quest_heads": "query"}, False),
        ("chunkkv", {"chunk_rule": "budget"}, True),
        ("chunkkv", {"chunk_rule": "chunks"}, False),
    ],
)
def test_a_policy_says_it_fills_the_budget_where_every_head_holds_exactly_the_budget(scorer, setting, fills):
    """fills_budget lets the memory card count bytes from the budget alone: true for Quest's one choice per
    KV head and ChunkKV's budget rule, where every head holds (reads) min(budget, tokens seen); false for
    Quest per query head (a union of reads) and kvpress's whole chunks, whose counts are their own."""
    from kvviz.engine import kept_at_query

    trace = random_trace(8)
    spec = Spec(sink=1, recent=4, heavy=13, scorer=scorer, page_size=4, chunk_size=5, **setting)
    assert POLICIES[scorer].fills_budget(spec) is fills
    exact = [
        (kept_at_query(trace, spec, layer, qi).sum(axis=1) == min(spec.budget, trace.query_positions[qi] + 1)).all()
        for layer in range(trace.n_layers)
        for qi in trace.evaluated_queries
    ]
    assert all(exact) if fills else not all(exact)


def test_quest_per_query_head_reads_its_layers_pyramid_budget():
    """Under PyramidKV each layer has its own budget, and each query head of that layer reads that many."""
    from kvviz.policies import ScoreContext
    from kvviz.policies.allocation import layer_spec

    trace = random_trace(7, L=3, c=40, steps=2)
    spec = Spec(sink=1, recent=4, heavy=12, scorer="quest", page_size=1, allocation="pyramid", pyramid_schedule="heavy")
    n = trace.n_positions
    query, budgets = trace.q[:, :, n - 1], []
    for layer in range(trace.n_layers):
        reads = POLICIES["quest"].query_reads(
            None, ScoreContext(trace, layer, spec), query=query[layer], keys=trace.k[layer]
        )
        budgets.append(layer_spec(spec, layer, trace.n_layers, trace.context_len).budget)
        assert reads.sum(axis=1).tolist() == [budgets[-1]] * trace.n_q_heads
    assert len(set(budgets)) == trace.n_layers  # the layer really matters


def test_quest_without_the_query_or_the_keys_is_refused_with_the_reason():
    from kvviz.policies import ScoreContext

    trace = random_trace(7)
    ctx = ScoreContext(trace, 0, Spec(sink=1, recent=4, heavy=8, scorer="quest"))
    quest = POLICIES["quest"]
    with pytest.raises(TypeError, match="^Quest picks pages per query: use query_scores$"):
        quest.score(ctx)
    for query, keys in ((None, trace.k[0]), (trace.q[0, :, 10], None), (None, None)):
        with pytest.raises(TypeError, match="^Quest needs the query vectors and the cached keys$"):
            quest.query_reads(None, ctx, query=query, keys=keys)
