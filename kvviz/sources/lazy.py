"""A trace's q, k or v read from its file one layer (or one head) at a time.

`LayerStack` stands where a Trace holds a 4-D array (layers, heads, positions, dims). Indexing it the way
kvviz does - `a[layer]`, `a[layer, heads, rows]`, `a[layer, head, :n]` - reads only that layer's tensor
(or only that head's run of bytes when the second index is one head), widens it to float32 (bfloat16 and
float16 exactly), checks it for NaN / inf, and keeps the last blocks read (up to CACHE_BYTES, at least one).
Anything else (the whole
array) is read in full through `__array__`, against the work budget.

Reads are positional (os.pread) rather than a memory map: what a view read is freed when it leaves the
small cache, so the process holds what it shows, not every page it ever touched.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np

from kvviz.limits import Part, Work
from kvviz.trace import TraceError

# (offset, nbytes) -> bytes, offsets from the file's first byte
Reader = Callable[[int, int], bytes]
# blocks kept per stack: up to this many bytes, and always the last one read
CACHE_BYTES = 256 * 10**6


def file_reader(path: str) -> Reader:
    """Positional reads from `path`, through one descriptor held open (a file renamed over it later is not seen)."""
    fd = os.open(path, os.O_RDONLY)
    holder = _Fd(fd)

    def read(offset: int, n: int) -> bytes:
        out = os.pread(holder.fd, n, offset)
        if len(out) != n:
            raise TraceError(f"{os.path.basename(path)} is truncated: wanted {n} bytes at {offset}, got {len(out)}")
        return out

    read.holder = holder  # type: ignore[attr-defined] - keeps the descriptor alive with the reader
    return read


class _Fd:
    def __init__(self, fd: int):
        self.fd = fd

    def __del__(self):
        try:
            os.close(self.fd)
        except OSError:
            pass


def bytes_reader(data: bytes) -> Reader:
    view = memoryview(data)
    return lambda offset, n: view[offset : offset + n]


def widen(raw: bytes, code: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 (float64 stays float64) from a tensor's raw little-endian bytes; bfloat16 is the top half of a
    float32."""
    if code == "BF16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    dtype = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}[code]
    a = np.frombuffer(raw, dtype).reshape(shape)
    return a.astype(np.float32) if code == "F16" else a


class LayerStack:
    """(layers, heads, T, D) read lazily; tensor i lives at `starts[i]` (absolute offset) with dtype `code`."""

    lazy = True

    def __init__(
        self,
        what: str,
        name: str,
        read: Reader,
        starts: Sequence[int],
        code: str,
        shape: tuple[int, int, int, int],
        layer_numbers: Sequence[int],
        scale: float = 1.0,
        identity: str = "",
    ):
        self.what, self.name, self.read, self.identity = what, name, read, identity
        self.starts, self.code = list(starts), code
        self.shape = tuple(int(x) for x in shape)
        self.layer_numbers = list(layer_numbers)
        self.scale = float(scale)
        self.dtype = np.dtype(np.float64 if code == "F64" else np.float32)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        # the last file reads: (layer, head or None)
        self.reads: deque[tuple[int, int | None]] = deque(maxlen=1024)

    # --- what numpy code asks of an array --------------------------------------------------
    @property
    def ndim(self) -> int:
        return 4

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def held_bytes(self) -> int:
        """What reading holds at most: the cache (CACHE_BYTES, or one layer when a layer is bigger),
        never more than the whole stack."""
        return min(self.nbytes, max(CACHE_BYTES, self.nbytes // max(self.shape[0], 1)))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if key and isinstance(key[0], (int, np.integer)):
            layer = _index(int(key[0]), self.shape[0], "layer")
            if len(key) >= 2 and isinstance(key[1], (int, np.integer)):
                head = _index(int(key[1]), self.shape[1], "head")
                block, rest = self._block(layer, head), key[2:]
            else:
                block, rest = self._block(layer, None), key[1:]
            return block[rest] if rest else block
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):
        Work(
            f"reading all of {self.what} from {self.name}",
            (Part(self.what, tuple(zip(self.shape, ("layers", "heads", "positions", "dims"))), self.dtype.itemsize),),
            lower="the layers read: open one layer (kvviz compare --layer N reads only that one)",
        ).check()
        out = np.stack([self._read(i, None) for i in range(self.shape[0])])
        return out if dtype is None else out.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True):
        return np.asarray(self).astype(dtype, copy=copy)

    def reshape(self, *shape):
        return np.asarray(self).reshape(*shape)

    def fingerprint(self) -> str:
        """Cheap identity for caches, without reading: the file's (path, size, mtime) or the upload's
        sha256, and what this stack is within it."""
        return f"{self.identity or self.name}:{self.what}:{self.shape}:{self.code}:{self.scale}"

    # --- reading -------------------------------------------------------------------------------
    def _block(self, layer: int, head: int | None) -> np.ndarray:
        with self._lock:
            if (layer, None) in self._cache:
                whole = self._cache[(layer, None)]
                self._cache.move_to_end((layer, None))
                return whole if head is None else whole[head]
            if (layer, head) in self._cache:
                self._cache.move_to_end((layer, head))
                return self._cache[(layer, head)]
        block = self._read(layer, head)
        with self._lock:
            self._cache[(layer, head)] = block
            while len(self._cache) > 1 and sum(b.nbytes for b in self._cache.values()) > CACHE_BYTES:
                self._cache.popitem(last=False)
        return block

    def _read(self, layer: int, head: int | None) -> np.ndarray:
        _, H, T, D = self.shape
        item = 2 if self.code in ("BF16", "F16") else 4 if self.code == "F32" else 8
        per_head = T * D * item
        start = self.starts[layer] + (0 if head is None else head * per_head)
        shape = (H, T, D) if head is None else (T, D)
        Work(
            f"reading {self.what} of layer {self.layer_numbers[layer]}",
            (Part(self.what, tuple(zip(shape, ("heads", "positions", "dims")[-len(shape) :])), 4),),
            lower="the positions captured (kvviz capture --max-tokens)",
        ).check()
        self.reads.append((layer, head))
        block = widen(self.read(start, per_head * (H if head is None else 1)), self.code, shape)
        if self.scale != 1.0:
            block = block * np.float32(self.scale)
        if not np.isfinite(block).all():
            where = f"layer {self.layer_numbers[layer]}" + ("" if head is None else f", head {head}")
            raise TraceError(f"{self.name}: {self.what} of {where} contains NaN or infinite values")
        block.flags.writeable = False
        return block


def _index(i: int, n: int, what: str) -> int:
    j = i + n if i < 0 else i
    if not 0 <= j < n:
        raise IndexError(f"{what} {i} out of range 0-{n - 1}")
    return j
