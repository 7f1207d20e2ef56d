"""One forward pass of the model through kvviz's cache: the cache for a model (its shape, device and dtype) and
the logits of a run of tokens at their true positions. Shared by the decode loop and the reconstruction pass."""

from __future__ import annotations

from collections.abc import Sequence

from kvviz.decode.cache import CompressedCache
from kvviz.decode.place import placement
from kvviz.models.config import model_dims
from kvviz.spec import Spec, SpecError


def _forward(model, ids: Sequence[int], start: int, last_only: bool = False):
    """Logits (t, vocab) of tokens ids at positions start.. (explicit position_ids, no HF cache);
    last_only: the last position's alone (1, vocab), as generate() asks for a prompt's (a 32k prompt's
    logits over a 128k vocabulary would be 16 GiB in float32)."""
    import torch

    # where the model reads its token ids
    device = placement(model)[0]
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    pos = torch.arange(start, start + len(ids), device=device)[None]
    keep = {"logits_to_keep": 1} if last_only else {}
    logits = model(input_ids=x, position_ids=pos, use_cache=False, **keep).logits[0]
    return (logits[-1:] if last_only else logits).float()


def refuse_sliding(model) -> None:
    """SpecError for a model with sliding-window layers (Mistral, Gemma 2/3, gpt-oss): the compressed cache
    attends over every token it keeps, on every layer, so it would give those layers the whole context."""
    from kvviz.models.load import layer_kinds

    cfg = model.config
    kinds = layer_kinds(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    if sliding:
        raise SpecError(
            f"{type(model).__name__} has {len(sliding)} sliding-window layers of {len(kinds)}: kvviz's "
            "compressed decode attends over the whole cache on every layer, so it cannot run this model "
            "yet; capture a trace of it instead (kvviz capture), which the Explorer reads window and all"
        )


def new_cache(model, spec: Spec, capacity: int, cls=CompressedCache, **kwargs) -> CompressedCache:
    """A cache of class `cls` for this model: its shape, and its device and dtype (kvviz.decode.place).
    A model with sliding-window layers is refused (`refuse_sliding`)."""
    refuse_sliding(model)
    L, Hq, Hkv, D = model_dims(model)
    device, dtype = placement(model)
    return cls(spec, L, Hq, Hkv, D, capacity=capacity, device=device, dtype=dtype, **kwargs)
