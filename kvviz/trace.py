"""The Trace: what every attention source produces.

A trace holds, per layer, the queries of the token positions that have one, and the
keys and values the KV cache stores for every position. Shapes:

    q      (layers, q_heads,  n_queries, head_dim)   queries at `query_positions`
    k, v   (layers, kv_heads, positions, head_dim)   what the cache stores (post-RoPE K)
    logits (layers, q_heads,  n_queries, positions)  optional exact logits (logit-only sources)

`context_len` is the compression point: positions < context_len are the prompt, whose
attention rows the policies may read; queries at positions >= context_len are the later
(decode) steps that read the compressed cache. The query at position p sees keys 0..p.
Query head h reads KV head h // (q_heads // kv_heads) (grouped-query attention).

Layers are indexed by position in these arrays; `layer_numbers` says which layer of the model each
position is (a capture of `--layers 0-3,15,29` holds 6 layers, numbered 0, 1, 2, 3, 15, 29).
`layer_windows` says how far each layer sees: None for full attention, W for a sliding-window layer
(Mistral, Gemma 2/3, gpt-oss), whose query at position p sees keys p-W+1..p only (meta["layer_windows"],
as a capture records them; a trace without them is full attention everywhere).

q, k, v may also be lazy stacks read from a file layer by layer (kvviz.sources.lazy: `lazy = True`,
indexed by layer first like the arrays); they check their own values for NaN / inf as they are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np


class TraceError(ValueError):
    """A trace that cannot be used; the message says what is wrong."""


@dataclass(frozen=True, eq=False)
class Trace:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    context_len: int
    tokens: tuple[str, ...]
    query_positions: np.ndarray  # (n_queries,) int64, strictly increasing
    meta: dict[str, Any] = field(default_factory=dict)
    logits: np.ndarray | None = None
    noise_eps: np.ndarray | None = None  # (positions,) the source's own first noise draw

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def placeholder(cls, n_positions: int, source: str) -> "Trace":
        """A stand-in with `n_positions` positions and nothing else (one layer, one head, head dim 1,
        all zeros): for widgets that only need a token count before a real trace exists."""
        z = np.zeros((1, 1, n_positions, 1), np.float32)
        return cls(
            q=z,
            k=z,
            v=None,
            context_len=n_positions,
            tokens=("",) * n_positions,
            query_positions=np.arange(n_positions),
            meta={"source": source},
        )

    # --- shape helpers -------------------------------------------------------------
    @cached_property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @cached_property
    def n_q_heads(self) -> int:
        return self.q.shape[1]

    @cached_property
    def n_kv_heads(self) -> int:
        return self.k.shape[1]

    @cached_property
    def n_positions(self) -> int:
        return self.k.shape[2]

    @cached_property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @cached_property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_q_heads // self.n_kv_heads

    @cached_property
    def layer_numbers(self) -> tuple[int, ...]:
        """The model's own number of each layer (meta["layers"] when a capture kept some; else 0..L-1)."""
        kept = self.meta.get("layers")
        if isinstance(kept, list) and len(kept) == self.n_layers and all(isinstance(x, int) for x in kept):
            return tuple(kept)
        return tuple(range(self.n_layers))

    @cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None for full attention (checked by `validate`)."""
        windows = self.meta.get("layer_windows")
        if windows is None:
            return (None,) * self.n_layers
        return tuple(None if w is None else int(w) for w in windows)

    def layer_kind(self, layer: int) -> str:
        """The kind of the layer at index `layer`, in transformers' words: "sliding_attention" or
        "full_attention"."""
        return "full_attention" if self.layer_windows[layer] is None else "sliding_attention"

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def layer_index(self, number: int) -> int:
        """Position in the arrays of the model's layer `number`; TraceError naming the layers there are."""
        try:
            return self.layer_numbers.index(int(number))
        except ValueError:
            raise TraceError(
                f"layer {number} is not in this trace: it has layers {layer_ranges(self.layer_numbers)}"
            ) from None

    def kv_head(self, q_head: int) -> int:
        return q_head // self.group_size

    @property
    def n_queries(self) -> int:
        return len(self.query_positions)

    @cached_property
    def later_queries(self) -> np.ndarray:
        """Indices (into query_positions) of the queries after the compression point."""
        return _frozen(np.flatnonzero(self.query_positions >= self.context_len))

    @cached_property
    def context_queries(self) -> np.ndarray:
        """Indices of the queries inside the context (what policies may read)."""
        return _frozen(np.flatnonzero(self.query_positions < self.context_len))

    @cached_property
    def evaluated_queries(self) -> np.ndarray:
        """The queries that read the compressed cache.

        Later queries when there are any; otherwise the last context query (whose own
        attention is then part of the history, as in the handbook's example).
        """
        later = self.later_queries
        return later if len(later) else _frozen(np.array([self.n_queries - 1]))

    @property
    def has_later_queries(self) -> bool:
        return len(self.later_queries) > 0

    def describe(self) -> str:
        return (
            f"{self.meta.get('source', 'trace')}: {self.n_layers} layers x "
            f"{self.n_q_heads} query heads ({self.n_kv_heads} KV) x "
            f"{self.n_positions} tokens, head dim {self.head_dim}, "
            f"context {self.context_len}, {len(self.later_queries)} later queries"
        )


