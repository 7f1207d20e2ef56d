"""Capture a Trace from a real causal language model (torch / transformers imported lazily).

For a prompt of P tokens and N greedy decode steps the model runs once over the prompt (prefill) and
then once per new token with its KV cache, exactly as generation does. While it runs, a thin attention
function registered with transformers' AttentionInterface sees, per layer and per forward call,

    query  (1, q_heads,  n, head_dim)   post-RoPE queries of the n new tokens
    key    (1, kv_heads, kv, head_dim)  post-RoPE keys as the cache holds them (new ones last)
    value  (1, kv_heads, kv, head_dim)

hands the n new rows to a sink, then calls the attention the model runs (sdpa unless asked otherwise;
eager only where the weights themselves are needed, as in `check_attention`). The sink is float32
buffers in memory, or a format-2 trace file written as the layers arrive, in the model's own dtype
(capture(out=...); the host holds one layer's rows at a time). So the trace holds, for T = P + N,

    q     (layers, q_heads,  T, head_dim)   a query at every position (prompt and decode)
    k, v  (layers, kv_heads, T, head_dim)

and never a tokens x tokens attention matrix: softmax(q . K^T / sqrt(d)) is recomputed on demand.
An 8B model of Llama-3.1's shape stores 32 x (32 + 2 x 8) x 128 x 2 B = 393 kB a token in bfloat16.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.limits import checkpoint
from kvviz.models import BUNDLED, ModelInfo, load_model
from kvviz.models.config import model_dims
from kvviz.sources.overview import concentration, head_overview  # noqa: F401 - their home before
from kvviz.sources.tokens import VISIBLE, token_strings, visible  # noqa: F401 - their home before
from kvviz.sources.recorder import (
    _IMPL_PREFIX,
    _LOCK,
    CaptureError,
    _FileSink,
    _input_device,
    _MemorySink,
    _Recorder,
    _recording,
)
from kvviz.sources.recorder import check_attention  # noqa: F401 - its home before
from kvviz.sources.request import DEFAULT_MAX_TOKENS, _Request, _request, capture_work
from kvviz.trace import Trace

Progress = Callable[[float, str], None]


# --- capture ----------------------------------------------------------------------------


def _cache_of(out: Any) -> Any:
    fields = getattr(type(out), "__dataclass_fields__", {})
    return out["cache"] if "cache" in fields and out.get("cache") is not None else out.past_key_values


ATTENTIONS = ("sdpa", "eager", "model")  # "model": whatever the model was loaded with


def capture(
    model: Any,
    tokenizer: Any,
    info: ModelInfo,
    prompt: str,
    new_tokens: int = 0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    layers: str | Sequence[int] | None = None,
    progress: Progress | None = None,
    stop_at_eos: bool = True,
    attention: str | None = "sdpa",
    out: str | os.PathLike | None = None,
    more_meta: Callable[[list[int]], dict] | None = None,
) -> Trace:
    """Prefill `prompt`, greedy-decode `new_tokens` steps, and return the Trace of q, k, v.

    context_len = prompt length (after truncation to `max_tokens`); queries at every position.
    `attention`: the implementation the model runs while recorded ("sdpa", "eager", or None / "model"
    for the one it was loaded with). `out`: write the trace to this file as the layers arrive, in the
    model's dtype (format 2), and return it opened lazily from there; else float32 arrays in memory.
    `progress(fraction, message)` is called as the capture advances. `more_meta(prompt_ids)`: what else the
    trace's meta holds, computed from the prompt's token ids after the run (KVzip's reconstruction scores:
    kvviz.decode.reconstruct.kvzip_meta).
    """
    say = progress or (lambda f, m: None)
    attention = None if attention in (None, "model") else str(attention)
    req = _request(tokenizer, info, prompt, new_tokens, max_tokens, layers)
    for note in req.notes:
        say(0.0, note)
    dtype = _model_dtype(model)
    capture_work(
        model_dims(model),
        len(req.layers),
        req.P,
        req.T,
        attention=attention or model.config._attn_implementation or "eager",
        on_host=_input_device(model).type == "cpu",
        # before any buffer is allocated
        item_bytes=None if out is None else dtype.itemsize,
    ).check()
    if out is None:
        sink = _MemorySink(len(req.layers), req.T)
        run = _run(model, tokenizer, info, req, sink, attention, stop_at_eos, say)
        n = run["n"]
        meta = _meta(model, tokenizer, info, prompt, req, run, attention)
        meta.update(more_meta(list(req.ids)) if more_meta else {})
        say(1.0, run["message"])
        return Trace(
            q=sink.q[:, :, :n],
            k=sink.k[:, :, :n],
            v=sink.v[:, :, :n],
            context_len=req.P,
            tokens=token_strings(tokenizer, run["ids"]),
            query_positions=np.arange(n, dtype=np.int64),
            meta=meta,
        )
    return _capture_to_file(
        model, tokenizer, info, prompt, req, attention, stop_at_eos, say, dtype, Path(out), more_meta
    )


def _capture_to_file(
    model: Any,
    tokenizer: Any,
    info: ModelInfo,
    prompt: str,
    req: _Request,
    attention: str | None,
    stop_at_eos: bool,
    say: Progress,
    dtype: Any,
    out: Path,
    more_meta: Callable[[list[int]], dict] | None = None,
) -> Trace:
    """capture(out=...): rows go to a TraceWriter as they arrive; the file appears at `out` only when complete."""
    from kvviz.sources.traceheader import header_fields
    from kvviz.sources.tracefile import load_trace
    from kvviz.sources.tracewriter import TraceWriter

    _, Hq, Hkv, D = model_dims(model)
    code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}[str(dtype).split(".")[-1]]
    tensors = {}
    for n in req.layers:
        tensors.update(
            {f"q.{n}": (code, (Hq, req.T, D)), f"k.{n}": (code, (Hkv, req.T, D)), f"v.{n}": (code, (Hkv, req.T, D))}
        )
    tensors["query_positions"] = ("I64", (req.T,))
    reserve = 64 * 1024 + 64 * req.T + 4 * len(prompt.encode("utf-8"))
    if more_meta:  # room for a value per (layer, KV head, prompt token), as KVzip's scores take
        reserve += 12 * model_dims(model)[0] * Hkv * req.P
    with TraceWriter(out, tensors, reserve=reserve) as w:
        run = _run(model, tokenizer, info, req, _FileSink(w, req.layers, dtype), attention, stop_at_eos, say)
        n = run["n"]
        w.put("query_positions", np.arange(req.T, dtype=np.int64))
        meta = _meta(model, tokenizer, info, prompt, req, run, attention)
        meta.update(more_meta(list(req.ids)) if more_meta else {})
        if run["q_scale"] != 1.0:
            meta["query_scale"] = run["q_scale"]
        w.finish(header_fields(req.P, token_strings(tokenizer, run["ids"]), meta, req.layers), positions=n)
    say(1.0, run["message"] + f", written to {out.name}")
    return load_trace(out)


def _run(
    model: Any,
    tokenizer: Any,
    info: ModelInfo,
    req: _Request,
    sink: Any,
    attention: str | None,
    stop_at_eos: bool,
    say: Progress,
) -> dict[str, Any]:
    """The prefill and the greedy decode steps with the recorder on; what happened, as a dict."""
    import torch

    P, new_tokens, n_layers = req.P, req.new_tokens, info.n_layers
    # progress: the prefill is worth ~P/8 decode steps, at least one
    prefill_w = max(1.0, P / 8)
    total_w = prefill_w + new_tokens

    def on_layer(layer: int) -> None:
        checkpoint()
        if rec.start == 0:
            say(prefill_w / total_w * (layer + 1) / n_layers, f"running prefill: layer {layer + 1}/{n_layers}")

    rec = _Recorder({m: i for i, m in enumerate(req.layers)}, sink, on_layer)
    device = _input_device(model)
    t0 = time.perf_counter()
    all_ids, stopped, notes = list(req.ids), None, list(req.notes)
    eos = _eos_ids(tokenizer, model)
    with _recording(model, rec, attention), torch.inference_mode():
        say(0.0, f"running prefill over {P} tokens")
        out, keep = _prefill(model, torch.tensor([req.ids], device=device), rec)
        if rec.calls == 0:
            raise CaptureError(
                f"{info.architecture} did not call its attention through transformers' "
                "AttentionInterface, so kvviz cannot record it"
            )
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
            out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=cache, use_cache=True, **keep)
            cache = _cache_of(out)
        next_token = int(out.logits[0, -1].argmax())
    seconds = time.perf_counter() - t0
    n = len(all_ids)
    return {
        "n": n,
        "ids": all_ids,
        "stopped": stopped,
        "notes": notes,
        "next_token": next_token,
        "seconds": seconds,
        "q_scale": rec.q_scale,
        "attention": rec.attention,
        "message": f"captured {n} tokens ({P} prompt + {n - P} new) in {seconds:.1f} s",
    }


def _impl(model: Any) -> str:
    impl = model.config._attn_implementation or "eager"
    return impl[len(_IMPL_PREFIX) :] if impl.startswith(_IMPL_PREFIX) else impl


def _prefill(model: Any, x: Any, rec: _Recorder) -> tuple[Any, dict]:
    """The prefill forward; (its output, the kwargs later steps pass: logits_to_keep when the model has it)."""
    try:
        return model(input_ids=x, use_cache=True, logits_to_keep=1), {"logits_to_keep": 1}
    except TypeError as exc:  # an older model class without logits_to_keep
        if "logits_to_keep" not in str(exc):
            raise
        rec.calls = 0
        return model(input_ids=x, use_cache=True), {}


def _meta(
    model: Any, tokenizer: Any, info: ModelInfo, prompt: str, req: _Request, run: dict, attention: str | None
) -> dict[str, Any]:
    """The trace's provenance: the model and where it came from, the versions, the prompt, when."""
    import datetime

    import torch
    import transformers

    from kvviz.models.config import rope_inv_freq
    from kvviz.version import __version__

    n, P = run["n"], req.P
    cfg = info.config
    meta = {
        "source": "model",
        "model": info.label,
        "model_name": info.name,
        "path": info.path,
        "revision": getattr(model.config, "_commit_hash", None),
        "architecture": info.architecture,
        "config": cfg,
        "dtype": str(_model_dtype(model)).split(".")[-1],
        "device": info.device,
        "attn_implementation": run["attention"],
        "layer_kinds": [info.layer_kinds[i] if info.layer_kinds else "full_attention" for i in req.layers],
        "layer_windows": [info.layer_windows[i] if info.layer_windows else None for i in req.layers],
        "prompt": prompt,
        "prompt_sha256": hashlib.sha256(prompt.encode("utf-8")).hexdigest(),
        "prompt_tokens": P,
        "prompt_tokens_total": req.n_prompt_tokens,
        "truncated": req.n_prompt_tokens > P,
        "max_tokens": req.max_tokens,
        "new_tokens": n - P,
        "new_tokens_requested": req.new_tokens,
        "stopped": run["stopped"],
        "generated_text": tokenizer.decode(run["ids"][P:]) if n > P else "",
        "next_token": tokenizer.decode([run["next_token"]]),
        "token_ids": run["ids"],
        "layers": list(req.layers),
        "query_rescaled": run["q_scale"] != 1.0,
        "sliding_window": cfg.get("sliding_window"),
        "capture_seconds": round(run["seconds"], 3),
        "captured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kvviz_version": __version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": run["notes"],
    }
    inv_freq = rope_inv_freq(model)
    if inv_freq is not None:
        meta["rope_inv_freq"] = [float(x) for x in inv_freq]
    return meta


