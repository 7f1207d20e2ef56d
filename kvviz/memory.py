"""Bytes of a compressed K / V cache: what the memory card shows (the budget ledger counts the same).

A cache of a (layer, KV head) holding n_kept tokens costs its K and V bytes under the spec's
quantization (`head_parts`: integer groups with scale / zero-point overhead, FP8 / FP4 formats,
the full-precision residual); Quest adds its per-page min / max keys and stores every token.
`memory_for` sums every cache from its own count (`counts`), so ragged allocations (AdaKV) and
policies that keep a number of their own (ChunkKV's whole chunks, Quest's reads per query head)
are exact; where every head holds min(its layer's budget, n) the budget alone gives the counts.

The peak: every method here compresses after a whole-context prefill (as kvpress's presses do, and as
transformers' QuantizedCache quantizes the prompt), so before the compression point the full 16-bit
cache of the context exists (kvpress #178). `kv_bytes_peak` is the larger of that prefill cache
(the context's tokens, or the n_tokens seen when the query is inside the context) and the cache
after compression. None of kvviz's methods prefills in chunks, so none has a smaller peak.

A sliding-window layer (Trace.layer_windows) is counted as what it is: the model keeps its last W tokens
there at full precision and no policy or quantizer touches it, so it holds min(W, tokens) tokens at 16
bits, before and after the compression point. "Full" is the model's own uncompressed cache: its full
layers hold every token, its sliding layers their window.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvviz.policies import get_policy
from kvviz.policies.allocation import allocation_for
from kvviz.quant import formats as qformats
from kvviz.quant import CacheBytes, kv_bytes_per_token, tensor_bytes
from kvviz.quant.integer import grouping
from kvviz.spec import Spec
from kvviz.trace import Trace


@dataclass(frozen=True)
class Memory:
    kv_bytes: float  # compressed K+V cache, all layers and KV heads, incl. scales/zero points
    kv_bytes_full: float  # the same tokens in a full 16-bit cache
    kept_tokens: int
    total_tokens: int
    # what one decode step reads (None: everything stored, as eviction)
    kv_bytes_read: float | None = None
    # tokens kept per KV head of each layer (pyramid: differs by layer)
    kept_per_layer: tuple[int, ...] = ()
    # the cache at its peak: the full 16-bit prefill cache (None: kv_bytes)
    kv_bytes_peak: float | None = None
    key_bytes: float | None = None  # the K part of kv_bytes (stored), the rest is V

    @property
    def bytes_read(self) -> float:
        """Bytes one query reads: all that is stored, except for read-selection methods (Quest)."""
        return self.kv_bytes if self.kv_bytes_read is None else self.kv_bytes_read

    @property
    def peak(self) -> float:
        """Bytes of the cache at its peak: the whole prefill before compression, or after it if larger."""
        return self.kv_bytes if self.kv_bytes_peak is None else max(self.kv_bytes_peak, self.kv_bytes)

    @property
    def ratio(self) -> float:
        """Compressed / full bytes (1.0 = no saving)."""
        return self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else 1.0

    @property
    def compression_ratio(self) -> float:
        """Full / compressed bytes (e.g. 4.0 = four times smaller)."""
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes else float("inf")


def memory_dict(m: Memory) -> dict:
    return {
        "kv_bytes": m.kv_bytes,
        "kv_bytes_full": m.kv_bytes_full,
        "compression_ratio": m.compression_ratio,
        "memory_ratio": m.ratio,
        "kept_tokens": m.kept_tokens,
        "total_tokens": m.total_tokens,
        "kv_bytes_read": m.bytes_read,
        "kv_bytes_peak": m.peak,
        "key_bytes": m.key_bytes,
        "value_bytes": None if m.key_bytes is None else m.kv_bytes - m.key_bytes,
    }


def seen_tokens(window: int | None, n_tokens: int) -> int:
    """Tokens a layer's uncompressed cache holds once n_tokens have arrived: every one, or a sliding
    layer's window."""
    return n_tokens if window is None else min(window, n_tokens)


def prefill_peak_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, n_tokens: int, context_len: int, windows: tuple[int | None, ...] = ()
) -> float:
    """The full 16-bit cache the prefill holds before it is compressed: the context's tokens (or the n_tokens
    seen, for a query inside the context), K and V, every layer and KV head; `windows` (one per layer):
    a sliding layer holds its window of them."""
    n = min(n_tokens, context_len) if context_len else n_tokens
    if not windows:
        return n * kv_bytes_per_token(n_layers, n_kv_heads, head_dim)
    return sum(seen_tokens(w, n) for w in windows) * kv_bytes_per_token(1, n_kv_heads, head_dim)


def memory_for(trace: Trace, spec: Spec, n_tokens: int, counts: np.ndarray | None = None) -> Memory:
    """Bytes of the compressed cache holding the first n_tokens, all layers and KV heads.

    counts (layers, kv_heads): the tokens each cache holds (Quest: reads), as `kept_counts` gives
    them; None = what the budget declares, which is exact wherever every head keeps
    min(its layer's budget, n_tokens) (`budget_is_exact`). Memory follows the bits settings
    whichever quantization model simulates the error.
    """
    key = None if counts is None else tuple(map(tuple, np.asarray(counts, dtype=np.int64).tolist()))
    return _memory(
        trace.n_layers,
        trace.n_kv_heads,
        trace.head_dim,
        spec,
        n_tokens,
        trace.context_len,
        key,
        trace.layer_windows if trace.has_sliding_layers else (),
    )


