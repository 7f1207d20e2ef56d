"""The real-model decode path with the later scorers (Expected Attention, KeyDiff, ChunkKV, Quest) and the
budget allocations: ragged (AdaKV) and
per-layer (PyramidKV) caches make the same decisions as the engine's simulation of the run."""

import numpy as np
import pytest
import torch

from kvviz import Spec
from kvviz.engine import kept_at_query, keep_masks
from kvviz.decode.loop import decode
from kvviz.policies import get_policy
from kvviz.policies.allocation import layer_spec


def replay(cache, spec, n, steps):
    """The run's kept sets at every decode step vs the engine on the run's own trace."""
    trace = cache.run_trace()
    trace.meta.update(cache.trace.meta)  # the prefill trace's RoPE (Expected Attention)
    positions = np.arange(n, n + steps)
    for layer in range(trace.n_layers):
        if get_policy(spec.scorer).needs_query:
            expected = np.stack(
                [np.pad(kept_at_query(trace, spec, layer, int(p)), ((0, 0), (0, n + steps - p - 1))) for p in positions]
            )
        else:
            expected = keep_masks(trace, spec, layer, positions)
        got = cache.kept_history(layer)
        assert got.shape == expected.shape
        assert np.array_equal(got, expected), f"layer {layer}: run and engine disagree"
    return trace


@pytest.mark.parametrize(
    "scorer,allocation",
    [
        ("snapkv", "adakv"),
        ("knorm", "adakv"),
        ("expected_attention", "adakv"),
        ("oracle", "adakv"),
        ("snapkv", "pyramid"),
        ("h2o", "pyramid"),
        ("keydiff", "uniform"),
        ("chunkkv", "uniform"),
        ("expected_attention", "uniform"),
        ("quest", "uniform"),
        ("quest", "adakv"),
    ],
)
def test_decode_makes_the_engines_decisions(tiny, scorer, allocation):  # noqa: F811
    model, ids = tiny
    spec = Spec(
        sink=2,
        recent=5,
        heavy=7,
        scorer=scorer,
        allocation=allocation,
        pyramid_beta=3,
        chunk_size=3,
        page_size=4,
        adakv_alpha=0.2,
    )
    n, steps = 24, 10
    logits, _, cache = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], record=True)
    assert torch.isfinite(logits).all()
    replay(cache, spec, n, steps)
    hist = [cache.kept_history(layer) for layer in range(2)]
    if allocation == "pyramid":
        b = [layer_spec(spec, layer, 2, n).budget for layer in range(2)]  # kvpress's schedule
        assert [int(h[-1, 0].sum()) for h in hist] == b
    elif scorer == "quest":  # per query head: a KV head serves its group's union (replayed above)
        held = np.stack([h.sum(axis=2) for h in hist])
        assert allocation == "adakv" or ((held >= spec.budget).all() and (held > spec.budget).any())
    elif scorer == "chunkkv":  # whole chunks at the compression point; arrivals fill up to the budget
        assert all((h.sum(axis=2) <= spec.budget).all() for h in hist)
    else:
        assert all((h.sum(axis=2).sum(axis=1) == 2 * spec.budget).all() for h in hist)  # per layer


def test_adakv_heads_hold_different_lengths_and_the_ragged_attention_is_exact(tiny):  # noqa: F811
    """Heads really differ in length; and with the safeguard at 1 (every head its own heavy
    budget) the ragged path keeps the uniform kept sets and gives the uniform cache's logits."""
    model, ids = tiny
    spec = Spec(sink=2, recent=4, heavy=8, scorer="snapkv", allocation="adakv", adakv_alpha=0.0)
    n, steps = 24, 8
    got, _, cache = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], record=True)
    lengths = {len(k) for layer in cache.heads_kept for k in layer}
    assert len(lengths) > 1, "AdaKV gave every head the same budget on this run"
    ref, _, _ = decode(model, ids[:n], spec.with_(allocation="uniform", heavy=200), steps, feed=ids[n : n + steps])
    assert (got - ref).abs().max() > 1e-3  # something was evicted
    even = spec.with_(adakv_alpha=1.0)
    ragged, _, c1 = decode(model, ids[:n], even, steps, feed=ids[n : n + steps])
    uniform, _, c2 = decode(model, ids[:n], even.with_(allocation="uniform"), steps, feed=ids[n : n + steps])
    assert type(c1).__name__ == "RaggedCache" and type(c2).__name__ == "CompressedCache"
    assert torch.allclose(ragged, uniform, atol=1e-5)


def test_quantized_ragged_cache_runs(tiny):  # noqa: F811
    model, ids = tiny
    spec = Spec(
        sink=2,
        recent=4,
        heavy=8,
        scorer="knorm",
        allocation="adakv",
        key_bits=4,
        value_bits=4,
        group_size=4,
        residual=2,
    )
    logits, _, cache = decode(model, ids[:24], spec, 6, feed=ids[24:30])
    assert torch.isfinite(logits).all() and cache.kept_tokens() == spec.budget
    counts = cache.head_counts()  # what the Model lab's memory line counts, head by head
    assert counts.tolist() == [[len(k) for k in heads] for heads in cache.heads_kept]
    assert (counts.sum(axis=1) == 2 * spec.budget).all()
    from kvviz.engine import memory_for

    exact = memory_for(cache.trace, spec, cache.n_tokens, counts).kv_bytes
    assert exact == pytest.approx(
        sum(
            memory_for(cache.trace, spec, cache.n_tokens, np.full_like(counts, k)).kv_bytes / counts.size
            for k in counts.ravel()
        )
    )
