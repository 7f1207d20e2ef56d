"""Models whose layers differ: sliding-window layers (Mistral, Gemma 2/3) are recorded with
their window, recomputed as the model computes them, left uncompressed by the policies (as kvpress skips
them), and counted by the memory card and the ledger as what they hold. Hand-made traces, where the maths
gives exact numbers; tiny random-weight models in tests/test_sliding_window_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvviz import Spec, View, compare
from kvviz.analysis.ledger import budget_ledger
from kvviz.analysis.timeline import full_attention, policy_masks
from kvviz.attention import context_rows, logit_rows, softmax, window_masks
from kvviz.cli import main
from kvviz.engine import EVICTED, RECENT, kept_at_query, keep_masks, read_masks
from kvviz.memory import head_bytes, memory_for
from kvviz.sources.tracefile import load_trace, save_trace, trace_from_bytes
from kvviz.trace import Trace, TraceError, trace_with

from trace_util import every_query_trace, save_trace_format_1

D, HKV, HQ, P, W = 16, 2, 4, 40, 8
APP = str(Path(__file__).resolve().parents[1] / "app.py")
TOKEN16 = 2 * 2 * D  # one KV head's K + V of one token at 16 bits


def hand_trace(windows=(None, W, None), context=30, q_zero=False, seed=0) -> Trace:
    """3 layers x 4 query heads (2 KV heads) x 40 positions, head dim 16; `windows` per layer in meta."""
    rng = np.random.default_rng(seed)
    L = len(windows)
    q = rng.standard_normal((L, HQ, P, D)).astype(np.float32)
    if q_zero:
        q[:] = 0.0  # every logit 0: the attention is uniform over what the query sees
    k = rng.standard_normal((L, HKV, P, D)).astype(np.float32)
    v = rng.standard_normal((L, HKV, P, D)).astype(np.float32)
    meta = {"source": "test", "layer_windows": list(windows)}
    return every_query_trace(q, k, v, context, meta)


# --- 1. the trace says each layer's kind and window --------------------------------------------


def test_the_trace_names_each_layers_window_and_kind():
    t = hand_trace()
    assert t.layer_windows == (None, W, None) and t.has_sliding_layers
    assert [t.layer_kind(i) for i in range(3)] == ["full_attention", "sliding_attention", "full_attention"]
    plain = trace_with(t, meta={"source": "older file"})  # a trace without windows: full attention everywhere
    assert plain.layer_windows == (None,) * 3 and not plain.has_sliding_layers


@pytest.mark.parametrize("bad", [[None, 8], [None, 0, None], [None, "8", None], [None, 8.5, None], 8])
def test_a_damaged_window_list_is_refused_in_one_line(bad):
    with pytest.raises(TraceError, match="layer_windows"):
        trace_with(hand_trace(), meta={"layer_windows": bad})


def test_both_file_formats_keep_the_windows(tmp_path):
    t = hand_trace()
    save_trace(t, tmp_path / "two.safetensors")  # format 2: lazy
    lazy = load_trace(tmp_path / "two.safetensors")
    assert lazy.q.lazy and lazy.layer_windows == (None, W, None)
    save_trace_format_1(t, tmp_path / "one.safetensors")
    assert load_trace(tmp_path / "one.safetensors").layer_windows == (None, W, None)
    save_trace_format_1(t, tmp_path / "old.safetensors", meta={"source": "before windows were recorded"})
    assert load_trace(tmp_path / "old.safetensors").layer_windows == (None,) * 3
    save_trace_format_1(t, tmp_path / "bad.safetensors", meta={"layer_windows": [None, -3, None]})
    with pytest.raises(TraceError, match="layer_windows"):
        trace_from_bytes((tmp_path / "bad.safetensors").read_bytes())


# --- 2. the original attention is the model's: the window applied -------------------------------


def test_a_sliding_layer_sees_its_last_w_keys_exactly():
    t = hand_trace(q_zero=True)  # logits all 0: uniform over what each query sees
    for layer, seen in ((0, 40), (1, W)):
        a = softmax(logit_rows(t, layer, np.arange(HQ), 39))  # the query at position 39
        want = np.zeros(40)
        want[40 - seen :] = 1 / seen
        np.testing.assert_allclose(a, np.broadcast_to(want, a.shape), rtol=1e-12, atol=0)
    # a query younger than the window sees every key before it
    np.testing.assert_allclose(softmax(logit_rows(t, 1, [0], 5)), np.full((1, 6), 1 / 6), rtol=1e-12)
    # context_rows (the scorers', the overview's and check_attention's rows): the same window
    for idx, a in context_rows(t, 1, np.arange(HQ), np.arange(P), P):
        for i, p in enumerate(t.query_positions[idx]):
            lo = max(0, p - W + 1)
            np.testing.assert_allclose(a[:, i, lo : p + 1], 1 / (p + 1 - lo), rtol=1e-6)
            assert not a[:, i, :lo].any() and not a[:, i, p + 1 :].any()
    masks = window_masks(t, 1, [3, 39])
    assert masks[0, :, :4].all() and not masks[0, :, 4:].any()
    assert masks[1, :, 32:].all() and not masks[1, :, :32].any()


def test_the_timeline_sees_the_window_too():
    t = hand_trace(q_zero=True)
    a = full_attention(t, 1, 0, np.array([39]))
    want = np.zeros(40)
    want[32:] = 1 / 8
    np.testing.assert_allclose(a[0], want, rtol=1e-12, atol=0)
    kept = policy_masks(t, Spec(sink=1, recent=2, heavy=2), 1, np.array([35, 39]), "h2o", 0, a)
    assert kept[1, 32:].all() and kept[1].sum() == 8 and kept[0, 28:36].all() and kept[0].sum() == 8


# --- 3. policies compress the full-attention layers only ---------------------------------------

SPECS = [
    Spec(sink=2, recent=4, heavy=4, scorer="snapkv"),
    Spec(sink=2, recent=4, heavy=4, scorer="oracle"),
    Spec(sink=2, recent=4, heavy=4, scorer="quest", page_size=4),
    Spec(key_bits=2, value_bits=2),
    Spec(quant_model="noise", noise_sigma=0.5),
    Spec(),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_a_sliding_layer_is_left_as_the_model_runs_it(spec):
    t = hand_trace()
    c = compare(t, spec, View(layer=1, head=3, ensemble="heads", ensemble_size=4))
    assert c.layer_kind == "sliding_attention" and c.layer_window == W
    for row in c.members:
        assert np.array_equal(row.compressed, row.original)  # the model's own attention, bit for bit
        assert np.array_equal(row.kept, np.arange(40) >= 32)
        assert np.array_equal(row.reason, np.where(np.arange(40) >= 32, RECENT, EVICTED))
        np.testing.assert_allclose(row.out_compressed, row.out_original, rtol=0, atol=0)
        m = row.metrics
        assert m.tv_distance == 0 and m.kl == 0 and m.kl_forward == 0 and m.max_abs_error == 0
        # sums over the window's 8 float64 weights: 1 and 0 to the sum's rounding
        assert m.mass_retained == pytest.approx(1, abs=1e-12) and m.js == pytest.approx(0, abs=1e-12)
    assert any("Layer 1 is a sliding-window layer" in n for n in c.notes)
    j = c.to_json()
    assert j["layer_kind"] == "sliding_attention" and j["layer_window"] == W
    for fn in (lambda: kept_at_query(t, spec, 1, 39), lambda: read_masks(t, spec, 1, 39)[::2]):
        assert np.array_equal(fn(), np.broadcast_to(np.arange(40) >= 32, (HKV, 40)))
    assert np.array_equal(keep_masks(t, spec, 1, [39])[0], window_masks(t, 1, [39])[0])


def test_the_full_layers_are_compressed_as_on_a_trace_without_windows():
    t = hand_trace()
    plain = trace_with(t, meta={"source": "test"})
    spec = Spec(sink=2, recent=4, heavy=4, scorer="snapkv", key_bits=4, value_bits=4)
    for layer in (0, 2):
        a, b = (compare(t, spec, View(layer=layer, head=1)), compare(plain, spec, View(layer=layer, head=1)))
        assert a.layer_kind == "full_attention" and a.to_json()["layer_window"] is None
        assert np.array_equal(a.primary.compressed, b.primary.compressed)
        assert a.primary.metrics.tv_distance > 0.01 and a.primary.kept.sum() == 10
        assert not any("sliding" in n for n in a.notes)
    # an ensemble over layers says how many of its members are sliding (their error is zero)
    c = compare(t, spec, View(layer=0, head=1, ensemble="layers", ensemble_size=3))
    assert any("1 of the 3 layers in the ensemble are sliding-window layers" in n for n in c.notes)
    assert np.all(c.members[1].error == 0) and np.any(c.members[0].error != 0)


def test_the_cli_says_the_layers_kind(tmp_path, capsys):
    save_trace(hand_trace(), tmp_path / "t.safetensors")
    window = ["--sink", "2", "--recent", "4", "--heavy", "4"]
    src = str(tmp_path / "t.safetensors")
    assert main(["compare", "--source", src, "--layer", "1", *window]) == 0
    out = capsys.readouterr().out
    assert "layer 1 (sliding window 8)" in out and "note: Layer 1 is a sliding-window layer" in out
    assert main(["compare", "--source", src, "--layer", "2", *window, "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["layer_kind"] == "full_attention" and j["layer_window"] is None and j["layer_number"] == 2


# --- 4. the memory card and the ledger count each layer as what it is --------------------------


def test_memory_counts_a_sliding_layer_as_its_window_at_16_bits():
    t = hand_trace()  # context 30; the last query sees 40 tokens
    spec = Spec(sink=2, recent=4, heavy=4, scorer="snapkv")
    m = compare(t, spec).memory
    # full layers: 10 tokens per KV head; the sliding layer: its 8; all at 16 bits
    assert m.kv_bytes == HKV * (10 + 8 + 10) * TOKEN16 == 3584
    assert m.key_bytes == m.kv_bytes / 2
    # "full" is the model's own cache: 40 tokens on full layers, the window on the sliding one
    assert m.kv_bytes_full == HKV * (40 + 8 + 40) * TOKEN16 == 11264
    # the prefill peak: the 30-token context on full layers, the window on the sliding one
    assert m.peak == HKV * (30 + 8 + 30) * TOKEN16 == 8704
    assert m.kept_per_layer == (10, 8, 10) and m.kept_tokens == 9  # (2*10 + 2*8 + 2*10) / 6 = 9.33
    # early in the context the window is not full yet: min(W, tokens)
    early = memory_for(t, spec, 6)
    assert early.kv_bytes == HKV * (6 + 6 + 6) * TOKEN16 and early.kv_bytes_full == early.kv_bytes


def test_quantization_skips_the_sliding_layer():
    t = hand_trace()
    spec = Spec(key_bits=4, value_bits=4, group_size=8)
    plain = trace_with(t, meta={"source": "test"})
    quantized_layer = HKV * head_bytes(spec, 40, D, HKV, 40, 30)
    assert compare(plain, spec).memory.kv_bytes == 3 * quantized_layer
    assert compare(t, spec).memory.kv_bytes == 2 * quantized_layer + HKV * 8 * TOKEN16
    # KIVI 4-bit, groups of 8 over 40 tokens: K per channel, V per token, each with fp16 scale and zero point
    assert head_bytes(spec, 40, D, HKV, 40, 30) == 2 * (40 * D / 2 + (40 // 8) * D * 4)


def test_quest_stores_the_whole_full_layers_and_the_window_of_the_sliding_one():
    t = hand_trace()
    spec = Spec(sink=2, recent=4, heavy=4, scorer="quest", page_size=4)
    m = compare(t, spec).memory
    meta = 10 * 2 * D * 2  # 40 tokens in pages of 4: min and max keys, 16 bits each
    assert m.kv_bytes == HKV * (2 * (40 * TOKEN16 + meta) + 8 * TOKEN16)
    # reads: each full-layer KV head the pages its query heads chose; the sliding layer its window
    read = [kept_at_query(t, spec, layer, 39).sum(axis=1) for layer in (0, 2)]
    assert np.concatenate(read).min() >= 10
    assert m.bytes_read == sum(int(k) * TOKEN16 + meta for r in read for k in r) + HKV * 8 * TOKEN16


@pytest.mark.parametrize(
    "spec",
    [
        Spec(sink=2, recent=4, heavy=4, scorer="snapkv"),
        Spec(sink=2, recent=4, heavy=4, scorer="quest", page_size=4),
        Spec(key_bits=4, value_bits=4, group_size=8),
        Spec(),
    ],
    ids=lambda s: s.label(),
)
def test_the_ledger_adds_up_to_the_memory_card(spec):
    t = hand_trace()
    ledger, m = budget_ledger(t, spec), compare(t, spec).memory
    tot = ledger.totals
    assert tot["stored_bytes"] == m.kv_bytes and tot["read_bytes"] == m.bytes_read
    assert tot["full_bytes"] == m.kv_bytes_full and tot["prefill_bytes"] == m.kv_bytes_peak
    sliding = [r for r in ledger.rows if r["layer"] == 1]
    assert all(r["kept_tokens"] == r["recent"] == r["declared_tokens"] == 8 for r in sliding)
    assert all(r["stored_bytes"] == r["payload_bytes"] == 8 * TOKEN16 for r in sliding)
    assert any("1 sliding-window layer (window 8)" in n for n in ledger.notes())


def test_a_gemma3_pattern_saves_what_its_full_layers_save():
    """Five sliding layers for each full one (docs/big-models.md's example, at small sizes): a budget equal to
    the window makes the cache (5 W + n) / (6 W) smaller, not n / W."""
    t = hand_trace(windows=(W,) * 5 + (None,))
    m = compare(t, Spec(sink=2, recent=2, heavy=W - 4, scorer="snapkv")).memory
    assert m.kv_bytes == 6 * HKV * W * TOKEN16 and m.kv_bytes_full == (5 * W + 40) * HKV * TOKEN16
    assert m.compression_ratio == (5 * W + 40) / (6 * W)


def test_the_explorer_says_when_the_chosen_layer_is_a_sliding_one(tmp_path, monkeypatch):
    from apptest_util import run_app

    from kvviz.app.cards import card_values

    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path))
    t = hand_trace()
    save_trace(trace_with(t, meta={**t.meta, "source": "model"}), tmp_path / "text.safetensors")
    at = run_app(APP, 120, source="file", sink=2, recent=4, heavy=4, layer=1, head=0)
    assert not at.exception
    assert any("Layer 1 is a sliding-window layer" in i.value for i in at.info)
    spec = Spec(sink=2, recent=4, heavy=4)
    want = card_values(compare(t, spec, View(layer=1, head=0)).metrics)
    got = {m.label: m.value for m in at.metric}
    assert got["KV memory"] == want["KV memory"] and got["TV distance"] == want["TV distance"]
    full = run_app(APP, 120, source="file", sink=2, recent=4, heavy=4, layer=2, head=0)
    assert not any("sliding-window layer" in i.value for i in full.info)
