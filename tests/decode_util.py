"""Shared test helpers for the compressed-cache decode: the quantized cache that several tests decode
with, and a check of its incremental quantizer against kvviz.quant.quantize."""


def two_and_three_bit_spec(axes: tuple[str, str], **eviction):
    """Keys at 2 bits and values at 3 bits along `axes` (key axis, value axis), groups of 4 and the last
    3 tokens exact, with the `eviction` settings (none: nothing evicted)."""
    from kvviz.spec import Spec

    return Spec(key_bits=2, value_bits=3, key_axis=axes[0], value_axis=axes[1], group_size=4, residual=3, **eviction)


def check_every_quantization(monkeypatch) -> list[int]:
    """Make every K or V quantization of the cache (CompressedCache._quantized) check its result against
    kvviz.quant.quantize of the same tokens (to 1e-6); returns the list that each checked call appends
    its token count to."""
    import numpy as np

    from kvviz.decode.cache import CompressedCache
    from kvviz.quant import quantize

    checked = []
    original = CompressedCache._quantized

    def checking(self, layer, which, x, idx):
        out = original(self, layer, which, x, idx)
        s = self.spec
        bits, axis = (s.key_bits, s.key_axis) if which == "k" else (s.value_bits, s.value_axis)
        direct = quantize(x, bits, axis, s.group_size, s.residual, s.symmetric)
        np.testing.assert_allclose(out, direct, rtol=0, atol=1e-6)
        checked.append(x.shape[1])
        return out

    monkeypatch.setattr(CompressedCache, "_quantized", checking)
    return checked
