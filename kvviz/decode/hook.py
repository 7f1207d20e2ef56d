"""Plugging a CompressedCache into a transformers model: a registered attention function.

We decode in our own loop (generate() derives positions from the mask, which is wrong once
the mask has holes): the model runs with use_cache=False and the attention function
`kvviz_compressed`, which reads and writes the active cache. Only the thread running the
compressed decode sees it; other threads sharing the model object get its own attention.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


from kvviz.decode.cache import CompressedCache

ATTN_NAME = "kvviz_compressed"
_LOCK = threading.RLock()  # one compressed run per model at a time (Streamlit threads)
# id(model config) -> (cache, owning thread, the model's own attention)
_ACTIVE: dict[int, tuple] = {}


def _fallback(module, implementation: str | None):
    """The attention function the model had before (for other threads sharing the model)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation in (None, "eager") and eager is not None:
        return eager
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: (B, Hq, t, D) query -> (B, t, Hq, D) output.

    Only the thread running the compressed decode reads the compressed cache; any other
    thread using the same model object meanwhile gets the model's own attention (and the
    eager mask transformers built for it), so a shared app model is never corrupted.
    """
    entry = _ACTIVE.get(id(module.config))
    if entry is None or entry[1] != threading.get_ident():
        before = entry[2] if entry is not None else "eager"
        return _fallback(module, before)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    cache = entry[0]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # a batch: row b reads and writes its own cache (decode_many)
    if isinstance(cache, list):
        if query.shape[0] != len(cache):
            raise RuntimeError(f"a batch of {query.shape[0]} rows for {len(cache)} caches")
        import torch

        outs = [c.attend(module.layer_idx, query[b], key[b], value[b], scale) for b, c in enumerate(cache)]
        out = torch.stack(outs).transpose(1, 2).contiguous()
        return out.to(query.device, query.dtype), None
    if query.shape[0] != 1:
        raise RuntimeError("compressed decoding runs one sequence at a time")
    out = cache.attend(module.layer_idx, query[0], key[0], value[0], scale)  # (Hq, t, D) float32
    # back in the model's dtype, on the layer's device (device_map="auto" may spread the layers)
    return out.transpose(0, 1)[None].to(query.device, query.dtype).contiguous(), None


@contextmanager
def compressed_cache(model, cache: CompressedCache):
    """Run `model` with its attention reading and writing `cache` (one run per model at a time)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    # other threads still get causal masks
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, eager_mask)
    with _LOCK:
        config = model.config
        before = config._attn_implementation
        _ACTIVE[id(config)] = (cache, threading.get_ident(), before)
        config._attn_implementation = ATTN_NAME
        try:
            yield cache
        finally:
            config._attn_implementation = before
            _ACTIVE.pop(id(config), None)
