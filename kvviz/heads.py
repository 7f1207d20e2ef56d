"""Scoring only the KV heads a view reads (the Explorer on a big trace): where a scorer scores each KV head
from that head alone, a view's kept masks come from a trace of those heads only.

kvviz.engine reads `view_masks`; tests/test_head_view.py checks each separable scorer against scoring every
head, bit for bit.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from kvviz.rows import keep_masks
from kvviz.spec import Spec
from kvviz.trace import Trace

# Which scorers score one KV head from that head alone is each scorer's own `head_separable` (not TOVA
# or ChunkKV: one decision shared by every head, from all of them; not the random scorer: one draw over
# every head; the oracle and Quest decide per query).
_HEAD_TRACES: OrderedDict = OrderedDict()  # (id(trace), layer, kv heads) -> (weak ref, head trace)
_HEAD_TRACES_SIZE = 4


def head_separable(trace: Trace, spec: Spec, layer: int) -> bool:
    """Whether the kept sets of some KV heads of this layer can be computed from those heads alone: a
    separable scorer, an allocation within each head (not AdaKV's across heads), no compression during
    decoding, no per-tensor quantization format reading every head, arrays on the host."""
    from kvviz.policies.registry import get_policy
    from kvviz.quant.formats import uses_formats
    from kvviz.trace import is_lazy

    return (
        spec.evicts
        and get_policy(spec.scorer).head_separable
        and spec.allocation in ("uniform", "pyramid")
        and not spec.compress_every
        and not (spec.quantizes and uses_formats(spec))
        and trace.layer_windows[layer] is None
        and (isinstance(trace.k, np.ndarray) or is_lazy(trace.k))
    )


def head_trace(trace: Trace, layer: int, kv_heads: list[int]) -> Trace:
    """One layer of `trace` restricted to some KV heads and their query groups, as a trace with every
    layer that one (zero-stride views, kvviz.policies.recompress.LayerTrace), so a scorer reads it at
    its own layer index. Kept per (trace, layer, heads) for the scores cached on it (a slider move
    reuses them); `full_q_heads` makes kvviz.attention.context_rows chunk its rows as for every head,
    so the sums are the same bit for bit."""
    from kvviz.policies.recompress import LayerTrace

    key = (id(trace), layer, tuple(kv_heads))
    hit = _HEAD_TRACES.get(key)
    if hit is not None and hit[0]() is trace:
        _HEAD_TRACES.move_to_end(key)
        return hit[1]
    g, L = trace.group_size, trace.n_layers
    q_heads = [h for kv in kv_heads for h in range(kv * g, (kv + 1) * g)]

    def one(a, heads):  # (L, len(heads), ...) views of one layer's heads
        return None if a is None else np.broadcast_to((part := a[layer][heads])[None], (L, *part.shape))

    sub = LayerTrace(
        q=one(trace.q, q_heads),
        k=one(trace.k, kv_heads),
        v=one(trace.v, kv_heads),
        context_len=trace.context_len,
        tokens=trace.tokens,
        query_positions=trace.query_positions,
        meta=trace.meta,
        logits=one(trace.logits, q_heads),
        noise_eps=trace.noise_eps,
    )
    object.__setattr__(sub, "full_q_heads", trace.n_q_heads)
    _HEAD_TRACES[key] = (weakref.ref(trace), sub)
    while len(_HEAD_TRACES) > _HEAD_TRACES_SIZE:
        _HEAD_TRACES.popitem(last=False)
    return sub


def view_masks(trace: Trace, spec: Spec, layer: int, positions: list[int], kv_heads: list[int]) -> np.ndarray | None:
    """kvviz.rows.keep_masks where only `kv_heads` are read: (len(positions), kv_heads, positions), those
    heads' masks as keep_masks gives them, the other heads' all False (not computed). A separable scorer
    (head_separable) scores those heads alone; any other scores every head."""
    if len(kv_heads) == trace.n_kv_heads or not head_separable(trace, spec, layer):
        return keep_masks(trace, spec, layer, positions)
    part = keep_masks(head_trace(trace, layer, kv_heads), spec, layer, positions)
    if part is None:
        return None
    out = np.zeros((len(positions), trace.n_kv_heads, trace.n_positions), dtype=bool)
    out[:, kv_heads] = part
    return out
