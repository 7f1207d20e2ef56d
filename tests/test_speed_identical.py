"""Making the scorers fast must not move a single kept set.

`tests/data/kept_masks_reference.npz` holds the kept masks of every scorer, under several
settings and allocations, on four small traces (GQA 4, GQA 2, RoPE, logit-only), recorded
with the code *before* the speed work (commit 40b491e) by

    python tests/test_speed_identical.py --record

Each entry is the packed bits (np.packbits) of the kept (read, for the oracle and Quest)
masks of every layer at three evaluated queries (first, middle, last), concatenated; no
pickle. The test recomputes them with today's code and asks for exact equality.

Four default rules were later changed on purpose, to kvpress's / the paper's (AdaKV's safeguard,
PyramidKV's schedule, ChunkKV's chunk count, Quest per query head). Only the entries those rules
decide were re-recorded (`--record-changed RULE`); each one's value under the old rule is kept as
"pre24|<label>", and the options that name the old rules (`PRE24`) must still reproduce it bit
for bit. Every other entry is the recording from before the speed work, untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvviz import Spec, Trace
from kvviz.engine import kept_at_query
from kvviz.policies.base import _SCORE_CACHE
from kvviz.sources.handbook import handbook_trace
from kvviz.sources.synthetic import PRESETS, SyntheticSpec, make_synthetic
from kvviz.spec import SCORERS

from trace_util import every_query_trace

REFERENCE = Path(__file__).parent / "data" / "kept_masks_reference.npz"
# the scorers that existed before the speed work (a scorer added since has no older code to match)
with np.load(REFERENCE, allow_pickle=False) as _data:
    RECORDED = sorted({key.removeprefix("pre24|").split("|")[1] for key in _data.files})


def rope_trace(seed=5, L=2, Hq=8, Hkv=2, D=32, c=250, steps=6) -> Trace:
    """Random q / k / v with RoPE frequencies in the meta: Expected Attention's rotation path."""
    rng = np.random.default_rng(seed)
    P = c + steps
    q = rng.standard_normal((L, Hq, P, D)).astype(np.float32)
    k = rng.standard_normal((L, Hkv, P, D)).astype(np.float32)
    k[..., 3] += 2.0 * rng.standard_normal((L, Hkv, 1)).astype(np.float32)
    v = (rng.standard_normal((L, Hkv, P, D)) * rng.uniform(0.5, 2, (L, Hkv, P, 1))).astype(np.float32)
    meta = {"source": "test", "rope_inv_freq": (1.0 / 100.0 ** (np.arange(0, D, 2) / D)).tolist()}
    return every_query_trace(q, k, v, c, meta)


def traces() -> dict[str, Trace]:
    return {
        "gqa4": make_synthetic(
            SyntheticSpec(context=600, steps=8, layers=2, q_heads=8, kv_heads=2, head_dim=64, seed=1)
        ),
        "gqa2": make_synthetic(
            PRESETS["diffuse"].with_(context=333, steps=5, layers=2, q_heads=6, kv_heads=3, head_dim=48, seed=2)
        ),
        "rope": rope_trace(),
        "handbook": handbook_trace(),
    }


def scorer_settings(scorer: str) -> list[dict]:
    return {
        "h2o": [dict(h2o_normalized=False), dict(h2o_normalized=True)],
        "snapkv": [dict(), dict(snapkv_window=8), dict(snapkv_kernel=3)],
        "random": [dict(seed=0), dict(seed=3)],
        "expected_attention": [dict(), dict(ea_horizon=7, ea_covariance=False), dict(ea_horizon=1)],
        "chunkkv": [
            dict(),
            dict(chunk_size=7),
            dict(chunk_size=16, chunk_scorer="h2o"),
            dict(chunk_size=5, chunk_scorer="expected_attention"),
            dict(chunk_size=9, chunk_scorer="keydiff"),
        ],
        "quest": [dict(), dict(page_size=5)],
    }.get(scorer, [dict()])


def cases():
    """(label, trace name, spec) for every scorer x setting x budget x allocation the spec allows."""
    out = []
    for name in ("gqa4", "gqa2", "rope", "handbook"):
        for scorer in SCORERS:
            for settings in scorer_settings(scorer):
                for b, budget in enumerate(("tenth", "quarter")):
                    for allocation in ("uniform", "pyramid", "adakv"):
                        label = f"{name}|{scorer}|{sorted(settings.items())}|{budget}|{allocation}"
                        out.append((label, name, scorer, settings, budget, allocation))
    return out


