"""Attention rows computed on demand from q and k: a = softmax(q . K^T / sqrt(d)).

Never a full positions x positions matrix for every layer: callers ask for the rows
they need, one layer at a time, vectorised over heads and rows.

A sliding-window layer (Trace.layer_windows[layer] = W) is attended as the model attends it: the query
at position p sees keys p-W+1..p only (transformers' rule: key j is seen when p - W < j <= p), the
keys before get logit -inf and weight exactly zero.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Iterator
from contextlib import ContextDecorator
from functools import lru_cache

import numpy as np

from kvviz.limits import checkpoint
from kvviz.trace import Trace


M_TOP_PAD = -2  # glibc <malloc.h>
TOP_PAD_BYTES = 64 << 20
CHUNK_BYTES = 64_000_000  # context_rows: at most this much float32 attention a chunk


def keep_heap(top_pad: int = TOP_PAD_BYTES) -> bool:
    """Ask glibc malloc to keep `top_pad` bytes of freed heap, so the engine's temporaries
    reuse freed memory instead of faulting pages in again; True if it agreed.

    Every configuration allocates a few dozen (heads x tokens) temporaries of a few hundred
    kB. With glibc's default settings, freeing them shrinks the heap (the top chunk is
    trimmed back to the system), so the next allocation faults the same pages in again; in
    a virtual machine a page fault costs microseconds, and this alone measured 15x on
    `np.abs(a - b)` for an (8, 4128) array. A 64 MB top pad keeps that much freed memory
    mapped for reuse. Linux / glibc only; a no-op anywhere else.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TOP_PAD, ctypes.c_int(top_pad)))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        return False


