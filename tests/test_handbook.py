"""The handbook's worked example, reproduced bit for bit (tolerance 1e-12)."""

import numpy as np
import pytest

from kvviz import Spec, compare
from kvviz.sources.handbook import HEAVY, RECENT, SINK, SIGMA, handbook_trace


def _reference():
    """The handbook's arrays, computed independently with its own recipe (global legacy seed)."""
    state = np.random.get_state()
    try:
        np.random.seed(42)
        logits = np.random.randn(1, 64) * 0.5
        logits[:, :4] += 2.0
        logits[:, -8:] += 1.5
        logits[:, 15] += 1.8
        logits[:, 28] += 2.0
        noise = np.random.randn(64) * 0.01
    finally:
        np.random.set_state(state)

    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    original = softmax(logits)[0]
    noisy = softmax(logits + noise.reshape(1, -1))[0]
    keep = np.zeros(64, dtype=bool)
    keep[:4] = keep[-8:] = True
    keep[[15, 28]] = True
    masked = logits.copy()
    masked[:, ~keep] = -1e9
    evicted = np.where(keep, softmax(masked)[0], 0.0)
    return original, noisy, keep, evicted


@pytest.fixture(scope="module")
def trace():
    return handbook_trace()


def test_original_attention_matches(trace):
    original, *_ = _reference()
    got = compare(trace, Spec()).primary
    np.testing.assert_allclose(got.original, original, rtol=0, atol=1e-12)
    assert np.all(got.compressed == got.original)


def test_noise_model_matches_first_draw(trace):
    _, noisy, _, _ = _reference()
    got = compare(trace, Spec(quant_model="noise", noise_sigma=SIGMA)).primary
    np.testing.assert_allclose(got.compressed, noisy, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scorer", ["h2o", "oracle", "tova"])
def test_eviction_matches(trace, scorer):
    _, _, keep, evicted = _reference()
    got = compare(trace, Spec(sink=SINK, recent=RECENT, heavy=HEAVY, scorer=scorer))
    assert np.flatnonzero(got.primary.kept).tolist() == [0, 1, 2, 3, 15, 28, *range(56, 64)]
    np.testing.assert_array_equal(got.primary.kept, keep)
    np.testing.assert_allclose(got.primary.compressed, evicted, rtol=0, atol=1e-12)
    assert got.metrics["mass_retained"] == pytest.approx(0.63, abs=0.005)
    assert got.notes, "the app must say the evaluated query is part of the history"


def test_realised_keys_reproduce_logits(trace):
    """q . k / sqrt(d) of the realised keys equals the example's logits."""
    logits = (trace.k[0, 0] @ trace.q[0, 0, 0]) / np.sqrt(trace.head_dim)
    np.testing.assert_allclose(logits, trace.logits[0, 0, 0], atol=1e-12)
