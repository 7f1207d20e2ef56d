"""Compressed-cache decoding: a tiny random Llama built in memory (fast, exact checks) and
the bundled SmolLM2-135M (marked `model`, loaded once for the module).

What is asserted: compression off reproduces transformers' own decoding; deleting cache
entries gives the same logits as masking them (ours, and transformers' eager attention
with a 2-D mask with holes and explicit position_ids); the real-model run makes exactly
the decisions the policies' own simulation makes on the same queries; the quantized
cache is exactly kvviz.quant.quantize of what is kept; and on the bundled model the
StreamingLLM and KIVI findings reproduce. (Those two agreements run the same code on both
sides; tests/test_decode_reference.py checks the decode against independent recomputations.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvviz.spec import Spec  # noqa: E402
from kvviz import decode as gen  # noqa: E402
from kvviz.decode.loop import decode, masked_reference_logits, plain_decode  # noqa: E402
from kvviz.decode.quality import evaluate, reference  # noqa: E402
from kvviz.decode.sidebyside import first_divergence, side_by_side  # noqa: E402
from kvviz.policies import ScoreContext, get_policy  # noqa: E402
from kvviz.spec import SpecError  # noqa: E402

from cli_util import run_cli  # noqa: E402
from decode_util import check_every_quantization, two_and_three_bit_spec  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SAMPLE = gen.SAMPLE_TEXT_FILE
ALL_SCORERS = ("h2o", "tova", "snapkv", "streaming", "oracle", "knorm", "random")
# the numbers of a quality evaluation (Quality.as_dict and `kvviz eval --json`)
QUALITY_KEYS = ("perplexity", "perplexity_full", "kl_mean", "kl_max", "top1_agreement", "kv_bytes", "compression_ratio")


# --- a tiny random Llama (the `tiny` fixture, conftest.tiny_llama) ---------------------------------


def test_no_compression_matches_transformers_decoding(tiny):
    model, ids = tiny
    full, _ = plain_decode(model, ids[:30], 20, feed=ids[30:50])
    ours, fed, cache = decode(model, ids[:30], Spec(), 20, feed=ids[30:50])
    assert fed == ids[30:50]
    assert ours.shape == full.shape == (21, 97)
    assert torch.allclose(ours, full, atol=1e-4)
    assert cache.kept_tokens() == 50


def test_greedy_matches_transformers_greedy(tiny):
    model, ids = tiny
    _, fed_plain = plain_decode(model, ids[:20], 12)
    assert gen.greedy(model, ids[:20], Spec(), 13)[:12] == fed_plain


@pytest.mark.parametrize("window", [8, 15])
def test_deleting_equals_masking_equals_transformers_2d_mask(tiny, window):
    """StreamingLLM: sinks + window. Our deleted cache, our masked cache, and transformers'
    own eager attention over the full DynamicCache with a 2-D mask with holes and explicit
    position_ids all give the same logits; and they differ from the full cache."""
    model, ids = tiny
    spec = Spec(sink=4, recent=window, scorer="streaming")
    n, steps = 24, 30
    deleted, _, _ = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps])
    masked, _, _ = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], mode="mask")
    hf = masked_reference_logits(model, ids[: n + steps], n, lambda p: range(4, p + 1 - window))
    full, _ = plain_decode(model, ids[:n], steps, feed=ids[n : n + steps])
    assert torch.allclose(deleted, masked, atol=1e-4)
    assert torch.allclose(deleted, hf, atol=1e-4)
    assert (deleted - full).abs().max() > 1e-2  # eviction really changed something


@pytest.mark.parametrize("scorer", ALL_SCORERS)
def test_every_scorer_deleting_equals_masking(tiny, scorer):
    model, ids = tiny
    spec = Spec(sink=2, recent=6, heavy=6, scorer=scorer)
    deleted, _, c1 = decode(model, ids[:24], spec, 20, feed=ids[24:44])
    masked, _, c2 = decode(model, ids[:24], spec, 20, feed=ids[24:44], mode="mask")
    assert torch.allclose(deleted, masked, atol=1e-4)
    assert c1.kept_tokens() == c2.kept_tokens() == 14
    for a, b in zip(c1.kept, c2.kept):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "scorer, normalized",
    [("h2o", False), ("h2o", True), ("tova", False), ("snapkv", False), ("streaming", False), ("knorm", False)],
)
def test_real_run_makes_the_policies_own_decisions(tiny, scorer, normalized):
    """Replay the run's own queries through Policy.keep_masks: same kept set at every step."""
    model, ids = tiny
    spec = Spec(sink=2, recent=5, heavy=7, scorer=scorer, h2o_normalized=normalized)
    n, steps = 24, 16
    _, _, cache = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], record=True)
    trace = cache.run_trace()
    positions = np.arange(n, n + steps)
    for layer in range(trace.n_layers):
        expected = get_policy(scorer).keep_masks(ScoreContext(trace, layer, spec), positions)
        got = cache.kept_history(layer)
        assert got.shape == expected.shape
        assert np.array_equal(got, expected), f"layer {layer}: run and policy simulation disagree"
    # H2O is streaming: the kept set changes inside the heavy part, not just by the window
    if scorer == "h2o":
        hist = cache.kept_history(0)
        assert (hist.sum(axis=2) == spec.budget).all()


