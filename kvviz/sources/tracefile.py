"""Save and load traces as safetensors: arrays as tensors, labels and metadata as JSON in the header.

No pickle anywhere: safetensors holds raw tensors plus a string-to-string header.

Format 2 (what `save_trace` and `kvviz capture` write; kvviz.sources.tracewriter): one tensor per layer and
kind (`q.15`, `k.15`, `v.15`, named by the model's own layer number), heads first, in the model's dtype
(bfloat16 stays bfloat16). `load_trace` reads only the header and the small tensors; q, k, v come back
as lazy stacks (kvviz.sources.lazy) that read a layer, or one head of it, when a view asks for it.
Format 1 (one 4-D tensor each of q, k, v) still opens, read whole.

Either way loading checks the format version, shapes, dtypes, byte ranges (a truncated file; the header's
checks are kvviz.sources.traceheader's) and finiteness (format 2: of each block as it is read), and says
what is wrong in one line.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvviz.sources.lazy import LayerStack, Reader, bytes_reader, file_reader, widen
from kvviz.sources.traceheader import (
    _header_json,
    _labels,
    _layer_list,
    _read_head,
    _read_header,
    _tensor_table,
    _tensors_header,
    header_fields,
    trace_work,
)
from kvviz.sources.tracewriter import ITEM_BYTES, TraceWriter, code_of
from kvviz.trace import Trace, TraceError, layer_ranges

_ARRAYS = ("q", "k", "v", "logits", "noise_eps", "query_positions")
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_FLOAT_CODES = ("F16", "BF16", "F32", "F64")


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
    # the header alone first: its shapes say the size
    head, size = _read_head(path)
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
            raise TraceError(f"{name}: tensor '{key}' has dtype {arr.dtype}; expected float16/32/64")
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


# --- format 2 ----------------------------------------------------------------------------------


def _stack(
    table: dict, kind: str, layers: list[int], name: str, read: Reader, scale: float = 1.0, identity: str = ""
) -> LayerStack | None:
    """The lazy (layers, heads, T, D) stack of `kind` ('q', 'k', 'v', 'logits'), or None if absent."""
    present = [f"{kind}.{n}" in table for n in layers]
    if not any(present):
        return None
    if not all(present):
        missing = [n for n, p in zip(layers, present) if not p]
        raise TraceError(
            f"{name} has no '{kind}' tensor for layer{'s' if len(missing) > 1 else ''} {layer_ranges(missing)}"
        )
    code, shape, _ = table[f"{kind}.{layers[0]}"]
    for n in layers:
        c, s, _ = table[f"{kind}.{n}"]
        if (c, s) != (code, shape) or len(s) != 3:
            raise TraceError(
                f"{name}: tensor '{kind}.{n}' is {c} {list(s)}; every layer's must be a 3-D {code} {list(shape)}"
            )
    if code not in _FLOAT_CODES:
        raise TraceError(f"{name}: tensor '{kind}.{layers[0]}' has dtype {code}; expected F16, BF16, F32 or F64")
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
    header_json: dict, header: dict[str, str], data_start: int, size: int, read: Reader, name: str, identity: str
) -> Trace:
    table = _tensor_table(header_json, name, data_start, size)
    context_len, tokens, meta = _labels(header, name)
    layers = _layer_list(header, name)
    allowed = {f"{kind}.{n}" for kind in ("q", "k", "v", "logits") for n in layers} | {"query_positions", "noise_eps"}
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


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()
