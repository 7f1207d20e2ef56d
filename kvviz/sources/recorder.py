"""Recording a model's attention inputs as it runs, and checking a recording against the model.

A thin attention function registered with transformers' AttentionInterface hands each layer's new q, k, v
rows to a sink (float32 buffers in memory, or a format-2 trace file written as the layers arrive) and then
calls the attention the model runs; kvviz.sources.capture drives it. `check_attention` replays a trace's
tokens through the model's eager attention and compares its weights with kvviz's recomputation from the
recorded q and k. torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvviz.models import ModelError
from kvviz.trace import Trace

_IMPL_PREFIX = "kvviz_capture_"

# One capture at a time per process: the attention implementation is switched on the
# (possibly shared, e.g. st.cache_resource) model object for the duration of a capture.
_LOCK = threading.RLock()
_ACTIVE: "_Recorder | None" = None


class CaptureError(ModelError):
    """A capture that cannot run (empty prompt, bad layers, ...); the message says why."""


# --- the recorder and where its rows go ------------------------------------------------------


class _MemorySink:
    """The trace's rows in float32 numpy buffers (the app's captures; allocated on the first rows)."""

    def __init__(self, n_layers: int, n_positions: int):
        self.L, self.T = n_layers, n_positions
        self.q = self.k = self.v = None

    def put(self, slot: int, start: int, q: Any, k: Any, v: Any, scale: float) -> None:
        if self.q is None:
            self.q = np.zeros((self.L, q.shape[0], self.T, q.shape[-1]), np.float32)
            self.k = np.zeros((self.L, k.shape[0], self.T, k.shape[-1]), np.float32)
            self.v = np.zeros((self.L, v.shape[0], self.T, v.shape[-1]), np.float32)
        n = q.shape[1]
        q = q.float()
        # kvviz scores q . k / sqrt(d): fold the model's scale into q
        if scale != 1.0:
            q = q * scale
        self.q[slot, :, start : start + n] = q.cpu().numpy()
        self.k[slot, :, start : start + n] = k.float().cpu().numpy()
        self.v[slot, :, start : start + n] = v.float().cpu().numpy()


class _FileSink:
    """The trace's rows written to a format-2 file as they arrive, in the model's dtype (a TraceWriter);
    the host holds one layer's new rows at a time. The model's query scale goes in the header."""

    def __init__(self, writer: Any, numbers: list[int], dtype: Any):
        self.writer, self.numbers, self.dtype = writer, numbers, dtype

    def put(self, slot: int, start: int, q: Any, k: Any, v: Any, scale: float) -> None:
        n = self.numbers[slot]
        for kind, x in (("q", q), ("k", k), ("v", v)):
            self.writer.put(f"{kind}.{n}", _host_array(x.to(self.dtype)), start)


def _host_array(x: Any) -> np.ndarray:
    """A torch tensor's values on the host as numpy, bit for bit (bfloat16 as its uint16 pattern)."""
    import torch

    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(np.uint16)
    return x.cpu().numpy()


class _Recorder:
    """Hands the new tokens' q, k, v of the selected layers to a sink, layer by layer as they run."""

    def __init__(self, slots: dict[int, int], sink: Any, on_layer: Callable[[int], None] | None):
        self.slots = slots  # model layer index -> trace layer index
        self.sink = sink
        self.on_layer = on_layer  # progress hook, called during the prefill
        self.start = 0  # position of the first token of the current call
        self.calls = 0
        self.q_scale = 1.0  # the model's query scale relative to 1/sqrt(d)
        self.attention = ""  # the implementation that ran (set by _recording)
        self._order: dict[int, int] = {}  # id(module) -> layer, for modules without layer_idx

    @property
    def q_rescaled(self) -> bool:
        return self.q_scale != 1.0

    def layer_of(self, module: Any) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = self._order.setdefault(id(module), len(self._order))
        return int(idx)

    def record(self, module: Any, query: Any, key: Any, value: Any, scaling: float | None) -> None:
        layer = self.layer_of(module)
        self.calls += 1
        slot = self.slots.get(layer)
        if slot is not None:
            n, d = query.shape[2], query.shape[3]
            if d != key.shape[-1]:
                raise CaptureError(
                    f"queries ({d}) and keys ({key.shape[-1]}) differ in head size; kvviz cannot score this attention"
                )
            if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
                self.q_scale = float(scaling * math.sqrt(d))
            # query (1, Hq, n, D); key, value (1, Hkv, kv, D) with the n new tokens last
            self.sink.put(slot, self.start, query[0], key[0, :, -n:], value[0, :, -n:], self.q_scale)
        if self.on_layer is not None:
            self.on_layer(layer)


