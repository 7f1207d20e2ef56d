"""The FP8 / FP4 formats, rotation and HF's residual flush on the real-model decode path (a tiny
random Llama): the attention reads exactly kvviz.quant.formats.quantize_tensor of what is kept,
deleting equals masking, and the memory follows the formats' byte counts."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz.spec import Spec  # noqa: E402
from kvviz.decode.cache import CompressedCache  # noqa: E402
from kvviz.decode.loop import decode  # noqa: E402
from kvviz.decode.quality import evaluate, reference  # noqa: E402
from kvviz.quant.formats import quantize_tensor, residual_at  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(hidden_size=128)


SPECS = {
    "fp8-head+h2o": Spec(key_format="e4m3", value_format="e5m2", sink=2, recent=6, heavy=6, scorer="h2o"),
    "nvfp4-rotated": Spec(key_format="nvfp4", value_format="mxfp4", rotate="keys-values", residual=3),
    "int2-rotated-hf": Spec(
        key_bits=2, value_bits=4, key_axis="token", group_size=16, rotate="keys", residual=5, residual_mode="hf"
    ),
    "fp8-tensor+streaming": Spec(
        key_format="e4m3", value_format="e4m3", fp8_scale="tensor", sink=4, recent=10, scorer="streaming"
    ),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_decode_reads_quantize_tensor_of_the_kept_set(tiny, monkeypatch, name):
    model, ids = tiny
    spec = SPECS[name]
    checked = []
    original = CompressedCache._kept_kv_formats

    def checking(self, layer, K, V, idx):
        Kq, Vq = original(self, layer, K.copy(), V.copy(), idx)
        r = residual_at(self.spec, idx, self.length[layer] - 1, self.trace.context_len)
        np.testing.assert_array_equal(Kq.numpy(), quantize_tensor(K, self.spec, "k", r))
        np.testing.assert_array_equal(Vq.numpy(), quantize_tensor(V, self.spec, "v", r))
        checked.append(r)
        return Kq, Vq

    monkeypatch.setattr(CompressedCache, "_kept_kv_formats", checking)
    deleted, _, _ = decode(model, ids[:20], spec, 12, feed=ids[20:32])
    masked, _, _ = decode(model, ids[:20], spec, 12, feed=ids[20:32], mode="mask")
    full, _, _ = decode(model, ids[:20], Spec(), 12, feed=ids[20:32])
    assert len(checked) == 2 * 2 * 12
    assert torch.allclose(deleted, masked, atol=1e-4)
    assert (deleted - full).abs().max() > 1e-4
    if spec.residual_mode == "hf":
        assert checked[: 2 * 5] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # the window grows, then flushes
        assert checked[2 * 5 : 2 * 6] == [1, 1]


def test_memory_follows_the_format_bytes(tiny):
    model, ids = tiny

    class Chars:  # a stand-in tokenizer: token strings only
        def decode(self, ids):
            return f"<{ids[0]}>"

    ref = reference(model, Chars(), ids[:40], 20, 20)
    q = evaluate(model, ref, Spec(key_format="e4m3", value_format="e4m3"))
    assert q.memory_ratio == pytest.approx(0.5 + 2 * 4 / (q.total_tokens * 32 * 2 * 2))  # + one FP32 scale a head
    assert evaluate(model, ref, Spec(key_format="mxfp4", value_format="mxfp4")).memory_ratio == pytest.approx(4.25 / 16)