@lru_cache(maxsize=1)
def _blas_libraries() -> tuple:
    """threadpoolctl's handles on the loaded BLAS libraries (none without threadpoolctl)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # optional: without it BLAS keeps its default threads
        return ()
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


class small_blas(ContextDecorator):
    """A context (or a function decorated with it) in which BLAS runs single-threaded.

    For many small products (one query row against the keys) waking BLAS worker threads
    costs more than the work, and on a busy machine a wake-up can stall for a whole
    scheduler slice - measured here at ~300 ms per configuration with 2 threads. (A
    direct get / set of the thread count: threadpoolctl's `limit` costs ~10 us a call.)

    BLAS's thread count belongs to the process, so the contexts count themselves across
    threads and nesting: the first one in sets it, the last one out restores it, and one
    inside another costs nothing (a comparison's rows each opened one: 48 get / set calls,
    0.7 ms of a 6 ms comparison, where the comparison's own context now makes 3).
    """

    _lock = threading.Lock()
    _open = 0  # contexts open in this process
    _saved: list = []  # (library, its thread count) when the first one opened

    def __enter__(self):
        with small_blas._lock:
            if small_blas._open == 0:
                small_blas._saved = [(lib, lib.num_threads) for lib in _blas_libraries()]
                for lib, n in small_blas._saved:
                    if n != 1:
                        lib.set_num_threads(1)
            small_blas._open += 1
        return self

    def __exit__(self, *exc):
        with small_blas._lock:
            small_blas._open -= 1
            if small_blas._open == 0:
                for lib, n in small_blas._saved:
                    if n != 1:
                        lib.set_num_threads(n)
        return False


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax; -inf entries get exactly zero weight."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_and_log(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(softmax, log-softmax) over the last axis; one exp pass gives both."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    total = p.sum(axis=-1, keepdims=True)
    p /= total  # in place: no further (rows, n) temporaries
    z -= np.log(total)
    return p, z


def kv_runs(kv_heads: list[int]) -> list[tuple[int, slice]]:
    """(KV head, rows) for each maximal run of consecutive rows that read one KV head.

    Rows ordered by KV head make one run per KV head: one product each, on views.
    """
    runs, start = [], 0
    for i in range(1, len(kv_heads) + 1):
        if i == len(kv_heads) or kv_heads[i] != kv_heads[start]:
            runs.append((kv_heads[start], slice(start, i)))
            start = i
    return runs


def window_start(p: int, window: int | None) -> int:
    """The first key the query at position p sees: p - window + 1 on a sliding layer, else 0."""
    return 0 if window is None else max(0, p - window + 1)


def window_masks(trace: Trace, layer: int, positions) -> np.ndarray:
    """(len(positions), kv_heads, trace positions) bool: the keys each query at `positions` sees, every KV
    head alike — on a sliding layer its window (the cache the model keeps there), else keys 0..p."""
    positions = np.asarray(positions, dtype=int)
    out = np.zeros((len(positions), trace.n_kv_heads, trace.n_positions), dtype=bool)
    for i, p in enumerate(positions.tolist()):
        out[i, :, window_start(p, trace.layer_windows[layer]) : p + 1] = True
    return out


def logit_rows(trace: Trace, layer: int, heads: np.ndarray, qi: int) -> np.ndarray:
    """Logits of query qi (index into query_positions) for several heads over keys 0..p.

    Shape (len(heads), p+1), float64; computed in the trace's precision. A logit-only
    source returns its exact stored logits. On a sliding layer the keys before the window are -inf.
    """
    heads = np.asarray(heads, dtype=int)
    p = int(trace.query_positions[qi])
    if trace.logits is not None:
        out = trace.logits[layer, heads, qi, : p + 1].astype(np.float64)
    else:
        q = trace.q[layer, heads, qi] * np.float32(1 / np.sqrt(trace.head_dim))  # (H, D)
        out = np.empty((len(heads), p + 1))
        for g, rows in kv_runs((heads // trace.group_size).tolist()):  # one matmul per run
            # (p+1, D) @ (D, h): BLAS is far faster this way round than q @ K^T
            out[rows] = (trace.k[layer, g, : p + 1] @ q[rows].T).T
    out[:, : window_start(p, trace.layer_windows[layer])] = -np.inf
    return out


def logit_row(trace: Trace, layer: int, head: int, qi: int) -> np.ndarray:
    """Logits of one head's query qi over keys 0..p, shape (p+1,)."""
    return logit_rows(trace, layer, np.array([head]), qi)[0]


def chunk_rows(n_heads: int, n_keys: int, chunk: int = 512) -> int:
    """Rows a context_rows chunk holds: `chunk`, fewer when heads x rows x keys would pass CHUNK_BYTES."""
    return max(1, min(chunk, CHUNK_BYTES // max(1, 4 * n_heads * n_keys)))


def context_rows(
    trace: Trace, layer: int, heads: np.ndarray, rows: np.ndarray, n_keys: int, chunk: int = 512, trim: bool = False
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Causal attention of context queries `rows` (indices into query_positions) over keys 0..n_keys-1.

    Yields (row_indices, attention) chunks, attention of shape (len(heads), chunk, n_keys),
    float32, zero where a query may not look (future keys, and on a sliding layer the keys before its
    window). Used by the history-based
    scorers; chunked so a long context never materialises all rows at once (at most
    CHUNK_BYTES a chunk), with a cancel checkpoint (kvviz.limits) before each chunk.

    trim=True leaves out the keys no query of the chunk may see: the attention then covers
    keys 0..m-1 only, m = min(n_keys, the chunk's last position + 1) — the causal triangle,
    half the work over a whole context. The values are the same to float32's precision, not
    bit for bit: the same products, and the trailing zeros left out add nothing to the row's
    max and sum, but a product of another shape may run another BLAS kernel (OpenBLAS picks
    it by processor), with another summation order in the last bits.
    """
    on_device = getattr(trace.k, "context_rows", None)  # computed where the arrays live (decode.devtrace)
    if on_device is not None and trace.logits is None:
        yield from on_device(trace, layer, heads, rows, n_keys, chunk, trim)
        return
    # a trace of some heads of another (kvviz.heads.head_trace) chunks its rows as that trace would
    full = getattr(trace, "full_q_heads", trace.n_q_heads)
    chunk = chunk_rows(len(heads) * full // trace.n_q_heads, n_keys, chunk)
    q_all = trace.q[layer][heads]  # (H, Nq, D)
    kv = trace.kv_head(np.asarray(heads))
    k = trace.k[layer][kv, :n_keys].astype(np.float32, copy=False)  # (H, n_keys, D)
    scale = np.float32(1.0 / np.sqrt(trace.head_dim))
    key_pos = np.arange(n_keys)
    for start in range(0, len(rows), chunk):
        checkpoint()
        idx = rows[start : start + chunk]
        positions = trace.query_positions[idx]
        m = min(n_keys, int(positions.max()) + 1) if trim and len(idx) else n_keys
        if trace.logits is not None:
            logits = trace.logits[layer][heads][:, idx, :m].astype(np.float32)
        else:
            q_t = np.swapaxes(q_all[:, idx].astype(np.float32, copy=False), 1, 2)  # (H, D, c)
            # (H, c, m); K.q^T is faster in BLAS. Single-threaded: one head's product is a skinny one
            # (m x D x c, c <= 512) and two BLAS threads on a busy 2-core machine took 6-9 s for the 8B
            # trace's 8 heads against 0.8-0.9 s on one (0.25 s of CPU); the same bits either way
            with small_blas():
                logits = np.swapaxes(np.matmul(k[:, :m], q_t), 1, 2)
            logits *= scale
        # keys before it: seen by every row
        first = min(m, int(positions.min()) + 1) if len(idx) else m
        # (c, m - first)
        future = key_pos[None, first:m] > positions[:, None]
        np.copyto(logits[..., first:], -np.inf, where=future[None])
        window = trace.layer_windows[layer]
        if window is not None:  # a sliding layer: keys before p - window + 1 are out of sight
            before = key_pos[None, :m] <= positions[:, None] - window  # (c, m)
            np.copyto(logits, -np.inf, where=before[None])
        logits -= logits.max(axis=-1, keepdims=True)
        np.exp(logits, out=logits)
        logits /= logits.sum(axis=-1, keepdims=True)
        yield idx, logits


def attention_sums(
    trace: Trace, layer: int, heads: np.ndarray, rows: np.ndarray, n_keys: int, trim: bool = False
) -> np.ndarray:
    """(len(heads), n_keys) float64: the attention the context queries `rows` pay each key 0..n_keys-1,
    summed over the rows (each chunk of context_rows summed in float64). Where the trace's arrays live on
    a device (kvviz.decode.devtrace) the sums are made there and only they cross to the host."""
    on_device = getattr(trace.k, "attention_sums", None)
    if on_device is not None and trace.logits is None:
        return on_device(trace, layer, heads, rows, n_keys, trim)
    out = np.zeros((len(heads), n_keys))
    for _, attn in context_rows(trace, layer, heads, rows, n_keys, trim=trim):
        out[:, : attn.shape[-1]] += attn.sum(axis=1, dtype=np.float64)
    return out


def row_norms(stack, layer: int, stop: int | None = None, float64: bool = False) -> np.ndarray:
    """(heads, positions) L2 norms of the rows (keys or values) of one layer of a trace array, up to
    `stop`: in the array's precision (float32 for a device's: kvviz.decode.devtrace), or summed in float64."""
    on_device = getattr(stack, "row_norms", None)
    if on_device is not None:
        return on_device(layer, stop, float64)
    x = stack[layer][:, :stop]
    if float64:
        return np.sqrt(np.einsum("hci,hci->hc", x, x, dtype=np.float64))
    return np.sqrt(np.vecdot(x, x))


def normalised_mean(stack, layer: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows 0..stop-1 of one layer of a trace array (keys): their norms (H, stop), the mean of the
    normalised rows a = mean_i k_i / ||k_i|| (H, D) and each row's dot with it (H, stop) (KeyDiff's inputs).

    In the keys' own precision, as kvpress computes it (float32 BLAS: a float64 copy of K cost 7x the
    time and moved no kept set in the kvpress reference test). Where the array lives on a device
    (kvviz.decode.devtrace) they are computed there and only they cross to the host."""
    on_device = getattr(stack, "normalised_mean", None)
    if on_device is not None:
        return on_device(layer, stop)
    keys = stack[layer][:, :stop]  # (H, c, d), the trace's dtype
    if keys.dtype not in (np.float32, np.float64):  # float16 and friends: float32
        keys = keys.astype(np.float32)
    norms = np.maximum(np.sqrt(np.einsum("hcd,hcd->hc", keys, keys)), keys.dtype.type(1e-12))
    # a BLAS product (1/||k||)^T K a head, no normalised copy of K
    anchor = np.matmul((1.0 / norms)[:, None, :], keys)[:, 0] / keys.dtype.type(stop)
    dots = np.matmul(keys, anchor[..., None])[..., 0]  # k_i . a, one BLAS product a head
    return norms, anchor, dots