def _inner_attention(module: Any, impl: str) -> Callable:
    """The model's own attention function for implementation `impl`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise CaptureError(f"{type(module).__name__} has no eager attention function kvviz can wrap")
        return fn
    return ALL_ATTENTION_FUNCTIONS[impl]


def _make_capture_attention(impl: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if _ACTIVE is not None:
            _ACTIVE.record(module, query, key, value, scaling)
        return _inner_attention(module, impl)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )

    return attention


def _register(impl: str) -> str:
    """Register kvviz's recording wrapper around `impl` (and impl's mask); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = _IMPL_PREFIX + impl
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _make_capture_attention(impl))
        if impl in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[impl])
    return name


class _recording:
    """Context manager: route the model's attention through the recorder, then restore it."""

    def __init__(self, model: Any, recorder: _Recorder, attention: str | None = None):
        self.model, self.recorder, self.attention = model, recorder, attention

    def __enter__(self):
        global _ACTIVE
        _LOCK.acquire()
        self.impl = self.model.config._attn_implementation or "eager"
        if self.impl.startswith(_IMPL_PREFIX):  # left over from an interrupted capture
            self.impl = self.impl[len(_IMPL_PREFIX) :]
        self.recorder.attention = self.attention or self.impl
        try:
            try:
                self.model.set_attn_implementation(_register(self.recorder.attention))
            except Exception:  # noqa: BLE001 - a model without sdpa (Gemma 2): its own attention instead
                if self.recorder.attention == self.impl:
                    raise
                self.recorder.attention = self.impl
                self.model.set_attn_implementation(_register(self.impl))
        except Exception as exc:  # noqa: BLE001 - say what kvviz cannot do, not a traceback
            _LOCK.release()
            raise CaptureError(
                f"{type(self.model).__name__} does not let kvviz record its attention "
                f"(AttentionInterface): {_first_line(exc)}"
            ) from None
        _ACTIVE = self.recorder
        return self.recorder

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None
        try:
            self.model.set_attn_implementation(self.impl)
        finally:
            _LOCK.release()
        return False


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _input_device(model: Any) -> Any:
    try:
        return model.get_input_embeddings().weight.device
    except Exception:  # noqa: BLE001
        return model.device


def check_attention(model: Any, trace: Trace) -> np.ndarray:
    """Max |kvviz attention - model attention| per (layer, query head), over all rows and keys.

    Runs the model once more over the trace's tokens with output_attentions (eager), and
    recomputes every row with kvviz.attention.context_rows from the captured q and k.
    Meant for short traces (tests): the model returns layers x heads x T x T weights.
    """
    import torch

    from kvviz.attention import context_rows

    ids = trace.meta.get("token_ids")
    if not ids or len(ids) != trace.n_positions:
        raise CaptureError("this trace has no token ids to replay (not captured from a model)")
    with _LOCK, torch.inference_mode():
        impl = model.config._attn_implementation
        if impl != "eager":
            model.set_attn_implementation("eager")
        try:
            out = model(
                input_ids=torch.tensor([ids], device=_input_device(model)),
                output_attentions=True,
                use_cache=False,
                logits_to_keep=1,
            )
        finally:
            if impl != "eager":
                model.set_attn_implementation(impl)
    layers = trace.meta.get("layers") or list(range(trace.n_layers))
    heads = np.arange(trace.n_q_heads)
    rows = np.arange(trace.n_queries)
    err = np.zeros((trace.n_layers, trace.n_q_heads))
    for i, layer in enumerate(layers):
        theirs = out.attentions[layer][0].float().cpu().numpy()  # (Hq, T, T)
        for idx, ours in context_rows(trace, i, heads, rows, trace.n_positions):
            pos = trace.query_positions[idx]
            diff = np.abs(ours - theirs[:, pos])  # (Hq, c, T)
            err[i] = np.maximum(err[i], diff.max(axis=(1, 2)))
    return err