@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "token")])
@pytest.mark.parametrize("scorer", ["h2o", None])
def test_quantized_cache_is_quantize_of_what_is_kept(tiny, monkeypatch, axes, scorer):
    """The incremental quantizer equals kvviz.quant.quantize of the kept K/V at every step."""
    model, ids = tiny
    spec = two_and_three_bit_spec(axes, **(dict(sink=2, recent=5, heavy=6, scorer=scorer) if scorer else {}))
    checked = check_every_quantization(monkeypatch)
    logits, _, _ = decode(model, ids[:20], spec, 25, feed=ids[20:45])
    assert len(checked) == 2 * 2 * 25 and max(checked) > spec.group_size + spec.residual
    checked.clear()
    full, _ = plain_decode(model, ids[:20], 25, feed=ids[20:45])
    assert (logits - full).abs().max() > 1e-3  # 2-bit keys change the logits
    # residual covers everything while the cache is short: no quantization at all
    short = Spec(key_bits=2, value_bits=2, residual=64)
    same, _, _ = decode(model, ids[:20], short, 10, feed=ids[20:30])
    assert torch.allclose(same, full[:11], atol=1e-4)


def test_positions_are_the_original_ones(tiny):
    """With a hole in the cache, feeding the compressed-cache length as the position
    (the Gradio tool's bug) gives different logits from ours, which match transformers."""
    model, ids = tiny
    spec = Spec(sink=4, recent=8, scorer="streaming")
    ours, _, _ = decode(model, ids[:30], spec, 5, feed=ids[30:35])
    hf = masked_reference_logits(model, ids[:35], 30, lambda p: range(4, p + 1 - 8))
    assert torch.allclose(ours, hf, atol=1e-4)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_length_caps_say_what_to_change():
    with pytest.raises(SpecError, match="capped at"):
        gen.check_lengths(10**6, gen.MAX_PROMPT_TOKENS + 1, 10)
    assert gen.check_lengths(10**5, 32_768, 8) == (32_768, 8)  # no 2,048 cap: the model and the budget decide
    with pytest.raises(SpecError, match="nothing is left"):
        gen.check_lengths(50, 50, None)
    with pytest.raises(SpecError, match="continuation is capped"):
        gen.check_lengths(2000, 10, 1000)
    assert gen.check_lengths(100, 40, None) == (40, 60)


def test_noise_model_is_refused_on_a_real_model(tiny):
    model, ids = tiny
    with pytest.raises(SpecError, match="real K/V quantization"):
        decode(model, ids[:10], Spec(quant_model="noise", noise_sigma=0.1), 2)


def test_model_config_restored_after_a_run(tiny):
    model, ids = tiny
    decode(model, ids[:10], Spec(sink=1, recent=3), 3)
    assert model.config._attn_implementation == "eager"


