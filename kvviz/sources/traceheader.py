"""A trace file's header, read and checked before any array is: the safetensors JSON header (its length
and shape), kvviz's `__metadata__` strings (format, version, context length, tokens, meta, layer numbers;
`header_fields` writes them), every tensor's byte range (a truncated file fails here), what loading the
file would hold (`trace_work`, checked against the work budget), and `trace_info`, what a file holds
from its header alone. kvviz.sources.tracefile opens the arrays."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.limits import Part, Work
from kvviz.sources.tracewriter import FORMAT, ITEM_BYTES, VERSION
from kvviz.trace import TraceError

VERSIONS = ("1", "2")
MAX_HEADER_BYTES = 100 * 1024**2


def header_fields(context_len: int, tokens: tuple[str, ...], meta: dict, layers: list[int]) -> dict[str, str]:
    """The `__metadata__` strings of a trace file: format, version, labels, meta and layer numbers."""
    return {
        "format": FORMAT,
        "version": str(VERSION),
        "context_len": str(int(context_len)),
        "tokens": json.dumps(list(tokens), ensure_ascii=False),
        "meta": json.dumps(meta, ensure_ascii=False, default=str),
        "layers": json.dumps([int(n) for n in layers]),
    }


def _header_json(data: bytes, name: str, size: int) -> dict:
    """The safetensors header (a JSON object) from the first bytes of a file of `size` bytes."""
    if len(data) < 8:
        raise TraceError(f"{name} is too short to be a safetensors trace file")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > min(len(data), size) or n > MAX_HEADER_BYTES:
        raise TraceError(f"{name} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
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
    return Work(
        f"the trace file {name}",
        tuple(parts),
        lower="its size: capture fewer layers (kvviz capture --layers 0-7) or a shorter prompt",
    )


_AXES = {
    "q": ("layers", "query heads", "positions", "dims"),
    "k": ("layers", "KV heads", "positions", "dims"),
    "v": ("layers", "KV heads", "positions", "dims"),
    "logits": ("layers", "query heads", "queries", "positions"),
}


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
    if meta.get("version") not in VERSIONS:
        raise TraceError(
            f"{name} is a kvviz trace of format version {meta.get('version')}; "
            f"this kvviz reads versions {' and '.join(VERSIONS)} — capture it again"
        )
    return meta


def _labels(header: dict[str, str], name: str) -> tuple[int, tuple[str, ...], dict[str, Any]]:
    """(context_len, tokens, meta) from the `__metadata__` strings."""
    try:
        context_len = int(header["context_len"])
        tokens = tuple(json.loads(header["tokens"]))
        meta: dict[str, Any] = json.loads(header.get("meta", "{}"))
    except (KeyError, ValueError, TypeError) as exc:
        raise TraceError(f"{name} has a damaged header ({exc})") from None
    if not all(isinstance(t, str) for t in tokens) or not isinstance(meta, dict):
        raise TraceError(f"{name} has a damaged header (tokens must be strings, meta an object)")
    return context_len, tokens, meta


# --- format 2 ----------------------------------------------------------------------------------


def _tensor_table(header: dict, name: str, data_start: int, size: int) -> dict[str, tuple[str, tuple, int]]:
    """name -> (dtype code, shape, absolute first byte), with the byte ranges checked: each the size its
    shape says, back to back from the header's end to the file's end (a truncated file fails here)."""
    table, spans = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape = str(info["dtype"]), tuple(int(x) for x in info["shape"])
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise TraceError(
                f"{name} is not a safetensors file (tensor {key!r} has no dtype, shape or offsets)"
            ) from None
        if code not in ITEM_BYTES or any(x < 0 for x in shape):
            raise TraceError(f"{name}: tensor {key!r} has dtype {code} and shape {shape}; expected floats or integers")
        if b - a != int(np.prod(shape, dtype=np.int64)) * ITEM_BYTES[code]:
            raise TraceError(
                f"{name}: tensor {key!r} holds {b - a} bytes, but {code} {list(shape)} needs "
                f"{int(np.prod(shape, dtype=np.int64)) * ITEM_BYTES[code]}"
            )
        table[key] = (code, shape, data_start + a)
        spans.append((a, b))
    at = 0
    for a, b in sorted(spans):
        if a != at:
            raise TraceError(f"{name} is damaged: its tensors' byte ranges overlap or leave gaps")
        at = b
    if data_start + at != size:
        what = "truncated" if data_start + at > size else "longer than its tensors"
        raise TraceError(f"{name} is {what}: the header describes {data_start + at:,} bytes, the file has {size:,}")
    return table


def _layer_list(header: dict[str, str], name: str) -> list[int]:
    try:
        layers = json.loads(header.get("layers", "null"))
    except ValueError:
        layers = None
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, int) and x >= 0 for x in layers)
        or len(set(layers)) != len(layers)
    ):
        raise TraceError(f"{name} has a damaged header (layers must be a list of distinct layer numbers)")
    return layers


def _read_head(path: Path) -> tuple[bytes, int]:
    """A trace file's first bytes, its length prefix and (when that length is plausible) its JSON header,
    and the file's size: what the header checks need, without reading any array."""
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += f.read(n) if 0 < n <= MAX_HEADER_BYTES else b""
    return head, size


def trace_info(path: str | os.PathLike) -> dict[str, Any]:
    """What a trace file holds, from its header alone (no array is read): the manifest and the sizes."""
    path = Path(path)
    head, size = _read_head(path)
    header_json = _header_json(head, path.name, size)
    header = _read_header(head, path.name)
    context_len, tokens, meta = _labels(header, path.name)
    kinds: dict[str, dict[str, Any]] = {}
    for key, info in header_json.items():
        if key == "__metadata__":
            continue
        kind = key.split(".")[0]
        entry = kinds.setdefault(
            kind, {"dtype": str(info.get("dtype")), "tensors": 0, "bytes": 0, "shape": list(info.get("shape", []))}
        )
        entry["tensors"] += 1
        a, b = info.get("data_offsets", [0, 0])
        entry["bytes"] += int(b) - int(a)
    if header.get("version") == "2":
        _tensor_table(header_json, path.name, len(head), size)
        layers = _layer_list(header, path.name)
    else:
        layers = meta.get("layers") or list(range(int(header_json.get("q", {}).get("shape", [0])[0])))
    n_pos = len(tokens)
    return {
        "file": str(path),
        "bytes": size,
        "version": int(header.get("version", 0)),
        "context_len": context_len,
        "positions": n_pos,
        "layers": layers,
        "tensors": kinds,
        "bytes_per_token": round(sum(e["bytes"] for e in kinds.values()) / max(n_pos, 1), 1),
        "meta": {k: v for k, v in meta.items() if k not in ("token_ids", "config", "rope_inv_freq", "prompt")},
        "prompt": meta.get("prompt"),
    }
