"""Save and load traces as safetensors: arrays as tensors, labels and metadata as JSON in the header.

No pickle anywhere: safetensors holds raw tensors plus a string-to-string header.

Format 2 (what `save_trace` and `kvviz capture` write; kvviz.sources.tracewriter): one tensor per layer and
kind (`q.15`, `k.15`, `v.15`, named by the model's own layer number), heads first, in the model's dtype
(bfloat16 stays bfloat16). `load_trace` reads only the header and the small tensors; q, k, v come back
as lazy stacks (kvviz.sources.lazy) that read a layer, or one head of it, when a view asks for it.
Format 1 (one 4-D tensor each of q, k, v) still opens, read whole.

Either way loading checks the format version, shapes, dtypes, byte ranges (a truncated file) and
finiteness (format 2: of each block as it is read), and says what is wrong in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.limits import Part, Work
from kvviz.sources.lazy import LayerStack, Reader, bytes_reader, file_reader, widen
from kvviz.sources.tracewriter import FORMAT, ITEM_BYTES, VERSION, TraceWriter, code_of
from kvviz.trace import Trace, TraceError, layer_ranges

VERSIONS = ("1", "2")
MAX_HEADER_BYTES = 100 * 1024**2
_ARRAYS = ("q", "k", "v", "logits", "noise_eps", "query_positions")
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_FLOAT_CODES = ("F16", "BF16", "F32", "F64")


def header_fields(
    context_len: int, tokens: tuple[str, ...], meta: dict, layers: list[int]
) -> dict[str, str]:
    """The `__metadata__` strings of a trace file: format, version, labels, meta and layer numbers."""
    return {
        "format": FORMAT,
        "version": str(VERSION),
        "context_len": str(int(context_len)),
        "tokens": json.dumps(list(tokens), ensure_ascii=False),
        "meta": json.dumps(meta, ensure_ascii=False, default=str),
        "layers": json.dumps([int(n) for n in layers]),
    }


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write `trace` to `path` (safetensors, format 2), layer by layer; `path` appears only when complete."""
    numbers = trace.layer_numbers
    meta = dict(trace.meta)
    meta.pop("query_scale", None)  # the arrays written below hold the scaled queries
    kinds = [("q", trace.q), ("k", trace.k), ("v", trace.v), ("logits", trace.logits)]
    first = {kind: np.asarray(a[0]) for kind, a in kinds if a is not None}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, n in enumerate(numbers):
        for kind, a in kinds:
            if a is not None:
                tensors[f"{kind}.{n}"] = (code_of(first[kind]), tuple(a.shape[1:]))
    qp = np.asarray(trace.query_positions, np.int64)
    tensors["query_positions"] = ("I64", qp.shape)
    if trace.noise_eps is not None:
        tensors["noise_eps"] = (code_of(trace.noise_eps), trace.noise_eps.shape)
    with TraceWriter(path, tensors) as w:
        for i, n in enumerate(numbers):
            for kind, a in kinds:
                if a is not None:
                    w.put(f"{kind}.{n}", np.asarray(a[i]))
        w.put("query_positions", qp)
        if trace.noise_eps is not None:
            w.put("noise_eps", trace.noise_eps)
        return w.finish(header_fields(trace.context_len, trace.tokens, meta, list(numbers)))


