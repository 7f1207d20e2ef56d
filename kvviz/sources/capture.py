"""Capture a Trace from a real causal language model (torch / transformers imported lazily).

For a prompt of P tokens and N greedy decode steps the model runs once over the prompt
(prefill) and then once per new token with its KV cache, exactly as generation does.
While it runs, a thin attention function registered with transformers' AttentionInterface
sees, per layer and per forward call, what the attention itself sees:

    query  (1, q_heads,  n, head_dim)   post-RoPE queries of the n new tokens
    key    (1, kv_heads, kv, head_dim)  post-RoPE keys as the cache holds them (new ones last)
    value  (1, kv_heads, kv, head_dim)

and copies the n new rows into preallocated float32 buffers before handing over to the
model's own attention (eager). So the trace holds, for T = P + N positions,

    q     (layers, q_heads,  T, head_dim)   a query at every position (prompt and decode)
    k, v  (layers, kv_heads, T, head_dim)

and never any tokens x tokens attention matrix of its own; softmax(q . K^T / sqrt(d)) is
recomputed on demand by kvviz (see `check_attention` for the proof it matches the model).
A 2048-token SmolLM2 capture holds 30*9*2048*64*4 B = 141 MB of q and 47 MB each of k, v.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvviz.limits import Part, Work, checkpoint
from kvviz.models import BUNDLED, ModelError, ModelInfo, load_model
from kvviz.models.config import PREFILL_SCORE_COPIES, model_dims
from kvviz.trace import Trace

DEFAULT_MAX_TOKENS = 2048
MAX_NEW_TOKENS = 1024
_IMPL_PREFIX = "kvviz_capture_"

Progress = Callable[[float, str], None]

# One capture at a time per process: the attention implementation is switched on the
# (possibly shared, e.g. st.cache_resource) model object for the duration of a capture.
_LOCK = threading.RLock()
_ACTIVE: "_Recorder | None" = None


class CaptureError(ModelError):
    """A capture that cannot run (empty prompt, bad layers, ...); the message says why."""


# --- the recorder ---------------------------------------------------------------------

class _Recorder:
    """Copies the new tokens' q, k, v of the selected layers into numpy buffers."""

    def __init__(self, slots: dict[int, int], n_positions: int, n_model_layers: int,
                 on_layer: Callable[[int], None] | None):
        self.slots = slots                  # model layer index -> trace layer index
        self.T = n_positions
        self.n_model_layers = n_model_layers
        self.on_layer = on_layer            # progress hook, called during the prefill
        self.start = 0                      # position of the first token of the current call
        self.q = self.k = self.v = None     # allocated on the first call, from real shapes
        self.calls = 0
        self.q_rescaled = False
        self._order: dict[int, int] = {}    # id(module) -> layer, for modules without layer_idx

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
            _, hq, n, d = query.shape
            hkv = key.shape[1]
            if self.q is None:
                L = len(self.slots)
                self.q = np.zeros((L, hq, self.T, d), np.float32)
                self.k = np.zeros((L, hkv, self.T, d), np.float32)
                self.v = np.zeros((L, hkv, self.T, value.shape[-1]), np.float32)
            s = self.start
            q = query[0].float()                                   # (Hq, n, D)
            if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
                # kvviz scores q . k / sqrt(d); fold a model's own scale into q so the logits match.
                q = q * (scaling * math.sqrt(d))
                self.q_rescaled = True
            self.q[slot, :, s:s + n] = q.cpu().numpy()
            self.k[slot, :, s:s + n] = key[0, :, -n:].float().cpu().numpy()    # (Hkv, n, D)
            self.v[slot, :, s:s + n] = value[0, :, -n:].float().cpu().numpy()
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
        return _inner_attention(module, impl)(module, query, key, value, attention_mask,
                                              scaling=scaling, dropout=dropout, **kwargs)
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

    def __init__(self, model: Any, recorder: _Recorder):
        self.model, self.recorder = model, recorder

    def __enter__(self):
        global _ACTIVE
        _LOCK.acquire()
        self.impl = self.model.config._attn_implementation or "eager"
        if self.impl.startswith(_IMPL_PREFIX):      # left over from an interrupted capture
            self.impl = self.impl[len(_IMPL_PREFIX):]
        try:
            self.model.set_attn_implementation(_register(self.impl))
        except Exception as exc:  # noqa: BLE001 - say what kvviz cannot do, not a traceback
            _LOCK.release()
            raise CaptureError(f"{type(self.model).__name__} does not let kvviz record its attention "
                               f"(AttentionInterface): {exc}") from None
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