def validate(t: Trace) -> None:
    """Check shapes, dtypes and finiteness; raise TraceError with a readable reason."""
    for name in ("q", "k"):
        a = getattr(t, name)
        if not (isinstance(a, np.ndarray) or is_lazy(a)) or a.ndim != 4:
            raise TraceError(f"{name} must be a 4-D array (layers, heads, positions, head_dim)")
    arrays = {"q": t.q, "k": t.k}
    if t.v is not None:
        arrays["v"] = t.v
        if t.v.shape != t.k.shape:
            raise TraceError(f"v has shape {t.v.shape} but k has {t.k.shape}")
    for name, a in arrays.items():
        if a.dtype.kind != "f":
            raise TraceError(f"{name} must hold floats, not {a.dtype}")
        if a.size == 0:
            raise TraceError(f"{name} is empty")
    L, Hq, Nq, D = t.q.shape
    Lk, Hkv, P, Dk = t.k.shape
    if (L, D) != (Lk, Dk):
        raise TraceError(f"q {t.q.shape} and k {t.k.shape} disagree on layers or head_dim")
    if Hkv < 1 or Hq % Hkv:
        raise TraceError(f"{Hq} query heads cannot share {Hkv} KV heads evenly")
    qp = np.asarray(t.query_positions)
    if qp.shape != (Nq,):
        raise TraceError(f"query_positions has {qp.shape} entries, q has {Nq} queries")
    if Nq and (qp.min() < 0 or qp.max() >= P or np.any(np.diff(qp) <= 0)):
        raise TraceError("query_positions must be increasing positions inside the trace")
    if not 1 <= t.context_len <= P:
        raise TraceError(f"context_len {t.context_len} must be between 1 and {P}")
    if len(t.tokens) != P:
        raise TraceError(f"{len(t.tokens)} token labels for {P} positions")
    if t.logits is not None and t.logits.shape != (L, Hq, Nq, P):
        raise TraceError(f"logits must have shape {(L, Hq, Nq, P)}, not {t.logits.shape}")
    if t.noise_eps is not None and t.noise_eps.shape != (P,):
        raise TraceError("noise_eps must have one value per position")
    # (a stand-in checked for its arrays alone, as policies.recompress.LayerTrace's, has no meta)
    windows = getattr(t, "meta", {}).get("layer_windows")
    if windows is not None and (
        not isinstance(windows, (list, tuple))
        or len(windows) != L
        or not all(w is None or (type(w) is int and w >= 1) for w in windows)
    ):
        raise TraceError(
            f"meta layer_windows must list a window in tokens (or null: full attention) for each of "
            f"the {L} layers, not {windows!r}"[:300]
        )
    for name, a in {**arrays, "logits": t.logits}.items():
        if a is not None and not is_lazy(a) and not np.isfinite(a).all():
            raise TraceError(f"{name} contains NaN or infinite values")


def is_lazy(a: Any) -> bool:
    """True for an array read from its file as it is indexed (kvviz.sources.lazy.LayerStack)."""
    return getattr(a, "lazy", False) is True


def held_bytes(a: Any) -> int:
    """Bytes an array holds in memory: all of it, or for a lazy stack what its reads keep at most."""
    return int(a.held_bytes) if is_lazy(a) else int(a.nbytes)


def layer_ranges(numbers: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 3, 15, 29] -> '0-3, 15, 29'."""
    out, run = [], []
    for n in list(numbers) + [None]:
        if run and (n is None or n != run[-1] + 1):
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        if n is not None:
            run.append(n)
    return ", ".join(out)


def trace_with(t: Trace, **changes: Any) -> Trace:
    """A copy of `t` with some fields replaced (re-validated)."""
    return replace(t, **changes)


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only array: cached index arrays are shared by every caller."""
    a.flags.writeable = False
    return a