def load_trace(path: str | os.PathLike) -> Trace:
    """Open a trace file written by `save_trace` or `kvviz capture`; raises TraceError with a clear reason.

    Format 2: reads the header and the small tensors now, q / k / v layer by layer as views ask.
    Format 1: reads the file whole, after checking its declared sizes against the work budget."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    size = path.stat().st_size
    # the header alone first: its shapes say the size
    with open(path, "rb") as f:
        head = f.read(8)
        head += (
            f.read(int.from_bytes(head, "little"))
            if len(head) == 8 and 0 < int.from_bytes(head, "little") <= MAX_HEADER_BYTES
            else b""
        )
    header = _header_json(head, path.name, size)
    meta = _read_header(head, path.name)
    if meta.get("version") == "2":
        st = path.stat()
        return _open_v2(
            header,
            meta,
            len(head),
            size,
            file_reader(str(path)),
            path.name,
            f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}",
        )
    trace_work(header, path.name, size).check()
    return trace_from_bytes(path.read_bytes(), name=path.name)


def trace_from_bytes(data: bytes, name: str = "upload") -> Trace:
    """Parse a trace from the bytes of a safetensors file (an upload, say).

    The header's shapes are checked against the work budget before any array is read."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    header_json = _tensors_header(data, name, len(data))
    header = _read_header(data, name)
    if header.get("version") == "2":
        n = int.from_bytes(data[:8], "little")
        return _open_v2(
            header_json,
            header,
            8 + n,
            len(data),
            bytes_reader(data),
            name,
            "sha256:" + hashlib.sha256(data).hexdigest(),
        )
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
            raise TraceError(
                f"{name}: tensor '{key}' has dtype {arr.dtype}; expected float16/32/64"
            )
    context_len, tokens, meta = _labels(header, name)

    def as_float(key: str):
        a = tensors.get(key)
        return None if a is None else (a.astype(np.float32) if a.dtype == np.float16 else a)

    return Trace(
        q=as_float("q"),
        k=as_float("k"),
        v=as_float("v"),
        context_len=context_len,
        tokens=tokens,
        query_positions=tensors["query_positions"].astype(np.int64),
        meta=meta,
        logits=as_float("logits"),
        noise_eps=as_float("noise_eps"),
    )


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


_ITEM_BYTES = {
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
}


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
            raise TraceError(
                f"{name} is not a safetensors file (tensor {key!r} has no shape or dtype)"
            ) from None
        if any(x < 0 for x in shape):
            raise TraceError(
                f"{name} is not a safetensors file (tensor {key!r} has a negative size)"
            )
        factors = tuple(
            (x, axis) for x, axis in zip(shape, _AXES.get(key, ()) + ("",) * len(shape))
        )
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
        raise TraceError(
            f"{name} is a safetensors file but not a kvviz trace (no '{FORMAT}' header)"
        )
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


def _tensor_table(
    header: dict, name: str, data_start: int, size: int
) -> dict[str, tuple[str, tuple, int]]:
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
            raise TraceError(
                f"{name}: tensor {key!r} has dtype {code} and shape {shape}; expected floats or integers"
            )
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
        raise TraceError(
            f"{name} is {what}: the header describes {data_start + at:,} bytes, the file has {size:,}"
        )
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
        raise TraceError(
            f"{name} has a damaged header (layers must be a list of distinct layer numbers)"
        )
    return layers


def _stack(
    table: dict,
    kind: str,
    layers: list[int],
    name: str,
    read: Reader,
    scale: float = 1.0,
    identity: str = "",
) -> LayerStack | None:
    """The lazy (layers, heads, T, D) stack of `kind` ('q', 'k', 'v', 'logits'), or None if absent."""
    present = [f"{kind}.{n}" in table for n in layers]
    if not any(present):
        return None
    if not all(present):
        missing = [n for n, p in zip(layers, present) if not p]
        raise TraceError(
            f"{name} has no '{kind}' tensor for layer{'s' if len(missing) > 1 else ''} "
            f"{layer_ranges(missing)}"
        )
    code, shape, _ = table[f"{kind}.{layers[0]}"]
    for n in layers:
        c, s, _ = table[f"{kind}.{n}"]
        if (c, s) != (code, shape) or len(s) != 3:
            raise TraceError(
                f"{name}: tensor '{kind}.{n}' is {c} {list(s)}; every layer's must be a 3-D "
                f"{code} {list(shape)}"
            )
    if code not in _FLOAT_CODES:
        raise TraceError(
            f"{name}: tensor '{kind}.{layers[0]}' has dtype {code}; expected F16, BF16, F32 or F64"
        )
    what = {"q": "queries", "k": "keys", "v": "values", "logits": "logits"}[kind]
    return LayerStack(
        what,
        name,
        read,
        [table[f"{kind}.{n}"][2] for n in layers],
        code,
        (len(layers), *shape),
        layers,
        scale,
        identity,
    )


