"""Save and load traces as safetensors: arrays as tensors, labels and metadata as JSON in the header.

No pickle anywhere: safetensors holds raw tensors plus a string-to-string header.
Loading checks the format version, shapes, dtypes and finiteness, and says what is wrong; before any
array is read it checks the shapes the header declares against the work budget (kvviz.limits).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.limits import Part, Work
from kvviz.trace import Trace, TraceError

FORMAT = "kvviz-trace"
VERSION = 1
MAX_TRACE_BYTES = 2 * 1024**3
MAX_HEADER_BYTES = 100 * 1024**2
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
    with open(path, "rb") as f:                      # the header alone first: its shapes say the size
        head = f.read(8)
        head += f.read(int.from_bytes(head, "little")) if len(head) == 8 and \
            0 < int.from_bytes(head, "little") <= MAX_HEADER_BYTES else b""
    _tensors_header(head, path.name, size)
    return trace_from_bytes(path.read_bytes(), name=path.name)


def trace_from_bytes(data: bytes, name: str = "upload") -> Trace:
    """Parse a trace from the bytes of a safetensors file (an upload, say).

    The header's shapes are checked against the work budget before any array is read."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    _tensors_header(data, name, len(data))
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


def _header_json(data: bytes, name: str, size: int) -> dict:
    """The safetensors header (a JSON object) from the first bytes of a file of `size` bytes."""
    if len(data) < 8:
        raise TraceError(f"{name} is too short to be a safetensors trace file")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > min(len(data), size) or n > MAX_HEADER_BYTES:
        raise TraceError(f"{name} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise TraceError(f"{name} is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise TraceError(f"{name} is not a safetensors file (unreadable header)")
    return header


_ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def trace_work(header: dict, name: str, file_bytes: int) -> Work:
    """What loading holds at its peak: the file's bytes, every tensor as read (float16 also widened to
    float32) and the finiteness check's mask of the largest one, from the header's shapes alone."""
    parts = [Part("the file's bytes", ((file_bytes, "bytes"),), item_bytes=1)]
    largest = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            shape = [int(x) for x in info["shape"]]
            item = _ITEM_BYTES.get(str(info["dtype"]), 8)
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{name} is not a safetensors file (tensor {key!r} has no shape or dtype)") from None
        if any(x < 0 for x in shape):
            raise TraceError(f"{name} is not a safetensors file (tensor {key!r} has a negative size)")
        factors = tuple((x, axis) for x, axis in zip(shape, _AXES.get(key, ()) + ("",) * len(shape)))
        parts.append(Part(f"tensor '{key}'", factors, item_bytes=item + (4 if item == 2 else 0)))
        largest = max(largest, parts[-1].bytes // max(parts[-1].item_bytes, 1))
    parts.append(Part("the finiteness check", ((largest, "values"),), item_bytes=1))
    return Work(f"the trace file {name}", tuple(parts),
                lower="its size: capture fewer layers (kvviz capture --layers 0-7) or a shorter prompt")


_AXES = {"q": ("layers", "query heads", "positions", "dims"), "k": ("layers", "KV heads", "positions", "dims"),
         "v": ("layers", "KV heads", "positions", "dims"),
         "logits": ("layers", "query heads", "queries", "positions")}


def _tensors_header(data: bytes, name: str, size: int) -> dict:
    """The header, with the arrays it declares checked against the work budget."""
    header = _header_json(data, name, size)
    trace_work(header, name, size).check()
    return header


def _read_header(data: bytes, name: str) -> dict[str, str]:
    """The safetensors __metadata__ block, checked for our format and version."""
    header = _header_json(data, name, len(data))
    try:
        meta = header.get("__metadata__") or {}
    except AttributeError:
        raise TraceError(f"{name} is not a safetensors file (unreadable header)") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{name} is not a safetensors file (unreadable header)")
    if meta.get("format") != FORMAT:
        raise TraceError(f"{name} is a safetensors file but not a kvviz trace (no '{FORMAT}' header)")
    if meta.get("version") != str(VERSION):
        raise TraceError(f"{name} is a kvviz trace of format version {meta.get('version')}; "
                         f"this kvviz reads version {VERSION} — capture it again")
    return meta
