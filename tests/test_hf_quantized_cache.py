"""kvviz's `hf_quantized_cache` preset against transformers' QuantizedCache.

The published rule (transformers 5.23 cache_utils.QuantizedLayer + optimum-quanto 0.2.7's
MaxOptimizer / quantize_affine, default axis 0): groups of q_group_size consecutive values of the
(batch, heads, tokens, head_dim) cache - q_group_size channels of one token when head_dim is a
multiple of it - each min-max quantized with a float offset; the prompt is quantized whole at
prefill; later tokens wait in a full-precision window that is flushed once it holds
residual_length tokens. The quanto checks (layer by layer, and a whole decode on a tiny Llama)
run when optimum-quanto is installed (requirements-dev.txt pins it; its CPU extension is built
by ninja on first use, a few minutes once); the rule itself is checked without it.

We also check our E4M3 / E5M2 rounding against torch's own float8 casts (round to nearest even).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvviz.quant.formats import hf_quantized_cache, quantize_tensor, residual_at
from kvviz.quant.minifloat import E4M3, E5M2
from kvviz.spec import Spec


def _torch():
    return pytest.importorskip("torch")


def _quanto():
    """optimum-quanto, or skip only the test that needs it (the rule and the float8 checks run without it)."""
    _torch()
    return pytest.importorskip("optimum.quanto")


def test_published_rule_by_hand():
    """One token's 64 channels are one group: 2 bits, min 0, max 63 -> s = 21, x_hat = 21 round(x / 21)."""
    x = np.arange(64, dtype=np.float32).reshape(1, 1, 64)
    out = quantize_tensor(x, hf_quantized_cache(2), "k", residual=0)
    assert np.array_equal(out, (21 * np.round(np.arange(64) / 21)).reshape(1, 1, 64).astype(np.float32))
    # groups of 32 channels: each half has its own min and max
    out = quantize_tensor(x, hf_quantized_cache(4, q_group_size=32), "v", residual=0)
    lo = (31 / 15) * np.round(np.arange(32) / (31 / 15))
    assert np.allclose(out[0, 0], np.concatenate([lo, lo + 32]), atol=1e-5)


def test_preset_differs_from_kivi_where_stated():
    hf = hf_quantized_cache(4)
    assert (hf.key_axis, hf.value_axis, hf.group_size, hf.residual, hf.residual_mode) == (
        "token",
        "token",
        64,
        128,
        "hf",
    )
    with pytest.raises(ValueError, match="nbits 2 or 4"):
        hf_quantized_cache(3)


@pytest.mark.parametrize("fmt, dtype", [(E4M3, "float8_e4m3fn"), (E5M2, "float8_e5m2")])
def test_minifloat_matches_torch_float8(fmt, dtype):
    torch = _torch()
    v = fmt.values()
    mids = (v[:-1] + v[1:]) / 2
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            v,
            mids,
            rng.uniform(-fmt.max_value, fmt.max_value, 4000),
            rng.standard_normal(4000) * 2.0 ** rng.integers(-20, 10, 4000),
        ]
    ).astype(np.float32)
    theirs = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy()
    assert np.array_equal(fmt.round(x), theirs)


def _ours(k: np.ndarray, spec: Spec, p: int, context_len: int, which: str) -> np.ndarray:
    x = k[:, : p + 1]
    return quantize_tensor(x, spec, which, residual_at(spec, np.arange(p + 1), p, context_len))


@pytest.mark.slow  # seconds once quanto's CPU extension is built; the first use on a fresh venv builds it (minutes)
@pytest.mark.parametrize("nbits, group", [(2, 64), (4, 64), (4, 32)])
def test_layer_matches_quanto(nbits, group):
    """Prefill of 20 tokens, then 20 decode steps across two flushes (residual_length 8): the
    keys and values transformers hands to attention equal ours at every step."""
    _quanto()
    import torch
    from transformers.cache_utils import QuantoQuantizedLayer

    R, c, steps, H, D = 8, 20, 20, 2, 64
    gen = torch.Generator().manual_seed(nbits * 100 + group)
    k = torch.randn(1, H, c + steps, D, generator=gen) * (1 + 5 * (torch.arange(D) == 3))  # an outlier channel
    v = torch.randn(1, H, c + steps, D, generator=gen)
    layer = QuantoQuantizedLayer(nbits=nbits, q_group_size=group, residual_length=R)
    spec = hf_quantized_cache(nbits, residual_length=R, q_group_size=group)
    kk, vv = layer.update(k[:, :, :c], v[:, :, :c])
    assert torch.equal(kk, k[:, :, :c])  # the prefill attends at full precision
    kn, vn = k[0].numpy(), v[0].numpy()
    worst = 0.0
    for j in range(steps):
        p = c + j
        kk, vv = layer.update(k[:, :, p : p + 1], v[:, :, p : p + 1])
        ok, ov = _ours(kn, spec, p, c, "k"), _ours(vn, spec, p, c, "v")
        exact = residual_at(spec, np.arange(p + 1), p, c)
        assert torch.equal(kk[0, :, p + 1 - exact :], k[0, :, p + 1 - exact : p + 1])  # the window is exact
        assert not torch.equal(kk[0, :, : p + 1 - exact], k[0, :, : p + 1 - exact])
        worst = max(worst, float(np.abs(kk[0].numpy() - ok).max()), float(np.abs(vv[0].numpy() - ov).max()))
    assert worst < 1e-5


@pytest.mark.slow
def test_decode_matches_transformers_quantized_cache(tiny):
    """A tiny random Llama, teacher-forced: transformers' QuantizedCache (quanto, 4 bits, groups of
    16 = head_dim, residual_length 8) and kvviz's decode under the preset give the same logits."""
    _quanto()
    import torch
    from transformers import QuantizedCache

    from kvviz.decode.loop import decode

    model, ids = tiny
    n, steps = 24, 20
    cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=16, residual_length=8)
    rows = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids[:n]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
        for i in range(steps):
            out = model(input_ids=torch.tensor([[ids[n + i]]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
    theirs = torch.stack(rows)
    ours, _, _ = decode(
        model, ids[:n], hf_quantized_cache(4, residual_length=8, q_group_size=16), steps, feed=ids[n : n + steps]
    )
    full, _, _ = decode(model, ids[:n], Spec(), steps, feed=ids[n : n + steps])
    assert torch.allclose(ours, theirs, atol=1e-4)
    assert (ours - full).abs().max() > 1e-3  # quantization really changed the logits