def _small(table: dict, key: str, read: Reader, name: str) -> np.ndarray | None:
    if key not in table:
        return None
    code, shape, start = table[key]
    raw = read(start, int(np.prod(shape, dtype=np.int64)) * ITEM_BYTES[code])
    if code in ("I64", "I32"):
        return np.frombuffer(raw, "<i8" if code == "I64" else "<i4").reshape(shape).astype(np.int64)
    if code not in _FLOAT_CODES:
        raise TraceError(f"{name}: tensor '{key}' has dtype {code}")
    out = widen(raw, code, shape).copy()
    if not np.isfinite(out).all():
        raise TraceError(f"{name}: {key} contains NaN or infinite values")
    return out


def _open_v2(
    header_json: dict,
    header: dict[str, str],
    data_start: int,
    size: int,
    read: Reader,
    name: str,
    identity: str,
) -> Trace:
    table = _tensor_table(header_json, name, data_start, size)
    context_len, tokens, meta = _labels(header, name)
    layers = _layer_list(header, name)
    allowed = {f"{kind}.{n}" for kind in ("q", "k", "v", "logits") for n in layers} | {
        "query_positions",
        "noise_eps",
    }
    unknown = set(table) - allowed
    if unknown:
        raise TraceError(f"{name} has unexpected tensors: {', '.join(sorted(unknown)[:5])}")
    if "query_positions" not in table:
        raise TraceError(f"{name} has no 'query_positions' tensor")
    if table["query_positions"][0] not in ("I64", "I32"):
        raise TraceError(f"{name}: query_positions must be integers")
    scale = meta.get("query_scale", 1.0)
    if not isinstance(scale, (int, float)) or not np.isfinite(scale):
        raise TraceError(f"{name} has a damaged header (query_scale must be a number)")
    q = _stack(table, "q", layers, name, read, float(scale), identity)
    k = _stack(table, "k", layers, name, read, identity=identity)
    if q is None or k is None:
        raise TraceError(f"{name} has no '{'q' if q is None else 'k'}' tensors")
    if "layers" in meta or layers != list(range(len(layers))):
        meta["layers"] = layers
    return Trace(
        q=q,
        k=k,
        v=_stack(table, "v", layers, name, read, identity=identity),
        context_len=context_len,
        tokens=tokens,
        query_positions=_small(table, "query_positions", read, name),
        meta=meta,
        logits=_stack(table, "logits", layers, name, read, identity=identity),
        noise_eps=_small(table, "noise_eps", read, name),
    )


def trace_info(path: str | os.PathLike) -> dict[str, Any]:
    """What a trace file holds, from its header alone (no array is read): the manifest and the sizes."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += f.read(n) if 0 < n <= MAX_HEADER_BYTES else b""
    header_json = _header_json(head, path.name, size)
    header = _read_header(head, path.name)
    context_len, tokens, meta = _labels(header, path.name)
    kinds: dict[str, dict[str, Any]] = {}
    for key, info in header_json.items():
        if key == "__metadata__":
            continue
        kind = key.split(".")[0]
        entry = kinds.setdefault(
            kind,
            {
                "dtype": str(info.get("dtype")),
                "tensors": 0,
                "bytes": 0,
                "shape": list(info.get("shape", [])),
            },
        )
        entry["tensors"] += 1
        a, b = info.get("data_offsets", [0, 0])
        entry["bytes"] += int(b) - int(a)
    if header.get("version") == "2":
        _tensor_table(header_json, path.name, len(head), size)
        layers = _layer_list(header, path.name)
    else:
        layers = meta.get("layers") or list(
            range(int(header_json.get("q", {}).get("shape", [0])[0]))
        )
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
        "meta": {
            k: v
            for k, v in meta.items()
            if k not in ("token_ids", "config", "rope_inv_freq", "prompt")
        },
        "prompt": meta.get("prompt"),
    }


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()
