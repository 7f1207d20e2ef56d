"""The real-model decode against independent references, on the tiny random Llama.

`test_generation.py` checks that a run makes the decisions `Policy.keep_masks` makes on the same
queries; both run the policies' own score and update code, so they show two paths agree, not that
either is right. Here the references are written from docs/definitions.md in plain Python and numpy,
from the run's recorded queries and its full-precision keys only:

- streaming H2O: the prefill's causal attention rows, then every step's attention over what the
  cache holds, summed over the query heads of each KV group (or divided by how many queries saw the
  token); at each step the new token arrives and the lowest scorer outside the sinks and the recent
  window leaves, never to return;
- TOVA: the last query's attention averaged over every head, one decision for all heads;
- the oracle: each step's own full attention, top heavy outside sinks and recent (tokens may return);
- the quantized cache: the K and V each step reads equal test_quant's plain loop over docs/definitions.md's
  quantization formulas, applied to the kept tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_quant import _reference as reference_quantize  # docs/definitions.md's formulas, a group at a time

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz.decode.cache import CompressedCache  # noqa: E402
from kvviz.decode.loop import decode  # noqa: E402
from kvviz.spec import Spec  # noqa: E402

from decode_util import two_and_three_bit_spec  # noqa: E402


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _initial_keep(score, c: int, spec: Spec) -> set[int]:
    """docs/definitions.md's rule at the compression point: the first `sink`, the last `recent` of the c prompt
    tokens, and the `heavy` best scorers among the rest (ties: the earlier token)."""
    keep = set(range(min(spec.sink, c))) | set(range(max(0, c - spec.recent), c))
    rest = [i for i in range(c) if i not in keep]
    return keep | set(sorted(rest, key=lambda i: (-score(i), i))[: spec.heavy])


def streaming_reference(trace, layer: int, spec: Spec, scorer: str) -> np.ndarray:
    """Kept sets (steps, kv_heads, positions) of streaming H2O or TOVA, recomputed by brute force."""
    c, n = trace.context_len, trace.n_positions
    Hq, H, D = trace.n_q_heads, trace.n_kv_heads, trace.head_dim
    g = Hq // H
    Q = trace.q[layer].astype(np.float64)  # (Hq, n, D): prompt rows, then the steps
    K = trace.k[layer].astype(np.float64)  # (H, n, D), full precision
    scale = 1.0 / np.sqrt(D)
    received = np.zeros((H, n))  # H2O: attention received, summed over the group
    seen_by = np.zeros(n)  # queries that could see each token
    for t in range(c):  # the prefill: full causal attention
        for h in range(Hq):
            received[h // g, : t + 1] += _softmax(K[h // g, : t + 1] @ Q[h, t] * scale)
        seen_by[: t + 1] += 1
    last = np.mean([_softmax(K[h // g, :c] @ Q[h, c - 1] * scale) for h in range(Hq)], axis=0)
    tova = dict(enumerate(last))  # TOVA: the last query, averaged over heads

    def score(kv: int, i: int) -> float:
        if scorer == "tova":
            return tova[i]
        return received[kv, i] / seen_by[i] if spec.h2o_normalized else received[kv, i]

    if scorer == "tova":  # one decision for every head
        kept = [_initial_keep(lambda i: score(0, i), c, spec)] * H
    else:
        kept = [_initial_keep(lambda i, kv=kv: score(kv, i), c, spec) for kv in range(H)]
    history = np.zeros((n - c, H, n), dtype=bool)
    ever_left: list[set[int]] = [set() for _ in range(H)]
    for p in range(c, n):
        new = []
        for kv in range(H):
            held = set(kept[kv]) | {p}  # the new token arrives, unscored
            if len(held) > spec.budget:
                outside = [i for i in held if spec.sink <= i <= p - spec.recent]
                victim = min(outside, key=lambda i: (score(kv, i), i))  # lowest scorer; ties: the earlier
                held.remove(victim)
                ever_left[kv].add(victim)
            assert not held & ever_left[kv], "an evicted token came back"
            new.append(held)
        kept = new
        for kv in range(H):
            history[p - c, kv, sorted(kept[kv])] = True
        step = {}
        for h in range(Hq):  # this step's query reads what is kept
            idx = sorted(kept[h // g])
            step[h] = (idx, _softmax(K[h // g, idx] @ Q[h, p] * scale))
            received[h // g, idx] += step[h][1]
        seen_by[: p + 1] += 1
        if scorer == "tova":
            idx = step[0][0]
            tova = dict(zip(idx, np.mean([step[h][1] for h in range(Hq)], axis=0)))
    return history


def _run(tiny, spec: Spec, n: int = 24, steps: int = 16):
    model, ids = tiny
    _, _, cache = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], record=True)
    return cache, cache.run_trace()


@pytest.mark.parametrize("scorer, normalized", [("h2o", False), ("h2o", True), ("tova", False)])
def test_streaming_decode_keeps_what_a_brute_force_recomputation_keeps(tiny, scorer, normalized):
    """Caught what the keep_masks comparison missed: H2O scoring by the last step only
    (`scores += step` -> `scores[...] = step`) keeps token 20 over token 3 at step 1 of layer 0."""
    spec = Spec(sink=2, recent=5, heavy=7, scorer=scorer, h2o_normalized=normalized)
    cache, trace = _run(tiny, spec)
    for layer in range(trace.n_layers):
        got = cache.kept_history(layer)
        want = streaming_reference(trace, layer, spec, scorer)
        assert got.shape == want.shape
        for s in range(len(got)):
            assert np.array_equal(got[s], want[s]), (
                f"layer {layer}, step {s}: run keeps {[np.flatnonzero(r).tolist() for r in got[s]]}, "
                f"the recomputation {[np.flatnonzero(r).tolist() for r in want[s]]}"
            )
        assert (got.sum(axis=2) == spec.budget).all()  # over budget from the first step on


def test_oracle_keeps_the_top_of_the_full_attention(tiny):
    """At every step the oracle reads sinks + recent + the heavy tokens with the most of this step's own
    full-precision attention, summed over the query heads of the KV group; evicted tokens may return."""
    spec = Spec(sink=1, recent=3, heavy=4, scorer="oracle")
    cache, trace = _run(tiny, spec, n=20, steps=12)
    c, Hq, H, D = trace.context_len, trace.n_q_heads, trace.n_kv_heads, trace.head_dim
    g, returned = Hq // H, 0
    for layer in range(trace.n_layers):
        Q, K = trace.q[layer].astype(np.float64), trace.k[layer].astype(np.float64)
        got = cache.kept_history(layer)
        for s, p in enumerate(range(c, trace.n_positions)):
            for kv in range(H):
                a = sum(_softmax(K[kv, : p + 1] @ Q[h, p] / np.sqrt(D)) for h in range(kv * g, (kv + 1) * g))
                want = _initial_keep(lambda i: a[i], p + 1, spec)
                assert np.flatnonzero(got[s, kv]).tolist() == sorted(want), (layer, s, kv)
        held = got.astype(int)  # (steps, kv_heads, positions)
        was_held = np.maximum.accumulate(held, axis=0)
        returned += int(((np.diff(held, axis=0) == 1) & (was_held[:-1] == 1)).sum())  # held, dropped, back
    assert returned > 0  # unlike H2O, a token the oracle dropped comes back when a query needs it


@pytest.mark.parametrize(
    "axes, scorer", [(("channel", "token"), "h2o"), (("token", "channel"), None), (("channel", "channel"), "snapkv")]
)
def test_quantized_decode_reads_the_formulas_of_the_kept_tokens(tiny, monkeypatch, axes, scorer):
    """The K and V attention reads at every step, layer and KV head equal docs/definitions.md's min-max formulas
    (test_quant._reference, plain numpy loops) applied to the full-precision kept tokens, the last
    `residual` of them exact."""
    spec = two_and_three_bit_spec(axes, **(dict(sink=2, recent=5, heavy=6, scorer=scorer) if scorer else {}))
    read = []
    original = CompressedCache._kept_kv

    def recording(self, layer, idx):
        K, V = original(self, layer, idx)
        read.append(
            (
                layer,
                idx.copy(),
                K.numpy().copy(),
                V.numpy().copy(),
                self.k[layer].numpy().copy(),
                self.v[layer].numpy().copy(),
            )
        )
        return K, V

    monkeypatch.setattr(CompressedCache, "_kept_kv", recording)
    model, ids = tiny
    decode(model, ids[:20], spec, 25, feed=ids[20:45])
    assert len(read) == 2 * 25
    quantized = 0
    for layer, idx, K, V, k_full, v_full in read:
        for kv in range(idx.shape[0]):
            for got, full, bits, axis in (
                (K, k_full, spec.key_bits, spec.key_axis),
                (V, v_full, spec.value_bits, spec.value_axis),
            ):
                x = full[kv, idx[kv]]
                want = reference_quantize(x, bits, axis, spec.group_size, spec.residual, False)
                np.testing.assert_allclose(got[kv], want, rtol=0, atol=1e-6)
                quantized += int(np.any(want != x))
    assert quantized > len(read)  # most steps' caches were really quantized


def test_quest_decode_reads_its_pages_of_the_whole_cache_quantized_as_stored(tiny, monkeypatch):
    """Quest stores the whole cache: at every step each query head's output is the softmax over its own
    read pages of q . K_hat, times V_hat, where K_hat, V_hat are docs/definitions.md's formulas (test_quant's plain
    loop) applied to every stored token - the same numbers the engine gives a trace
    (test_policies_new.test_quest_reads_its_pages_from_the_whole_cache_quantized_as_stored)."""
    spec = Spec(
        sink=2,
        recent=4,
        heavy=8,
        scorer="quest",
        page_size=4,
        key_bits=3,
        value_bits=3,
        key_axis="channel",
        value_axis="token",
        group_size=4,
        residual=0,
    )
    seen = []
    original = CompressedCache._attend_reads

    def recording(self, layer, q, reads, scaling):
        out = original(self, layer, q, reads, scaling)
        p = reads.shape[1] - 1
        seen.append(
            (
                q[:, 0].numpy().copy(),
                reads.copy(),
                self.k[layer, :, : p + 1].numpy().copy(),
                self.v[layer, :, : p + 1].numpy().copy(),
                float(scaling),
                out[:, 0].numpy().copy(),
                self.group,
            )
        )
        return out

    monkeypatch.setattr(CompressedCache, "_attend_reads", recording)
    model, ids = tiny
    decode(model, ids[:20], spec, 12, feed=ids[20:32])
    assert len(seen) == 2 * 12
    differ = 0
    for q, reads, k, v, scaling, out, group in seen:
        for j in range(len(q)):
            h = j // group
            k_hat = reference_quantize(k[h].astype(np.float64), 3, "channel", 4, 0, False)
            v_hat = reference_quantize(v[h].astype(np.float64), 3, "token", 4, 0, False)
            at = np.flatnonzero(reads[j])
            a = _softmax(k_hat[at] @ q[j].astype(np.float64) * scaling)
            np.testing.assert_allclose(out[j], a @ v_hat[at], rtol=1e-4, atol=1e-5)
            compacted = reference_quantize(k[h, at].astype(np.float64), 3, "channel", 4, 0, False)
            differ += int(not np.allclose(compacted, k_hat[at], atol=1e-6))
    assert differ > 0  # the reads are not whole groups: quantizing them compacted would differ