# --- the bundled model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    from apptest_util import load_shared

    model, tokenizer, _ = load_shared("bundled")  # one load per test process
    text = open(SAMPLE).read()
    return model, tokenizer, reference(model, tokenizer, text, 300, 150)


@pytest.mark.model
def test_bundled_sinks_matter(bundled):
    """StreamingLLM's finding: with the same 64-token budget, the last 64 tokens alone are
    far worse than 4 sink tokens + the last 60 (perplexity ratio > 2)."""
    model, _, ref = bundled
    sinks = evaluate(model, ref, Spec(sink=4, recent=60, scorer="streaming"))
    window = evaluate(model, ref, Spec(sink=0, recent=64, scorer="streaming"))
    assert sinks.kept_tokens == window.kept_tokens == 64
    assert sinks.kv_bytes == window.kv_bytes
    assert window.perplexity / sinks.perplexity > 2.0, (window.perplexity, sinks.perplexity)
    assert sinks.perplexity < 2.0 * sinks.perplexity_full
    assert window.kl_mean > sinks.kl_mean and window.top1_agreement < sinks.top1_agreement


@pytest.mark.model
def test_bundled_4bit_beats_2bit_per_token_keys(bundled):
    """No residual: 4-bit K/V stays closer to the full cache than 2-bit per-token keys."""
    # 128 + 48 tokens, not the module's 300 + 150: every decode step quantizes the whole cache of all 30
    # layers (16x the time), and the two are as far apart here (measured, perplexity gap / KL / top-1:
    # 4-bit 0.27 / 0.005 / 0.96, 2-bit 139 / 1.7 / 0.40; at 300 + 150: 0.12 / 0.007 / 0.92 and 82 / 1.7 / 0.29)
    model, tokenizer, _ = bundled
    ref = reference(model, tokenizer, open(SAMPLE).read(), 128, 48)
    four = evaluate(model, ref, Spec(key_bits=4, value_bits=4, residual=0))
    two = evaluate(model, ref, Spec(key_bits=2, value_bits=2, key_axis="token", residual=0))
    gap4 = four.perplexity - four.perplexity_full
    gap2 = two.perplexity - two.perplexity_full
    assert abs(gap4) < gap2, (four.perplexity, two.perplexity, four.perplexity_full)
    assert four.kl_mean < two.kl_mean and four.top1_agreement > two.top1_agreement
    assert two.compression_ratio > four.compression_ratio > 2.5


@pytest.mark.model
def test_bundled_no_compression_is_the_full_cache(bundled):
    model, tokenizer, _ = bundled
    ref = reference(model, tokenizer, open(SAMPLE).read(), 60, 12)
    q = evaluate(model, ref, Spec())
    assert q.perplexity == pytest.approx(q.perplexity_full, rel=1e-4)
    assert q.kl_max < 1e-4 and q.top1_agreement == 1.0 and q.compression_ratio == pytest.approx(1.0)
    d = q.as_dict()
    for key in QUALITY_KEYS:
        assert np.isfinite(d[key])
    # 30 layers x 3 KV heads x 64 dims x K and V x 2 bytes per token
    assert q.kv_bytes_full == 71 * 2 * 2 * 30 * 3 * 64


@pytest.mark.model
def test_bundled_deleting_equals_masking_with_transformers(bundled):
    model, _, ref = bundled
    ids = list(ref.ids[:48])
    spec = Spec(sink=4, recent=16, scorer="streaming")
    ours, _, _ = decode(model, ids[:40], spec, 8, feed=ids[40:48])
    hf = masked_reference_logits(model, ids, 40, lambda p: range(4, p + 1 - 16))
    assert (ours - hf).abs().max() < 1e-3


@pytest.mark.model
def test_bundled_side_by_side(bundled):
    model, tokenizer, _ = bundled
    prompt = "The lighthouse keeper wrote in his log that"
    same = side_by_side(model, tokenizer, prompt, Spec(), max_new_tokens=10)
    assert same.first_divergence is None and same.full_ids == same.compressed_ids
    tiny = side_by_side(model, tokenizer, prompt, Spec(sink=0, recent=2, scorer="streaming"), max_new_tokens=10)
    assert tiny.full_ids == same.full_ids
    # the first token comes from the prefill, before compression: always the same
    assert tiny.compressed_ids[0] == tiny.full_ids[0]
    differ = [i for i, (a, b) in enumerate(zip(tiny.full_ids, tiny.compressed_ids)) if a != b]
    assert differ and tiny.first_divergence == differ[0] >= 1
    assert tiny.full_text == "".join(tokenizer.decode([i]) for i in tiny.full_ids)


