"""The policies score a device cache where it lives: only their inputs cross to the host.

kvviz.decode.devtrace's Trace keeps q, k, v as torch tensors (here on each device torch sees: cpu always,
cuda / mps when there; in float32, bfloat16 and float16) and computes what a scorer reads (attention
rows, their sums, key norms) there. Checked against the host path, the numpy Trace of the same values:
the same scores to float32's precision (the bounds of tests/floatbounds.py) and the same kept sets except
where two scores tie within them; a scorer that reads the arrays themselves (Expected Attention) gets the
very same float32 values and gives the very same scores. And the bytes that cross are counted:
SnapKV at N tokens receives (q_heads, N) sums per layer, never the layer's q, k, v.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from floatbounds import gamma, logit_error_bound, softmax_rtol  # noqa: E402

from kvviz.decode.devtrace import Crossing, device_trace  # noqa: E402
from kvviz.decode.place import available_devices, host  # noqa: E402
from kvviz.policies import ScoreContext, get_policy, select  # noqa: E402
from kvviz.spec import Spec  # noqa: E402
from kvviz.trace import Trace  # noqa: E402

DEVICES = ["cpu"] + [d for d in ("cuda", "mps") if any(x.startswith(d) for x in available_devices())]
DTYPES = ("float32", "bfloat16", "float16")
L, HQ, H, D = 2, 4, 2, 16
BUDGET = dict(sink=2, recent=8, heavy=8)
ON_DEVICE = ("snapkv", "h2o", "tova", "knorm", "keydiff", "expected_attention")  # computed in torch there
READ_AS_ARRAYS = ("random", "streaming")  # read nothing
SPECS = {name: Spec(**BUDGET, scorer=name) for name in ON_DEVICE + READ_AS_ARRAYS}
SPECS["snapkv-window"] = Spec(sink=2, recent=16, heavy=8, scorer="snapkv", snapkv_window=12)
SPECS["h2o-mean"] = Spec(**BUDGET, scorer="h2o", h2o_normalized=True)
SPECS["chunkkv"] = Spec(**BUDGET, scorer="chunkkv")


def _tensors(n: int, device: str, dtype: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, HQ, n, D, generator=g) * 1.5
    k = torch.randn(L, H, n, D, generator=g) * 1.5
    k[:, :, :, 3] += 4.0  # an outlier channel, as real keys have
    v = torch.randn(L, H, n, D, generator=g)
    dt = getattr(torch, dtype)
    return q.to(device, dt), k.to(device, dt), v.to(device, dt)


def _traces(n: int, device: str, dtype: str):
    """(host Trace of the values, device Trace of the same tensors, its Crossing)."""
    q, k, v = _tensors(n, device, dtype)
    fields = dict(
        context_len=n, tokens=tuple(f"t{i}" for i in range(n)), query_positions=np.arange(n), meta={"source": "test"}
    )
    crossing = Crossing()
    dev = device_trace(list(q.unbind(0)), list(k.unbind(0)), list(v.unbind(0)), crossing, **fields)
    return Trace(q=host(q), k=host(k), v=host(v), **fields), dev, crossing


def _rtol(trace: Trace) -> float:
    """Relative bound on a score made of float32 attention (a softmax of logits each off by at most their
    bound, summed over at most n rows), or a float32 key norm."""
    n = trace.n_positions
    e = max(
        float(logit_error_bound(trace.q[layer, h], trace.k[layer, h // (HQ // H)]).max())
        for layer in range(L)
        for h in range(HQ)
    )
    return softmax_rtol(e, n) + gamma(n) + gamma(D + 2)


def _same_but_ties(a: np.ndarray, b: np.ndarray, scores: np.ndarray, tol: float) -> None:
    """Kept masks (H, n) equal, except swaps of tokens whose host scores differ by at most tol."""
    for h in range(a.shape[0]):
        only_a, only_b = np.flatnonzero(a[h] & ~b[h]), np.flatnonzero(b[h] & ~a[h])
        assert len(only_a) == len(only_b)
        if len(only_a):
            assert float(scores[h, only_a].max() - scores[h, only_b].min()) <= tol, (h, only_a, only_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPECS))
def test_device_trace_scores_as_the_host_trace(device, dtype, name):
    spec = SPECS[name]
    ref, dev, crossing = _traces(48, device, dtype)
    policy = get_policy(spec.scorer)
    rtol = _rtol(ref)
    for layer in range(L):
        s_ref = np.asarray(policy.score(ScoreContext(ref, layer, spec)), dtype=np.float64)
        s_dev = np.asarray(policy.score(ScoreContext(dev, layer, spec)), dtype=np.float64)
        assert s_ref.shape == s_dev.shape
        assert (np.isfinite(s_ref) == np.isfinite(s_dev)).all()
        if spec.scorer in READ_AS_ARRAYS:  # the same float32 values, the same code
            assert np.array_equal(s_ref, s_dev)
            continue
        fin = np.isfinite(s_ref)
        # Expected Attention: a softmax too, of logits whose float32 quadratic term and statistics (float64
        # here, float32 centred on the host) are off by less than q . k's bound at these sizes
        assert np.abs(s_dev[fin] - s_ref[fin]).max() <= rtol * np.abs(s_ref[fin]).max(), name
        scale = float(np.abs(s_ref[fin]).max())
        _same_but_ties(select(s_ref, spec), select(s_dev, spec), s_ref, 2 * rtol * scale)
    if spec.scorer in ("streaming", "random"):
        assert crossing.bytes == 0  # they read nothing


@pytest.mark.parametrize("device", DEVICES)
def test_what_crosses_is_the_score_inputs_not_q_k_v(device):
    """Bytes sent to the host per compression, exactly: SnapKV and H2O (q_heads, N) float64 sums a layer,
    TOVA the last query's row (q_heads, 1, N) float32, K-norm (kv_heads, N) float32; linear in N where the
    host path's q, k, v were (L, q_heads + 2 kv_heads, N, head_dim) float32."""
    expected = {"snapkv": HQ * 8, "h2o": HQ * 8, "tova": HQ * 4, "knorm": H * 4}  # bytes per layer per token
    for n in (48, 96):
        qkv = L * (HQ + 2 * H) * n * D * 4
        for name, per_token in expected.items():
            _, dev, crossing = _traces(n, device, "bfloat16")
            for layer in range(L):
                get_policy(name).score(ScoreContext(dev, layer, SPECS[name]))
            assert crossing.bytes == L * n * per_token, (name, n, crossing)
            assert crossing.bytes * 8 <= qkv  # 1/8 or less of q, k, v at head_dim 16
        _, dev, crossing = _traces(n, device, "bfloat16")  # KeyDiff: norms and dots (H, N), the anchor (H, D)
        get_policy("keydiff").score(ScoreContext(dev, 0, SPECS["keydiff"]))
        assert crossing.bytes == (2 * H * n + H * D) * 4
        _, dev, crossing = _traces(n, device, "bfloat16")  # Expected Attention: the queries' mean and
        get_policy("expected_attention").score(ScoreContext(dev, 0, SPECS["expected_attention"]))
        # covariance (Hq, D), (Hq, D, D); the expected attention past the 4 sinks and ||v|| (H, N), float64
        assert crossing.bytes == (HQ * D + HQ * D * D + H * (n - 4) + H * n) * 8
    # the window's rows themselves, as a plug-in reading ScoreContext.context_attention gets them
    _, dev, crossing = _traces(96, device, "float32")
    ctx = ScoreContext(dev, 0, SPECS["snapkv"])
    rows = np.arange(96 - 8, 96)
    chunks = list(ctx.context_attention(rows=rows))
    assert crossing.bytes == HQ * len(rows) * 96 * 4 and sum(len(i) for i, _ in chunks) == len(rows)