# the four changed rules: which cases each decides, and the option that restores the old rule
PRE24 = {
    "adakv": (lambda scorer, allocation: allocation == "adakv", dict(adakv_floor="outside-window")),
    "pyramid": (lambda scorer, allocation: allocation == "pyramid", dict(pyramid_schedule="heavy")),
    "chunkkv": (lambda scorer, allocation: scorer == "chunkkv", dict(chunk_rule="budget")),
    "quest": (lambda scorer, allocation: scorer == "quest", dict(quest_heads="kv")),
}


def pre24_options(scorer: str, allocation: str) -> dict:
    """The options under which a case runs under the old rules ({} where no changed rule applies)."""
    out = {}
    for applies, options in PRE24.values():
        if applies(scorer, allocation):
            out.update(options)
    return out


def make_spec(trace: Trace, scorer, settings, budget, allocation) -> Spec:
    n = trace.context_len
    if budget == "tenth":
        sizes = dict(sink=4, recent=max(n // 10, 8), heavy=max(n // 10, 1))
    else:
        sizes = dict(sink=2, recent=max(n // 8, 8), heavy=max(n // 4, 1))
    return Spec(scorer=scorer, allocation=allocation, **sizes, **settings)


def masks(trace: Trace, spec: Spec) -> np.ndarray:
    """Packed bits of the kept masks of every layer at the first, middle and last evaluated query."""
    evaluated = trace.evaluated_queries
    picks = sorted({int(evaluated[0]), int(evaluated[len(evaluated) // 2]), int(evaluated[-1])})
    bits = [kept_at_query(trace, spec, layer, qi).ravel() for layer in range(trace.n_layers) for qi in picks]
    return np.packbits(np.concatenate(bits))


def compute_all() -> dict[str, np.ndarray]:
    from kvviz.spec import SpecError

    ts = traces()
    out = {}
    for label, name, scorer, settings, budget, allocation in cases():
        trace = ts[name]
        try:
            spec = make_spec(trace, scorer, settings, budget, allocation)
            out[label] = masks(trace, spec)
        except SpecError:
            continue  # a combination the spec refuses (AdaKV with a streaming scorer, ...)
    return out


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def trace_set():
    return traces()


def test_every_recorded_scorer_is_still_there():
    assert len(RECORDED) >= 10 and set(RECORDED) <= set(SCORERS)


@pytest.mark.parametrize("scorer", RECORDED)
def test_kept_masks_match_the_code_before_the_speed_work(scorer, reference, trace_set):
    from kvviz.spec import SpecError

    checked = 0
    for label, name, s, settings, budget, allocation in cases():
        if s != scorer:
            continue
        trace = trace_set[name]
        try:
            spec = make_spec(trace, s, settings, budget, allocation)
        except SpecError:
            assert label not in reference
            continue
        _SCORE_CACHE.clear()
        got = masks(trace, spec)
        assert label in reference, f"no reference for {label}"
        assert np.array_equal(got, reference[label]), f"kept set changed: {label}"
        _SCORE_CACHE.clear()  # and through a warm cache (a sweep's second budget)
        masks(trace, spec.with_(heavy=spec.heavy + 1))
        assert np.array_equal(masks(trace, spec), reference[label]), f"kept set changed (cached): {label}"
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("rule", sorted(PRE24))
def test_the_options_named_after_the_old_rules_reproduce_them(rule, reference, trace_set):
    """adakv_floor="outside-window", pyramid_schedule="heavy", chunk_rule="budget", quest_heads="kv":
    the kept sets under the old rules, bit for bit, wherever the changed rules moved the default."""
    from kvviz.spec import SpecError

    applies, _ = PRE24[rule]
    checked = 0
    for label, name, scorer, settings, budget, allocation in cases():
        if not applies(scorer, allocation) or f"pre24|{label}" not in reference:
            continue
        trace = trace_set[name]
        try:
            spec = make_spec(trace, scorer, settings, budget, allocation)
        except SpecError:
            continue
        _SCORE_CACHE.clear()
        got = masks(trace, spec.with_(**pre24_options(scorer, allocation)))
        assert np.array_equal(got, reference[f"pre24|{label}"]), f"the old rule changed: {label}"
        checked += 1
    assert checked >= 8


if __name__ == "__main__" and "--record" in sys.argv:
    REFERENCE.parent.mkdir(exist_ok=True)
    recorded = compute_all()
    np.savez_compressed(REFERENCE, **recorded)
    print(f"recorded {len(recorded)} kept-mask sets to {REFERENCE} ({REFERENCE.stat().st_size} bytes)")

if __name__ == "__main__" and "--record-changed" in sys.argv:
    # re-record only the entries a changed rule decides, keeping each old value as "pre24|<label>"
    rule = sys.argv[sys.argv.index("--record-changed") + 1]
    applies, _ = PRE24[rule]
    with np.load(REFERENCE, allow_pickle=False) as data:
        stored = {key: data[key] for key in data.files}
    ts, changed, same = traces(), 0, 0
    for label, name, scorer, settings, budget, allocation in cases():
        if not applies(scorer, allocation) or label not in stored:
            continue
        spec = make_spec(ts[name], scorer, settings, budget, allocation)
        stored.setdefault(f"pre24|{label}", stored[label])
        stored[label] = masks(ts[name], spec)
        changed += not np.array_equal(stored[label], stored[f"pre24|{label}"])
        same += np.array_equal(stored[label], stored[f"pre24|{label}"])
    np.savez_compressed(REFERENCE, **stored)
    print(
        f"{rule}: re-recorded {changed + same} entries ({changed} changed, {same} the same); "
        f"{REFERENCE.stat().st_size} bytes"
    )


def expected_attention_float64(trace: Trace, layer: int, horizon: int) -> np.ndarray:
    """The published rule written out plainly in float64 (the arithmetic of the code before the speed work):
    (kv_heads, c)."""
    from kvviz.policies.expected_attention import mean_rotation, rope_inv_freq, rotate

    c, d, g = trace.context_len, trace.head_dim, trace.group_size
    rows = trace.context_queries[4:]
    q = trace.q[layer][:, rows].astype(np.float64)
    inv_freq = rope_inv_freq(trace)
    if inv_freq is not None:
        q = rotate(q, -trace.query_positions[rows], inv_freq)
    mu = q.mean(axis=1)
    cov = np.einsum("hni,hnj->hij", q - mu[:, None], q - mu[:, None]) / q.shape[1]
    if inv_freq is not None:
        R = mean_rotation(c, horizon, inv_freq)
        mu, cov = mu @ R.T, R @ cov @ R.T
    out = np.zeros((trace.n_kv_heads, c))
    for h in range(trace.n_q_heads):
        K = trace.k[layer, h // g, 4:c].astype(np.float64)
        z = K @ mu[h] / np.sqrt(d) + ((K @ cov[h]) * K).sum(-1) / d / 2
        a = np.exp(z - z.max())
        out[h // g, 4:] += a / a.sum() / g
    out[:, 4:] *= np.linalg.norm(trace.v[layer, :, 4:c].astype(np.float64), axis=-1)
    out[:, :4] = out[:, 4:].max() + 1.0
    return out


@pytest.mark.parametrize("which", ["synthetic", "rope"])
def test_expected_attention_float32_products_keep_the_float64_ranking(which):
    """Expected Attention's d x d products run in float32 (on centred keys): its scores stay within
    2e-6 of the float64 rule and its kept sets are the float64 ones at every budget tried, on a
    1k-token GQA trace with outlier key channels and on a RoPE trace."""
    from kvviz.policies import POLICIES, ScoreContext
    from kvviz.policies.base import select

    trace = (
        make_synthetic(SyntheticSpec(context=1024, steps=2, layers=1, q_heads=8, kv_heads=2, head_dim=64, seed=3))
        if which == "synthetic"
        else rope_trace(c=1024, D=64, L=1)
    )
    c = trace.context_len
    _SCORE_CACHE.clear()
    got = POLICIES["expected_attention"].score(ScoreContext(trace, 0, Spec(scorer="expected_attention")))[:, :c]
    ref = expected_attention_float64(trace, 0, 512)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=0)
    for fraction in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5):
        spec = Spec(sink=4, recent=c // 10, heavy=int(c * fraction))
        assert np.array_equal(select(got, spec), select(ref, spec)), fraction