def _model_dtype(model: Any) -> Any:
    try:
        return next(model.parameters()).dtype
    except (StopIteration, AttributeError):
        import torch

        return torch.float32


def capture_trace(
    model_name: str = BUNDLED,
    prompt: str = "",
    new_tokens: int = 0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    layers: str | Sequence[int] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    progress: Progress | None = None,
    attention: str | None = "sdpa",
    out: str | os.PathLike | None = None,
) -> Trace:
    """Load `model_name` and capture `prompt`; progress covers loading (first 40%) and capture."""
    say = progress or (lambda f, m: None)
    if prompt is None or not str(prompt).strip():
        raise CaptureError("the prompt is empty: give some text to capture")
    model, tokenizer, info = load_model(model_name, device=device, dtype=dtype, progress=lambda f, m: say(0.4 * f, m))
    return capture(
        model,
        tokenizer,
        info,
        prompt,
        new_tokens,
        max_tokens,
        layers,
        progress=lambda f, m: say(0.4 + 0.6 * f, m),
        attention=attention,
        out=out,
    )


def forward_only(model: Any, ids: Sequence[int], attention: str | None = "sdpa") -> None:
    """The plain prefill forward pass capture() runs, with the same attention, without recording (benchmarks)."""
    import torch

    before = _impl(model)
    with _LOCK, torch.inference_mode():
        if attention and attention != before:
            model.set_attn_implementation(attention)
        try:
            model(input_ids=torch.tensor([list(ids)], device=_input_device(model)), use_cache=True, logits_to_keep=1)
        finally:
            if attention and attention != before:
                model.set_attn_implementation(before)


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    for src in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