# --- in a decode run: a half-dtype cache decides as the host path would on its values -------------------


@pytest.fixture(scope="module")
def half_models(tiny):
    import copy

    model, ids = tiny
    return {
        (d, t): copy.deepcopy(model).to(device=d, dtype=getattr(torch, t))
        for d in DEVICES
        for t in ("bfloat16", "float16")
    }, ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "knorm", "keydiff", "expected_attention"])
def test_compression_point_keeps_the_host_paths_choice(half_models, device, dtype, name):
    """A cache off the float32 CPU path scores on its device; its kept sets at the compression point are
    those the host path (a numpy Trace of the cache's own q, k, v) chooses, except float32 ties."""
    from kvviz.decode import decode

    models, ids = half_models
    spec = SPECS[name]
    _, _, cache = decode(models[(device, dtype)], ids[:40], spec, 0, record=True)
    n = cache.n_tokens
    assert not cache.fast and 0 < cache.crossed.bytes
    ref = Trace(
        q=np.stack([host(x) for x in cache.trace.q.layers]),
        k=host(cache.k[:, :, :n]),
        v=host(cache.v[:, :, :n]),
        context_len=n,
        tokens=cache.trace.tokens,
        query_positions=np.arange(n),
        meta=cache.trace.meta,
    )
    rtol = _rtol_decode(ref)
    for layer in range(cache.L):
        s = np.asarray(cache.policy.score(ScoreContext(ref, layer, spec)), dtype=np.float64)
        s = np.broadcast_to(s, (cache.H, n))
        mask = np.zeros((cache.H, n), dtype=bool)
        np.put_along_axis(mask, cache.kept[layer], True, axis=1)
        fin = s[np.isfinite(s)]
        _same_but_ties(select(s, spec), mask, s, 2 * rtol * float(np.abs(fin).max()))


def _rtol_decode(trace: Trace) -> float:
    n, d = trace.n_positions, trace.head_dim
    g = trace.group_size
    e = max(
        float(logit_error_bound(trace.q[layer, h], trace.k[layer, h // g]).max())
        for layer in range(trace.n_layers)
        for h in range(trace.n_q_heads)
    )
    return softmax_rtol(e, n) + gamma(n) + gamma(d + 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_streaming_rows_cross_per_step_without_the_cache(half_models, monkeypatch, device, name):
    """H2O and TOVA fold each step's attention into their scores on the host: per step and layer what
    crosses is that attention (q_heads, kept) and the arriving key (kv_heads, head_dim), never a layer's
    cache (kv_heads, n, head_dim)."""
    import kvviz.decode.cache as cache_mod
    import kvviz.decode.stored as stored_mod
    from kvviz.decode import decode

    models, ids = half_models
    spec = SPECS[name]
    sizes: list[int] = []

    def counting(x):
        if not isinstance(x, np.ndarray):
            sizes.append(int(x.numel()))
        return host(x)

    monkeypatch.setattr(cache_mod, "host", counting)
    monkeypatch.setattr(stored_mod, "host", counting)
    steps = 8
    _, _, cache = decode(models[(device, "bfloat16")], ids[:40], spec, steps, feed=ids[40 : 40 + steps])
    layer_cache = cache.H * cache.n_tokens * cache.D
    assert sizes and max(sizes) < layer_cache / 8
    assert max(sizes) <= max(cache.Hq * spec.budget, cache.H * cache.D)
    assert len(sizes) <= 2 * cache.L * steps  # the rows and the arriving key, per layer and step