def test_other_threads_sharing_the_model_get_the_plain_model(tiny):
    """A Streamlit server shares one model object: a forward pass from another thread in
    the middle of a compressed decode must see the model's own attention, not our cache."""
    import threading

    model, ids = tiny
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([ids[:12]])).logits
    seen = []

    def other():
        with torch.inference_mode():
            seen.append(model(input_ids=torch.tensor([ids[:12]])).logits)

    def on_step(i, _):
        if i == 2:
            t = threading.Thread(target=other)
            t.start()
            t.join()

    compressed, _, _ = decode(model, ids[:20], Spec(sink=2, recent=4), 5, feed=ids[20:25], on_step=on_step)
    assert len(seen) == 1 and torch.allclose(seen[0], expected, atol=1e-5)
    reference_run, _, _ = decode(model, ids[:20], Spec(sink=2, recent=4), 5, feed=ids[20:25])
    assert torch.allclose(compressed, reference_run, atol=1e-6)


# --- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--prompt-tokens", "200000"], "--prompt-tokens: must be 1-131,072, got 200,000"),
        (["eval", "--device", "tpu"], "--device: expected cpu, cuda, cuda:N or mps, got 'tpu'"),
        (["eval", "--device", "cuda:99"], "--device cuda:99: "),
        (["eval-sweep", "--device", "cuda:99"], "--device cuda:99: "),
        (["needle", "--device", "cuda:99"], "--device cuda:99: "),
        (["eval", "--dtype", "float64"], "--dtype: invalid choice: 'float64'"),
        (["eval", "--text-file", "/no/such/file.txt"], "text file not found"),
        (["eval", "--quant-model", "noise"], "noise"),
        (["eval", "--bits", "11"], "bits must be"),
        (["eval-sweep", "--methods", "h2o,bogus"], "unknown method 'bogus'"),
        (["eval-sweep", "--budgets", "4"], "--budgets: '4' in '4': must be 8-1,000,000, got 4"),
        (["eval-sweep", "--budgets", "a,b"], "--budgets: 'a' in 'a,b': expected an integer"),
    ],
)
def test_cli_errors_are_one_line_before_any_model_loads(capsys, monkeypatch, argv, message):
    import kvviz.models

    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    try:  # ranges the parser checks exit through argparse, the rest return 2
        code, out, err = run_cli(capsys, *argv, "--quiet")
    except SystemExit as exc:
        (out, err), code = capsys.readouterr(), exc.code
    assert code == 2 and out == ""
    assert err.startswith("kvviz") and "error:" in err and message in err and err.count("\n") == 1