def budget_is_exact(spec: Spec) -> bool:
    """True where every KV head of a layer holds exactly min(the layer's budget, tokens seen): the
    budget alone gives the bytes. Ragged allocations (AdaKV) and policies that keep or read a
    number of their own (ChunkKV's whole chunks, Quest per query head) need the kept masks."""
    if not spec.evicts:
        return True
    # the cache grows to budget + N between compressions (policies.recompress)
    if spec.compress_every:
        return False
    return not allocation_for(spec).ragged and get_policy(spec.scorer).fills_budget(spec)


def head_parts(
    spec: Spec, n_kept: int, head_dim: int, n_kv_heads: int = 1, n_tokens: int | None = None, context_len: int = 0
) -> tuple[CacheBytes, CacheBytes]:
    """K and V bytes of one KV head's cache holding n_kept tokens once n_tokens (default n_kept) have arrived.

    Integer groups (KIVI) or, where the spec asks for them, FP8 / FP4 formats, rotation and HF's residual flush
    (n_kv_heads: the heads a per-tensor FP8 scale is shared by; context_len: where HF's flush starts).
    """
    if qformats.uses_formats(spec):
        residual = qformats.spec_residual_for_memory(spec, n_kept, n_tokens or n_kept, context_len)
        return tuple(qformats.tensor_bytes(spec, which, n_kept, head_dim, n_kv_heads, residual) for which in ("k", "v"))
    return tuple(
        tensor_bytes(n_kept, head_dim, bits, axis, **grouping(spec))
        for bits, axis in ((spec.key_bits, spec.key_axis), (spec.value_bits, spec.value_axis))
    )


def head_bytes(
    spec: Spec, n_kept: int, head_dim: int, n_kv_heads: int = 1, n_tokens: int | None = None, context_len: int = 0
) -> float:
    """Bytes of one KV head's K + V cache holding n_kept tokens under the spec's quantization."""
    return sum(b.total for b in head_parts(spec, n_kept, head_dim, n_kv_heads, n_tokens, context_len))


def page_meta_bytes(spec: Spec, n_tokens: int, head_dim: int) -> float:
    """Quest's per-page min and max keys of one KV head, 16 bits each."""
    return -(-n_tokens // spec.page_size) * 2 * head_dim * 2.0


@lru_cache(maxsize=256)
def _memory(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    spec: Spec,
    n_tokens: int,
    context_len: int = 0,
    counts: tuple[tuple[int, ...], ...] | None = None,
    windows: tuple[int | None, ...] = (),
) -> Memory:
    from kvviz.policies.allocation import layer_spec

    windows = windows or (None,) * n_layers
    token16 = kv_bytes_per_token(1, 1, head_dim)  # one KV head's K + V of one token at 16 bits

    def per_head(k: int) -> float:
        return head_bytes(spec, k, head_dim, n_kv_heads, n_tokens, context_len)

    def key_part(k: int) -> float:
        return head_parts(spec, k, head_dim, n_kv_heads, n_tokens, context_len)[0].total

    full = sum(seen_tokens(w, n_tokens) for w in windows) * n_kv_heads * token16
    peak = prefill_peak_bytes(n_layers, n_kv_heads, head_dim, n_tokens, context_len, windows)
    if counts is None:
        budgets = [layer_spec(spec, layer, n_layers, context_len).budget for layer in range(n_layers)]
        counts = tuple(
            (seen_tokens(w, n_tokens) if w is not None or not spec.evicts else min(b, n_tokens),) * n_kv_heads
            for b, w in zip(budgets, windows)
        )
    # a sliding layer's caches: their window, at 16 bits (K half of it)
    window_held = sum(k for c, w in zip(counts, windows) if w is not None for k in c)
    counts_full = [c for c, w in zip(counts, windows) if w is None]
    # every head's bytes from its own count (AdaKV's heads differ): the budget ledger's sum, exactly
    kept_per_layer = tuple(round(sum(c) / len(c)) for c in counts)
    mean_kept = round(sum(map(sum, counts)) / max(n_layers * n_kv_heads, 1))
    # Quest: stores all, reads the budget (its full layers; a sliding layer stores and reads its window)
    if spec.evicts and get_policy(spec.scorer).kind == "read":
        meta = page_meta_bytes(spec, n_tokens, head_dim)
        n_full = len(counts_full) * n_kv_heads
        read = sum(per_head(k) + meta for c in counts_full for k in c) + window_held * token16
        return Memory(
            kv_bytes=(per_head(n_tokens) + meta) * n_full + window_held * token16,
            kv_bytes_full=full,
            kept_tokens=round((n_tokens * n_full + window_held) / max(n_layers * n_kv_heads, 1)),
            total_tokens=n_tokens,
            kv_bytes_read=read,
            kept_per_layer=tuple(n_tokens if w is None else round(sum(c) / len(c)) for c, w in zip(counts, windows)),
            kv_bytes_peak=peak,
            key_bytes=(key_part(n_tokens) + meta) * n_full + window_held * token16 / 2,
        )
    stored = sum(per_head(k) for c in counts_full for k in c) + window_held * token16
    return Memory(
        kv_bytes=stored,
        kv_bytes_full=full,
        kept_tokens=mean_kept,
        total_tokens=n_tokens,
        kept_per_layer=kept_per_layer,
        kv_bytes_peak=peak,
        key_bytes=sum(key_part(k) for c in counts_full for k in c) + window_held * token16 / 2,
    )