# --- tokens ---------------------------------------------------------------------------

VISIBLE = {" ": "▁", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """Whitespace made visible for token chips: space ▁, newline ↵, tab ⇥."""
    return "".join(VISIBLE.get(c, c) for c in text)


def token_strings(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """Readable text of each token: what it adds to the decoded text, whitespace visible.

    Decoding a token after a few tokens of left context keeps the leading space that
    SentencePiece tokenizers drop at the start of a text; byte-level pieces of one
    character decode to the replacement character.
    """
    ids = [int(i) for i in ids]
    out = []
    for i, tid in enumerate(ids):
        ctx = ids[max(0, i - 3):i]
        whole = tokenizer.decode(ctx + [tid], clean_up_tokenization_spaces=False)
        head = tokenizer.decode(ctx, clean_up_tokenization_spaces=False) if ctx else ""
        piece = whole[len(head):] if whole.startswith(head) else tokenizer.decode([tid])
        if piece == "":
            piece = str(tokenizer.convert_ids_to_tokens(tid))
        out.append(visible(piece))
    return tuple(out)


# --- capture ----------------------------------------------------------------------------

def parse_layers(spec: str | Sequence[int] | None, n_layers: int) -> list[int] | None:
    """'0,1,5' / '0-3' / '2,4-6' / [0, 3] -> sorted layer indices; None = all layers."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    if isinstance(spec, str):
        out: set[int] = set()
        for part in spec.replace(" ", "").split(","):
            try:
                if "-" in part:
                    a, b = part.split("-", 1)
                    if int(b) < int(a):
                        raise ValueError
                    out.update(range(int(a), int(b) + 1))
                else:
                    out.add(int(part))
            except ValueError:
                raise CaptureError(f"cannot read layers {spec!r}: use e.g. 0,1,5 or 0-3") from None
        layers = sorted(out)
    else:
        layers = sorted({int(x) for x in spec})
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad or not layers:
        raise CaptureError(f"layers {bad or spec} do not exist: this model has layers 0-{n_layers - 1}")
    return layers


def _cache_of(out: Any) -> Any:
    fields = getattr(type(out), "__dataclass_fields__", {})
    return out["cache"] if "cache" in fields and out.get("cache") is not None else out.past_key_values


def capture(model: Any, tokenizer: Any, info: ModelInfo, prompt: str, new_tokens: int = 0,
            max_tokens: int = DEFAULT_MAX_TOKENS, layers: str | Sequence[int] | None = None,
            progress: Progress | None = None, stop_at_eos: bool = True) -> Trace:
    """Prefill `prompt`, greedy-decode `new_tokens` steps, and return the Trace of q, k, v.

    context_len = prompt length (after truncation to `max_tokens`); queries at every
    position. `progress(fraction, message)` is called as the capture advances.
    """
    import torch

    say = progress or (lambda f, m: None)
    if prompt is None or not str(prompt).strip():
        raise CaptureError("the prompt is empty: give some text to capture")
    if not 0 <= int(new_tokens) <= MAX_NEW_TOKENS:
        raise CaptureError(f"new tokens must be between 0 and {MAX_NEW_TOKENS}, not {new_tokens}")
    if int(max_tokens) < 1:
        raise CaptureError(f"max tokens must be at least 1, not {max_tokens}")
    new_tokens, max_tokens = int(new_tokens), int(max_tokens)
    chosen = parse_layers(layers, info.n_layers)
    layer_ids = chosen if chosen is not None else list(range(info.n_layers))

    ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise CaptureError("the prompt is empty after tokenization: give some text to capture")
    notes = []
    n_prompt_tokens = len(ids)
    limit = max_tokens
    max_pos = info.config.get("max_position_embeddings")
    if max_pos and max_pos - new_tokens < limit:
        limit = max(1, int(max_pos) - new_tokens)
    truncated = n_prompt_tokens > limit
    if truncated:
        ids = ids[:limit]
        why = (f"the max-tokens limit of {max_tokens}" if limit == max_tokens else
               f"the model's {max_pos} positions minus {new_tokens} new tokens")
        notes.append(f"the prompt has {n_prompt_tokens} tokens; kept the first {limit} ({why})")
        say(0.0, notes[-1])
    P, T = len(ids), len(ids) + new_tokens
    capture_work(model_dims(model), len(layer_ids), P, T).check()     # before any buffer is allocated

    # progress: the prefill is worth ~P/8 decode steps, at least one
    prefill_w = max(1.0, P / 8)
    total_w = prefill_w + new_tokens
    n_layers = info.n_layers

    def on_layer(layer: int) -> None:
        checkpoint()
        if rec.start == 0:
            say(prefill_w / total_w * (layer + 1) / n_layers, f"running prefill: layer {layer + 1}/{n_layers}")

    rec = _Recorder({m: i for i, m in enumerate(layer_ids)}, T, n_layers, on_layer)
    device = _input_device(model)
    t0 = time.perf_counter()
    all_ids = list(ids)
    stopped = None
    eos = _eos_ids(tokenizer, model)
    with _recording(model, rec), torch.inference_mode():
        say(0.0, f"running prefill over {P} tokens")
        x = torch.tensor([ids], device=device)
        try:
            out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        except TypeError as exc:            # an older model class without logits_to_keep
            if "logits_to_keep" not in str(exc):
                raise
            rec.calls, keep = 0, {}
            out = model(input_ids=x, use_cache=True)
        else:
            keep = {"logits_to_keep": 1}
        if rec.calls == 0:
            raise CaptureError(f"{info.architecture} did not call its attention through transformers' "
                               "AttentionInterface, so kvviz cannot record it")
        cache = _cache_of(out)
        for step in range(new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            if stop_at_eos and nxt in eos:
                stopped = "eos"
                notes.append(f"the model ended its answer (end-of-sequence) after {step} new tokens")
                break
            all_ids.append(nxt)
            rec.start = P + step
            checkpoint()
            say((prefill_w + step) / total_w, f"decoding step {step + 1}/{new_tokens}")
            out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=cache,
                        use_cache=True, **keep)
            cache = _cache_of(out)
        next_token = int(out.logits[0, -1].argmax())
    seconds = time.perf_counter() - t0
    n = len(all_ids)
    q, k, v = rec.q[:, :, :n], rec.k[:, :, :n], rec.v[:, :, :n]
    if q.shape[-1] != k.shape[-1]:
        raise CaptureError(f"queries ({q.shape[-1]}) and keys ({k.shape[-1]}) differ in head size; "
                           "kvviz cannot score this attention")

    from kvviz.version import __version__

    meta = {
        "source": "model", "model": info.label, "model_name": info.name, "path": info.path,
        "architecture": info.architecture, "config": info.config, "dtype": info.dtype,
        "device": info.device, "prompt": prompt, "prompt_tokens": P,
        "prompt_tokens_total": n_prompt_tokens, "truncated": truncated, "max_tokens": max_tokens,
        "new_tokens": n - P, "new_tokens_requested": new_tokens, "stopped": stopped,
        "generated_text": tokenizer.decode(all_ids[P:]) if n > P else "",
        "next_token": tokenizer.decode([next_token]), "token_ids": all_ids,
        "layers": layer_ids, "query_rescaled": rec.q_rescaled,
        "sliding_window": info.config.get("sliding_window"),
        "capture_seconds": round(seconds, 3), "kvviz_version": __version__, "notes": notes,
    }
    from kvviz.models.config import rope_inv_freq
    inv_freq = rope_inv_freq(model)
    if inv_freq is not None:
        meta["rope_inv_freq"] = [float(x) for x in inv_freq]
    say(1.0, f"captured {n} tokens ({P} prompt + {n - P} new) in {seconds:.1f} s")
    return Trace(q=q, k=k, v=v, context_len=P, tokens=token_strings(tokenizer, all_ids),
                 query_positions=np.arange(n, dtype=np.int64), meta=meta)


def capture_work(dims: tuple[int, int, int, int], n_layers: int, n_prompt: int, n_positions: int) -> Work:
    """What a capture holds beyond the weights: the trace's float32 buffers for the recorded layers
    and, during the prefill, one layer's (query heads, prompt, prompt) attention scores."""
    _, Hq, H, D = dims
    T = (n_positions, "positions")
    return Work("this capture", (
        Part("attention scores", ((PREFILL_SCORE_COPIES, ""), (Hq, "query heads"), (n_prompt, "tokens"),
                                  (n_prompt, "keys"))),
        Part("queries", ((n_layers, "layers"), (Hq, "query heads"), T, (D, "dims"))),
        Part("keys and values", ((2, ""), (n_layers, "layers"), (H, "KV heads"), T, (D, "dims"))),
    ), lower="Max prompt tokens (--max-tokens), the new tokens or the layers kept (--layers)")


def capture_trace(model_name: str = BUNDLED, prompt: str = "", new_tokens: int = 0,
                  max_tokens: int = DEFAULT_MAX_TOKENS, layers: str | Sequence[int] | None = None,
                  device: str = "cpu", dtype: str = "float32", progress: Progress | None = None) -> Trace:
    """Load `model_name` and capture `prompt`; progress covers loading (first 40%) and capture."""
    say = progress or (lambda f, m: None)
    if prompt is None or not str(prompt).strip():
        raise CaptureError("the prompt is empty: give some text to capture")
    model, tokenizer, info = load_model(model_name, device=device, dtype=dtype,
                                        progress=lambda f, m: say(0.4 * f, m))
    return capture(model, tokenizer, info, prompt, new_tokens, max_tokens, layers,
                   progress=lambda f, m: say(0.4 + 0.6 * f, m))


def forward_only(model: Any, ids: Sequence[int]) -> None:
    """The plain prefill forward pass capture() runs, without recording (for benchmarks)."""
    import torch

    with torch.inference_mode():
        model(input_ids=torch.tensor([list(ids)], device=_input_device(model)), use_cache=True,
              logits_to_keep=1)


def _input_device(model: Any) -> Any:
    try:
        return model.get_input_embeddings().weight.device
    except Exception:  # noqa: BLE001
        return model.device


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


# --- checks and overviews (numpy only) ---------------------------------------------------

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
            out = model(input_ids=torch.tensor([ids], device=_input_device(model)), output_attentions=True,
                        use_cache=False, logits_to_keep=1)
        finally:
            if impl != "eager":
                model.set_attn_implementation(impl)
    layers = trace.meta.get("layers") or list(range(trace.n_layers))
    heads = np.arange(trace.n_q_heads)
    rows = np.arange(trace.n_queries)
    err = np.zeros((trace.n_layers, trace.n_q_heads))
    for i, layer in enumerate(layers):
        theirs = out.attentions[layer][0].float().cpu().numpy()              # (Hq, T, T)
        for idx, ours in context_rows(trace, i, heads, rows, trace.n_positions):
            pos = trace.query_positions[idx]
            diff = np.abs(ours - theirs[:, pos])                             # (Hq, c, T)
            err[i] = np.maximum(err[i], diff.max(axis=(1, 2)))
    return err


def _tail_rows(trace: Trace, n_rows: int, which: str) -> np.ndarray:
    rows = trace.context_queries if which == "context" else np.arange(trace.n_queries)
    return rows[-n_rows:]


def head_overview(trace: Trace, n_rows: int = 32, which: str = "context") -> np.ndarray:
    """Sink share per (layer, query head): attention on token 0, averaged over the last
    `n_rows` queries of the context (which="context") or of the whole trace ("all")."""
    from kvviz.attention import context_rows

    rows = _tail_rows(trace, n_rows, which)
    heads = np.arange(trace.n_q_heads)
    out = np.zeros((trace.n_layers, trace.n_q_heads))
    for layer in range(trace.n_layers):
        total = np.zeros(trace.n_q_heads)
        for _, a in context_rows(trace, layer, heads, rows, trace.n_positions):   # (Hq, c, T)
            total += a[:, :, 0].sum(axis=1)
        out[layer] = total / len(rows)
    return out


def concentration(trace: Trace, first_layer: int = 2, n_rows: int = 32, top: float = 0.10,
                  which: str = "context") -> dict[str, float]:
    """How concentrated attention is, averaged over layers >= first_layer, all heads and the
    last `n_rows` context queries: the first token's share, and the share held by the top
    `top` fraction of the keys each query sees (at least one key)."""
    from kvviz.attention import context_rows

    rows = _tail_rows(trace, n_rows, which)
    heads = np.arange(trace.n_q_heads)
    first, topk, count = 0.0, 0.0, 0
    for layer in range(first_layer, trace.n_layers):
        for idx, a in context_rows(trace, layer, heads, rows, trace.n_positions):  # (Hq, c, T)
            seen = trace.query_positions[idx] + 1                                   # keys per row
            srt = -np.sort(-a, axis=-1)                                             # descending
            csum = np.cumsum(srt, axis=-1)
            k = np.maximum(1, np.ceil(top * seen).astype(int))                      # (c,)
            topk += np.take_along_axis(csum, (k - 1)[None, :, None].repeat(len(heads), 0), -1).sum()
            first += a[:, :, 0].sum()
            count += a.shape[0] * a.shape[1]
    if count == 0:
        raise CaptureError(f"the trace has no layers from {first_layer} on")
    return {"first_token": float(first / count), "top_share": float(topk / count), "rows": int(len(rows)),
            "layers": int(trace.n_layers - first_layer)}