@pytest.mark.model
def test_cli_eval_json_and_sweep_csv(bundled, capsys, monkeypatch, tmp_path):
    import json

    import kvviz.models

    model, tokenizer, _ = bundled
    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: (model, tokenizer, None))
    code, out, _ = run_cli(
        capsys,
        "eval",
        "--model",
        "bundled",
        "--text-file",
        SAMPLE,
        "--prompt-tokens",
        64,
        "--continuation-tokens",
        12,
        "--sink",
        4,
        "--recent",
        16,
        "--scorer",
        "streaming",
        "--bits",
        4,
        "--greedy",
        4,
        "--json",
        "--quiet",
    )
    assert code == 0
    d = json.loads(out)
    for key in QUALITY_KEYS:
        assert isinstance(d[key], float), key
    assert d["prompt_tokens"] == 64 and d["continuation_tokens"] == 12 and d["kept_tokens"] == 20
    assert len(d["per_token"]["kl"]) == 12 and d["per_token"]["kl"][0] < 1e-6  # token 0: the prefill
    # 75 -> 20 tokens; 4-bit plus a 16-bit scale and 16-bit float offset per group: keys per
    # channel (20 kept tokens < one group of 32: KIVI keeps the partial group at 16 bits), values
    # per token (groups of 32 channels: 4 + 32 / 32 = 5 bits a value)
    assert d["compression_ratio"] == pytest.approx(75 / 20 * 16 / ((16 + 5.0) / 2), rel=1e-6)
    assert set(d["greedy"]) == {"full", "compressed", "first_divergence"}
    csv_path = tmp_path / "sweep.csv"
    code, _, err = run_cli(
        capsys,
        "eval-sweep",
        "--text-file",
        SAMPLE,
        "--prompt-tokens",
        64,
        "--continuation-tokens",
        8,
        "--methods",
        "streaming,recent-only,kv-4bit",
        "--budgets",
        "16,32",
        "--out",
        csv_path,
        "--quiet",
    )
    assert code == 0 and "wrote 5 rows" in err
    import csv

    rows = list(csv.DictReader(open(csv_path)))
    assert [r["method"] for r in rows] == ["streaming", "streaming", "recent-only", "recent-only", "kv-4bit"]
    assert float(rows[0]["memory_ratio"]) < float(rows[1]["memory_ratio"]) < 1.0


def test_rerotated_keys_give_the_logits_of_cache_slot_positions(tiny):
    """StreamingLLM's re-rotation: with keys held at their true positions, rotating each by
    (slot_k - slot_q) - (i - p) must give exactly the logits of RoPE applied at the slots.
    Checked against transformers' own rotary embedding, not our rotation."""
    from transformers.models.llama.modeling_llama import rotate_half

    from kvviz.decode.cache import CompressedCache
    from kvviz.models.config import rope_inv_freq

    model, _ = tiny
    rope = model.model.rotary_emb
    H, D, p = 2, model.config.hidden_size // model.config.num_attention_heads, 12
    kept = np.array([[0, 1, 5, 9, 10, 11, 12], [0, 2, 5, 8, 10, 11, 12]])
    m = kept.shape[1]
    g = torch.Generator().manual_seed(3)
    k_raw, q_raw = torch.randn(H, m, D, generator=g), torch.randn(H, D, generator=g)

    def at(x, positions):  # RoPE of x (H, n, D) at positions (H, n)
        cos, sin = rope(x, torch.as_tensor(positions))
        return x * cos + rotate_half(x) * sin

    k_true = at(k_raw, kept)
    q_true = at(q_raw[:, None], np.full((H, 1), p))[:, 0]
    cache = CompressedCache(
        Spec(sink=1, recent=4, heavy=2, positions="cache"), 1, H, H, D, capacity=16, inv_freq=rope_inv_freq(model)
    )
    ours = (q_true[:, None] * cache._rerotated(k_true, kept, p)).sum(-1)
    k_slot = at(k_raw, np.tile(np.arange(m), (H, 1)))
    q_slot = at(q_raw[:, None], np.full((H, 1), m - 1))[:, 0]
    assert torch.allclose(ours, (q_slot[:, None] * k_slot).sum(-1), atol=1e-5)


def test_rerotation_changes_nothing_without_eviction_and_something_with_it(tiny):
    model, ids = tiny
    true, _, _ = decode(model, ids[:20], Spec(), 10, feed=ids[20:30])
    slots, _, _ = decode(model, ids[:20], Spec(positions="cache"), 10, feed=ids[20:30])
    assert torch.allclose(true, slots, atol=1e-5)  # every slot is the true position
    spec = Spec(sink=2, recent=6, scorer="streaming")
    a, _, _ = decode(model, ids[:20], spec, 10, feed=ids[20:30])
    b, _, _ = decode(model, ids[:20], spec.with_(positions="cache"), 10, feed=ids[20:30])
    assert (a - b).abs().max() > 1e-3
    assert "keys re-rotated to cache slots" in spec.with_(positions="cache").label()
    with pytest.raises(SpecError, match="real-model"):
        from kvviz import compare
        from kvviz.sources.handbook import handbook_trace

        compare(handbook_trace(), Spec(positions="cache"))
