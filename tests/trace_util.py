"""Shared test helpers: a Trace of a test's own random arrays with numbered tokens, and a trace file in
format 1 (the arrays whole, as files written before format 2 hold them)."""

import json

import numpy as np

from kvviz.trace import Trace


def numbered_trace(q, k, v, context_len: int, meta: dict, query_positions, **fields) -> Trace:
    """The trace of q, k, v (layers, heads, positions, head_dim) whose tokens are named t0, t1, ... and
    whose queries are at `query_positions`; the first `context_len` positions are the prompt. `fields`:
    more of the Trace's fields (logits)."""
    n = k.shape[2]
    return Trace(
        q=q,
        k=k,
        v=v,
        context_len=context_len,
        tokens=tuple(f"t{i}" for i in range(n)),
        query_positions=query_positions,
        meta=meta,
        **fields,
    )


def every_query_trace(q, k, v, context_len: int, meta: dict) -> Trace:
    """numbered_trace in which every position is a query."""
    return numbered_trace(q, k, v, context_len, meta, np.arange(k.shape[2]))


def save_format_1(path, arrays: dict, *, context_len: int, tokens, meta: dict, version: str = "1"):
    """Write `arrays` (q, k, query_positions, and v if any) to `path` as a format-1 trace file, its header
    saying `version`; returns `path`."""
    from safetensors.numpy import save_file

    header = {
        "format": "kvviz-trace",
        "version": version,
        "context_len": str(context_len),
        "tokens": json.dumps(list(tokens)),
        "meta": json.dumps(meta),
    }
    save_file(arrays, str(path), metadata=header)
    return path


def save_trace_format_1(t: Trace, path, meta: dict | None = None):
    """Write the trace `t` to `path` in format 1 (with `meta` in place of its own, if given); returns `path`."""
    arrays = {"q": t.q, "k": t.k, "query_positions": t.query_positions.astype(np.int64)}
    if t.v is not None:
        arrays["v"] = t.v
    return save_format_1(
        path, arrays, context_len=t.context_len, tokens=t.tokens, meta=t.meta if meta is None else meta
    )
