"""Save and load traces as safetensors: arrays as tensors, labels and metadata as JSON in the header.

No pickle anywhere: safetensors holds raw tensors plus a string-to-string header.
Loading checks the format version, shapes, dtypes and finiteness, and says what is wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.trace import Trace, TraceError

FORMAT = "kvviz-trace"
VERSION = 1
MAX_TRACE_BYTES = 2 * 1024**3
_ARRAYS = ("q", "k", "v", "logits", "noise_eps", "query_positions")
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write `trace` to `path` (safetensors). Returns the path."""
    from safetensors.numpy import save_file

    tensors = {name: np.ascontiguousarray(getattr(trace, name))
               for name in _ARRAYS if getattr(trace, name) is not None}
    tensors["query_positions"] = tensors["query_positions"].astype(np.int64)
    header = {
        "format": FORMAT,
        "version": str(VERSION),
        "context_len": str(int(trace.context_len)),
        "tokens": json.dumps(list(trace.tokens), ensure_ascii=False),
        "meta": json.dumps(trace.meta, ensure_ascii=False, default=str),
    }
    path = Path(path)
    save_file(tensors, str(path), metadata=header)
    return path


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by `save_trace`; raises TraceError with a clear reason."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    size = path.stat().st_size
    if size > MAX_TRACE_BYTES:
        raise TraceError(f"{path.name} is {size / 1e9:.1f} GB; the limit is {MAX_TRACE_BYTES / 1e9:.0f} GB")
    return trace_from_bytes(path.read_bytes(), name=path.name)


def trace_from_bytes(data: bytes, name: str = "upload") -> Trace:
    """Parse a trace from the bytes of a safetensors file (an upload, say)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    header = _read_header(data, name)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, Exception) as exc:  # noqa: BLE001 - any parse failure
        raise TraceError(f"{name} is not a readable safetensors file ({exc})") from None
    unknown = set(tensors) - set(_ARRAYS)
    if unknown:
        raise TraceError(f"{name} has unexpected tensors: {', '.join(sorted(unknown))}")
    for required in ("q", "k", "query_positions"):
        if required not in tensors:
            raise TraceError(f"{name} has no '{required}' tensor")
    for key, arr in tensors.items():
        if key == "query_positions":
            if arr.dtype.kind not in "iu":
                raise TraceError(f"{name}: query_positions must be integers")
        elif arr.dtype not in _FLOAT_DTYPES:
            raise TraceError(f"{name}: tensor '{key}' has dtype {arr.dtype}; expected float16/32/64")
    try:
        context_len = int(header["context_len"])
        tokens = tuple(json.loads(header["tokens"]))
        meta: dict[str, Any] = json.loads(header.get("meta", "{}"))
    except (KeyError, ValueError, TypeError) as exc:
        raise TraceError(f"{name} has a damaged header ({exc})") from None
    if not all(isinstance(t, str) for t in tokens) or not isinstance(meta, dict):
        raise TraceError(f"{name} has a damaged header (tokens must be strings, meta an object)")

    def as_float(key: str):
        a = tensors.get(key)
        return None if a is None else (a.astype(np.float32) if a.dtype == np.float16 else a)

    return Trace(q=as_float("q"), k=as_float("k"), v=as_float("v"), context_len=context_len,
                 tokens=tokens, query_positions=tensors["query_positions"].astype(np.int64),
                 meta=meta, logits=as_float("logits"), noise_eps=as_float("noise_eps"))


def _read_header(data: bytes, name: str) -> dict[str, str]:
    """The safetensors __metadata__ block, checked for our format and version."""
    if len(data) < 8:
        raise TraceError(f"{name} is too short to be a safetensors trace file")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data) or n > 100 * 1024**2:
        raise TraceError(f"{name} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
        meta = header.get("__metadata__") or {}
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise TraceError(f"{name} is not a safetensors file (unreadable header)") from None
    if meta.get("format") != FORMAT:
        raise TraceError(f"{name} is a safetensors file but not a kvviz trace (no '{FORMAT}' header)")
    if meta.get("version") != str(VERSION):
        raise TraceError(f"{name} is a kvviz trace of format version {meta.get('version')}; "
                         f"this kvviz reads version {VERSION} — capture it again")
    return meta
