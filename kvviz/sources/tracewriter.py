"""Writing trace files, format 2 (safetensors), as the layers arrive.

One tensor a layer and a kind, named by the model's own layer number:

    q.<n>            (q_heads,  T, head_dim)     in the model's dtype (BF16, F16, F32 or F64)
    k.<n>, v.<n>     (kv_heads, T, head_dim)
    logits.<n>       (q_heads, n_queries, T)     optional (logit-only sources)
    query_positions  (n_queries,) I64;  noise_eps (T,) optional

Heads come first, so one head of one layer is one contiguous run of bytes: `safe_open(...).get_slice("q.15")[5]`
or kvviz's own reader (kvviz.sources.lazy) takes it without reading the rest.

The header (each tensor's dtype, shape and byte range, and the `__metadata__` strings) has its room
reserved up front and is written last; the tensors are written at their offsets as they come (`put`),
so a capture holds one layer's rows at a time, never the whole trace. The file is built under a temporary
name in the same folder and renamed over `path` only by `finish()`: a capture that fails or is cancelled
(`abort()`, or an exception inside `with`) leaves whatever was at `path` as it was.

numpy only (no torch): bfloat16 arrives as its raw 16-bit pattern (a uint16 array) with the code "BF16".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "kvviz-trace"
VERSION = 2
ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4}
CODES = {
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}
_CHUNK = 64 * 2**20  # bytes moved at a time when a finished file is laid out again


def code_of(a: np.ndarray) -> str:
    """The safetensors dtype code of a numpy array (float16/32/64, int32/64)."""
    try:
        return CODES[a.dtype]
    except KeyError:
        raise ValueError(f"kvviz traces store float16/32/64 or bfloat16 tensors, not {a.dtype}") from None


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: dtype code, shape, and its first byte after the header."""

    code: str
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_BYTES[self.code]


class TraceWriter:
    """A format-2 trace file written in place; see the module docstring. Use as a context manager."""

    def __init__(
        self, path: str | os.PathLike, tensors: dict[str, tuple[str, tuple[int, ...]]], reserve: int = 64 * 1024
    ):
        self.path = Path(path)
        self.slots: dict[str, Slot] = {}
        at = 0
        for name, (code, shape) in tensors.items():
            if code not in ITEM_BYTES:
                raise ValueError(f"tensor {name}: unknown dtype code {code}")
            self.slots[name] = Slot(code, tuple(int(x) for x in shape), at)
            at += self.slots[name].nbytes
        self.data_bytes = at
        self.base = _round8(8 + len(self._header({})) + int(reserve))  # the data's first byte
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{id(self):x}.partial")
        self.fd: int | None = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.base + self.data_bytes)  # sparse until written

    # --- writing ---------------------------------------------------------------------------
    def put(self, name: str, array: np.ndarray, start: int = 0) -> None:
        """Write `array` into tensor `name`: the whole tensor, or (start > 0 or fewer rows) rows
        start..start+n of axis 1 of every head (a (heads, n, ...) block, as a decode step brings)."""
        slot = self.slots[name]
        a = np.ascontiguousarray(array)
        if a.dtype.itemsize != ITEM_BYTES[slot.code] or a.ndim != len(slot.shape):
            raise ValueError(f"tensor {name}: got {a.dtype} {a.shape} for {slot.code} {slot.shape}")
        if start == 0 and a.shape == slot.shape:
            self._pwrite(a, slot.start)
            return
        if (
            a.ndim < 2
            or a.shape[0] != slot.shape[0]
            or a.shape[2:] != slot.shape[2:]
            or not 0 <= start <= slot.shape[1] - a.shape[1]
        ):
            raise ValueError(
                f"tensor {name}: rows {start}..{start + a.shape[1]} of shape {a.shape} do not fit {slot.shape}"
            )
        row = math.prod(slot.shape[2:]) * ITEM_BYTES[slot.code]  # bytes of one row
        # one run of bytes a head
        for h in range(a.shape[0]):
            self._pwrite(a[h], slot.start + (h * slot.shape[1] + start) * row)

    def _pwrite(self, a: np.ndarray, offset: int) -> None:
        view = memoryview(np.ascontiguousarray(a)).cast("B")
        pos = self.base + offset
        while len(view):
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n

    # --- finishing -------------------------------------------------------------------------
    def finish(self, metadata: dict[str, str], positions: int | None = None) -> Path:
        """Write the header and move the file to `path`. `positions` < the reserved T keeps only the first
        `positions` rows of every tensor whose axis 1 (or axis 0, 1-D) was T (a decode that stopped early)."""
        full = self._positions()
        if positions is not None and full is not None and positions < full:
            return self._relayout(metadata, full, positions)
        header = self._header(metadata)
        # the metadata outgrew its room: lay out again
        if 8 + len(header) > self.base:
            return self._relayout(metadata, full, full)
        # header length, padding included
        head = (self.base - 8).to_bytes(8, "little")
        # safetensors allows trailing spaces
        padded = header + b" " * (self.base - 8 - len(header))
        os.pwrite(self.fd, head + padded, 0)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file; `path` keeps what it had."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None or self.fd is not None:  # an error, or never finished
            self.abort()
        return False

    def _header(self, metadata: dict[str, str]) -> bytes:
        body: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
        for name, s in self.slots.items():
            body[name] = {"dtype": s.code, "shape": list(s.shape), "data_offsets": [s.start, s.start + s.nbytes]}
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def _positions(self) -> int | None:
        q = next((s for n, s in self.slots.items() if n.startswith("q.")), None)
        return None if q is None else q.shape[1]

    def _relayout(self, metadata: dict[str, str], full: int | None, keep: int | None) -> Path:
        """Copy into a fresh file with room for this header, cutting T to `keep` rows; bounded memory."""

        def cut(shape: tuple[int, ...]) -> tuple[int, ...]:
            if keep is None or keep == full:
                return shape
            if len(shape) == 1 and shape[0] == full:
                return (keep,)
            if len(shape) >= 2 and shape[1] == full:
                return (shape[0], keep, *shape[2:])
            return shape

        new = {n: (s.code, cut(s.shape)) for n, s in self.slots.items()}
        with TraceWriter(self.path, new, reserve=len(json.dumps(metadata, ensure_ascii=False).encode()) + 4096) as w:
            for name, s in self.slots.items():
                shape = new[name][1]
                if shape == s.shape:
                    self._copy(w, s.start, w.slots[name].start, s.nbytes)
                elif len(shape) == 1:
                    self._copy(w, s.start, w.slots[name].start, w.slots[name].nbytes)
                else:
                    row = math.prod(s.shape[2:]) * ITEM_BYTES[s.code]
                    for h in range(s.shape[0]):
                        self._copy(
                            w, s.start + h * s.shape[1] * row, w.slots[name].start + h * shape[1] * row, shape[1] * row
                        )
            path = w.finish(metadata)
        self.abort()
        return path

    def _copy(self, w: "TraceWriter", src: int, dst: int, n: int) -> None:
        done = 0
        while done < n:
            chunk = os.pread(self.fd, min(_CHUNK, n - done), self.base + src + done)
            if not chunk:
                raise OSError("the partial trace file ended early")
            os.pwrite(w.fd, chunk, w.base + dst + done)
            done += len(chunk)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8
