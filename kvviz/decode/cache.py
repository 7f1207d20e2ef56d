"""The compressed KV cache of one decode run (docs/definitions.md).

    prefill   the prompt runs with full attention; every layer's q, k, v are kept.
              At this compression point the policy scores the prompt from its own
              attention rows (a Trace of the prefill, the very scorers the explorer
              uses) and each KV head keeps sink + recent + heavy tokens.
    decode    each new token runs alone at its true position (explicit position_ids,
              so RoPE stays right however many tokens were evicted). In every layer:
                1. its post-RoPE k, v join the cache               kept += [p]
                2. the cache is trimmed back to the budget         lowest score out
                3. the query attends over what is kept, quantized
                     a = softmax(q . K_hat^T / sqrt(d)),  o = a . V_hat
                   K_hat, V_hat = kvviz.quant.quantize of the kept K / V (the last
                   `residual` kept tokens stay at full precision)
                4. streaming scorers fold a into their scores      H2O: +=, TOVA: =
              With Spec.compress_every = N (one-shot scorers) step 2 is skipped and,
              after the query of every N-th decode step, the layer's cache is scored
              again over what it holds and cut back to the budget
              (kvviz.policies.recompress, as the engine's simulation does it).
              Only the oracle looks at the full cache: top-k of this step's own
              full-precision attention (the bound, not a real policy).

Evicted entries are deleted: every KV head keeps the same number of tokens, so the kept
K / V gather into dense (kv_heads, kept, head_dim) tensors. `mode="mask"` instead keeps
every entry and gives evicted ones -inf logits; the tests check both give the same
logits, and that both match transformers' own eager attention with a 2-D mask with holes.
How the queries attend over what is kept, and teacher-forced steps in one pass: `kvviz.decode.attend`.
Allocations that give heads or layers different budgets: `kvviz.decode.ragged`.
torch is imported lazily (inside methods).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvviz.decode.attend import KeptAttention, check_run
from kvviz.decode.devtrace import Crossing, device_trace
from kvviz.decode.place import host, is_cpu, on
from kvviz.policies import ScoreContext, evict_one, get_policy, select
from kvviz.policies.base import group_union
from kvviz.policies.merging import fold_evicted
from kvviz.policies.recompress import is_due, layer_trace, recompressed
from kvviz.spec import Spec
from kvviz.trace import Trace

Progress = Callable[[float, str], None]


class CompressedCache(KeptAttention):
    """The K/V cache of one decode run under a Spec (mutable; one run only).

    Full-precision K / V of every position are stored (the oracle and the `mask` mode
    need them; the delete mode gathers what is kept). Shapes per layer:
        k, v     (kv_heads, capacity, head_dim)   post-RoPE, as the model's cache holds them
        kept     (kv_heads, m) int                positions the compressed cache holds, sorted
                                                  (every head holds the same number m)
        scores   (kv_heads, capacity) float      the policy's importance of each token
    """

    def __init__(
        self,
        spec: Spec,
        n_layers: int,
        n_q_heads: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        mode: str = "delete",
        tokens: Sequence[str] | None = None,
        record: bool = False,
        inv_freq=None,
        device=None,
        dtype=None,
    ) -> None:
        import torch

        check_run(spec, mode, inv_freq)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.dtype = torch.float32 if dtype is None else dtype
        # numpy views share the storage
        self.fast = is_cpu(self.device) and self.dtype == torch.float32
        self.inv_freq = None if inv_freq is None else torch.as_tensor(inv_freq, dtype=torch.float32, device=self.device)
        self.spec, self.mode = spec, mode
        self.policy = get_policy(spec.scorer)
        self.L, self.Hq, self.H, self.D = n_layers, n_q_heads, n_kv_heads, head_dim
        self.group = n_q_heads // n_kv_heads
        self.capacity = capacity
        # on the model's device, in its dtype (kvviz.decode.place)
        self.k = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)
        self.kept: list[np.ndarray] = [np.zeros((n_kv_heads, 0), dtype=np.int64)] * n_layers
        # what a scorer reads beyond the prefill, put in the prompt's trace (KVzip's reconstruction scores)
        self.extra_meta: dict = {}
        self.scores = np.zeros((n_layers, n_kv_heads, capacity))
        self.length = [0] * n_layers
        # the prompt's queries (Hq, n, D) per layer until the compression point (numpy or the device's)
        self.prefill_q: list = [None] * n_layers
        # bytes the compression points sent to the host (kvviz.decode.devtrace; 0 on the fast path)
        self.crossed = Crossing()
        self.tokens = tuple(tokens) if tokens is not None else None
        self.trace: Trace | None = None
        self.compressed = False
        self._quant_memo: dict[tuple[int, str], Any] = {}  # see _quantized
        self._rows = torch.arange(n_kv_heads, device=self.device)[:, None]  # (H, 1) for gathers
        self._rows_np = np.arange(n_kv_heads)[:, None]
        self.block = False  # True: teacher-forced steps may arrive as one block (see block_ok)
        # record=True keeps every decode query and kept set, to rebuild the run as a Trace
        self.record = record
        self.step_q: list[list[np.ndarray]] = [[] for _ in range(n_layers)]  # (Hq, D) per step
        self.step_kept: list[list[np.ndarray]] = [[] for _ in range(n_layers)]  # (H, m) per step
        # Quest: tokens each KV head read last
        self.read_counts: list[np.ndarray | None] = [None] * n_layers
        # compress_every: every decode query (Hq, D) per layer, which a later compression point scores with
        self.decode_q: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        # positions p after whose query
        self.recompressed_at: list[list[int]] = [[] for _ in range(n_layers)]

    # -- policy bookkeeping ------------------------------------------------------------
    @property
    def evicts(self) -> bool:
        return self.spec.evicts

    @property
    def n_tokens(self) -> int:
        return self.length[0]

    def kept_tokens(self) -> int:
        """Tokens each KV head holds now (the same for every head and layer)."""
        return int(self.kept[0].shape[1])

    def kept_positions(self, layer: int) -> list[np.ndarray]:
        """Per KV head, the positions its cache of `layer` holds now."""
        return list(self.kept[layer])

    def head_counts(self) -> np.ndarray | None:
        """(layers, KV heads): the tokens each cache holds now (Quest: read at the last step), which the
        memory line counts; None before any step where that is what the budget says."""
        if self.evicts and self.policy.needs_query:
            if any(c is None for c in self.read_counts):
                return None
            return np.stack(self.read_counts)
        return np.array([[k.shape[-1]] * self.H for k in self.kept], dtype=np.int64)

    def seed(self, prefix, n: int) -> None:  # prefix: a kvviz.decode.loop.Prefill
        """Fill the cache with the first n positions of a full-cache prefill (instead of running them)."""
        if self.compressed or self.length[0]:
            raise RuntimeError("seed an empty cache only")
        self.k[:, :, :n] = prefix.k[:, :, :n]
        self.v[:, :, :n] = prefix.v[:, :, :n]
        self.length = [n] * self.L
        self.prefill_q = [prefix.q[layer, :, :n] for layer in range(self.L)]  # numpy or the device's

    def compress(self) -> None:
        """The compression point: score the prompt from its own attention, keep what the policy keeps, and
        with Spec.merge fold what it evicts into what it keeps."""
        self._score_and_keep()
        if self.spec.merge and self.evicts:
            self._merge_evicted()

    def _merge_evicted(self) -> None:
        """Each KV head's evicted prompt values folded into its nearest kept tokens (kvviz.policies.merging),
        in the cache's own values: the kept rows change, keys stay. On the fast path the prompt's trace views
        the same storage, so its values are the merged ones from here on (the scores were taken before)."""
        n = self.n_tokens
        for layer in range(self.L):
            keys, values = host(self.k[layer, :, :n]), host(self.v[layer, :, :n])  # (H, n, D)
            for g, at in enumerate(self.kept_positions(layer)):
                kept = np.zeros(n, dtype=bool)
                kept[at] = True
                merged = fold_evicted(keys[g], values[g], kept)[at]  # (m_g, D)
                self.v[layer, g, on(at, self.device)] = on(merged, self.device).to(self.dtype)

    def _score_and_keep(self) -> None:
        """The policy scores the prompt from its own attention and selects (per layer `kept`)."""
        n = self.n_tokens
        tokens = self.tokens[:n] if self.tokens is not None else tuple(f"t{i}" for i in range(n))
        fields = dict(
            context_len=n,
            tokens=tuple(tokens),
            query_positions=np.arange(n),
            meta={
                "source": "model prefill",
                **({} if self.inv_freq is None else {"rope_inv_freq": self.inv_freq.tolist()}),
                **self.extra_meta,
            },
        )
        if self.fast:  # numpy views of the float32 CPU tensors: nothing is copied
            q = np.stack([host(x) for x in self.prefill_q])  # (L, Hq, n, D)
            k, v = host(self.k[:, :, :n]), host(self.v[:, :, :n])
            self.trace = Trace(q=q, k=k, v=v, **fields)
        else:  # the tensors stay on the device; what a scorer reads crosses (kvviz.decode.devtrace)
            qs = [on(x, self.device) if isinstance(x, np.ndarray) else x for x in self.prefill_q]
            self.trace = device_trace(
                qs, self.k[:, :, :n].unbind(0), self.v[:, :, :n].unbind(0), self.crossed, **fields
            )
        self.prefill_q = [None] * self.L
        for layer in range(self.L):
            if not self.evicts or self.policy.needs_query:
                self.kept[layer] = np.tile(np.arange(n), (self.H, 1))
                continue
            ctx = ScoreContext(self.trace, layer, self.spec)
            scores = np.broadcast_to(np.asarray(self.policy.score(ctx), dtype=np.float64), (self.H, n))
            self.scores[layer, :, :n] = scores
            if self.policy.ragged:  # heads of different lengths: RaggedCache keeps them
                continue
            # ChunkKV's whole chunks
            own = self.policy.compression_kept(self.scores[layer, :, :n], self.spec)
            self.kept[layer] = _indices(select(self.scores[layer, :, :n], self.spec) if own is None else own)
        self.compressed = True
        if not self.fast and not self.record and not (self.spec.compress_every and self.evicts):
            self.trace.q.release()  # nothing reads the prompt's queries again: the device's memory back

    def _context_q(self, layer: int):
        """The prompt's queries of one layer (Hq, c, D): numpy on the fast path, else the device's tensor."""
        q = self.trace.q
        return q[layer] if isinstance(q, np.ndarray) else q.layers[layer]

    def run_trace(self) -> Trace:
        """The run as a Trace (needs record=True): prefill queries, then every decode query.

        Keys and values are the full-precision ones the cache received, so the policies'
        own simulation can replay the run (the tests check it makes the same decisions).
        """
        if not self.record or self.trace is None:
            raise RuntimeError("run_trace needs CompressedCache(record=True) and a finished prefill")
        n = self.n_tokens
        steps = np.stack([np.stack(s_, axis=1) for s_ in self.step_q]) if self.step_q[0] else None
        context_q = np.stack([host(self._context_q(layer)) for layer in range(self.L)])
        q = context_q if steps is None else np.concatenate([context_q, steps], axis=2)
        tokens = (
            self.tokens[:n] if self.tokens is not None and len(self.tokens) >= n else tuple(f"t{i}" for i in range(n))
        )
        return Trace(
            q=q.astype(np.float32),
            k=host(self.k[:, :, :n]).copy(),
            v=host(self.v[:, :, :n]).copy(),
            context_len=self.trace.context_len,
            tokens=tuple(tokens),
            query_positions=np.arange(n),
            meta={"source": "compressed decode", "spec": self.spec.label()},
        )

    def kept_history(self, layer: int) -> np.ndarray:
        """(steps, kv_heads, n_tokens) bool: what the cache held at each decode step (record=True)."""
        n = self.n_tokens
        out = np.zeros((len(self.step_kept[layer]), self.H, n), dtype=bool)
        for i, kept in enumerate(self.step_kept[layer]):
            # a mask (Quest per query head: ragged unions)
            if kept.dtype == bool:
                out[i, :, : kept.shape[1]] = kept
            else:
                np.put_along_axis(out[i], kept, True, axis=1)
        return out

    # -- quantization of what is kept ------------------------------------------------------
    def attend(self, layer: int, q, k, v, scaling: float):
        """Attention of new queries q (Hq, t, D) given their k, v (H, t, D). Returns (Hq, t, D)."""
        import torch

        t = q.shape[1]
        start = self.length[layer]
        if start + t > self.capacity:
            raise RuntimeError(f"compressed cache capacity {self.capacity} exceeded")
        self.k[layer, :, start : start + t] = k
        self.v[layer, :, start : start + t] = v
        self.length[layer] = start + t
        # attention runs in float32 (kvviz.decode.place)
        q = q.to(self.device, torch.float32)
        if not self.compressed:
            if start != 0:
                raise RuntimeError("the prefill must start at position 0")
            return self._prefill(layer, q, scaling)
        if t != 1:
            if not self.block:
                raise RuntimeError("after the prefill, decode one token at a time")
            return self._attend_block(layer, q, start, scaling)
        p = start
        spec = self.spec
        scores = self.scores[layer]  # (H, capacity)
        qg = q[:, 0].reshape(self.H, self.group, self.D)  # (H, g, D)
        if self.policy.needs_query and self.evicts:
            # oracle: top-k by this step's full-precision attention (the policy sums the group)
            K_all = self.k[layer, :, : p + 1].float()  # (H, p+1, D)
            a_full = torch.softmax(qg @ K_all.transpose(1, 2) * scaling, dim=-1)  # (H, g, p+1)
            attention = host(a_full.reshape(self.Hq, -1)).astype(np.float64)  # (Hq, p+1)
            ctx, inputs = (ScoreContext(self.trace, layer, spec), dict(query=host(q[:, 0]), keys=host(K_all)))
            reads = self.policy.query_reads(attention, ctx, **inputs)
            # Quest per query head: each head reads its own pages
            if reads is not None:
                # Quest stores everything
                self.kept[layer] = np.tile(np.arange(p + 1), (self.H, 1))
                # per KV head, what it served: its group's union
                served = group_union(reads, self.H)
                self.read_counts[layer] = served.sum(axis=1)
                if self.record:
                    self.step_q[layer].append(host(q[:, 0]).copy())
                    self.step_kept[layer].append(served)
                return self._attend_reads(layer, q, reads, scaling)
            kept = _indices(self.policy.query_kept(attention, ctx, **inputs))
            self.read_counts[layer] = np.full(self.H, kept.shape[1])
        else:
            kept = self._arrive(layer, p)
        self.kept[layer] = kept
        if self.record:
            self.step_q[layer].append(host(q[:, 0]).copy())
            self.step_kept[layer].append(kept.copy())
        if self.mode == "delete":
            a, out = self._attend_deleted(layer, qg, kept, scaling)  # a (H, g, m)
        else:
            a, out = self._attend_masked(layer, qg, kept, scaling)
        if self.policy.streaming and self.evicts:
            at = (self._rows_np, kept)  # (H, m) fancy index
            seen = scores[at]  # (H, m)
            seen[seen == np.inf] = 0.0  # the new token has now been seen by a query
            # every position has a query here: before this one, p - i queries saw token i
            # its rows, (Hq, m)
            self.policy.update(
                seen,
                host(a.reshape(self.Hq, -1)).astype(np.float64),
                ScoreContext(self.trace, layer, spec),
                (p - kept).astype(np.float64),
            )
            scores[at] = seen
        if spec.compress_every and self.evicts:
            self._after_query(layer, p, q)
        return out.reshape(self.Hq, 1, self.D)

    def _after_query(self, layer: int, p: int, q) -> None:
        """compress_every: keep the query for later scoring; after every N-th decode step's query, score the
        layer's cache again over positions 0..p and keep `select`'s choice among what it holds."""
        # (Hq, D): numpy on the fast path, else stays on the device
        self.decode_q[layer].append(host(q[:, 0]).copy() if self.fast else q[:, 0].clone())
        if not is_due(p, self.trace.context_len, self.spec.compress_every):
            return
        n = p + 1
        tokens = self.tokens if self.tokens is not None and len(self.tokens) >= n else tuple(f"t{i}" for i in range(n))
        if self.fast:
            # (Hq, n, D)
            q_all = np.concatenate([self._context_q(layer), np.stack(self.decode_q[layer], axis=1)], axis=1)
            sub = layer_trace(
                q_all, host(self.k[layer, :, :n]), host(self.v[layer, :, :n]), layer, self.L, tokens, self.trace.meta
            )
        else:  # the layer's positions 0..p as every layer of a device trace (as layer_trace does)
            import torch

            q_all = torch.cat([self._context_q(layer).float(), torch.stack(self.decode_q[layer], dim=1)], dim=1)
            sub = device_trace(
                [q_all] * self.L,
                [self.k[layer, :, :n]] * self.L,
                [self.v[layer, :, :n]] * self.L,
                self.crossed,
                context_len=n,
                tokens=tuple(tokens[:n]),
                query_positions=np.arange(n),
                meta=self.trace.meta,
            )
        scores = np.broadcast_to(
            np.asarray(self.policy.score(ScoreContext(sub, layer, self.spec)), dtype=np.float64), (self.H, n)
        )
        self.scores[layer, :, :n] = scores
        self.kept[layer] = recompressed(self.kept[layer], self.scores[layer, :, :n], self.spec)
        self.recompressed_at[layer].append(p)

    def _arrive(self, layer: int, p: int) -> np.ndarray:
        """Token p joins layer's cache; the cache is trimmed back to the budget. Returns the kept set."""
        spec = self.spec
        kept = np.concatenate([self.kept[layer], np.full((self.H, 1), p)], axis=1)  # arrives
        self.scores[layer, :, p] = self.policy.arrival_score(host(self.k[layer, :, p]), layer, p, spec)
        # evict one per head
        if self.evicts and kept.shape[1] > spec.budget and not spec.compress_every:
            kept = evict_one(kept, self.scores[layer], spec, p)
        return kept


def _indices(mask: np.ndarray) -> np.ndarray:
    """(H, n) bool with the same count per row -> (H, m) sorted kept positions."""
    counts = mask.sum(axis=1)
    if not np.all(counts == counts[0]):
        raise RuntimeError("KV heads hold different numbers of tokens")
    return np.nonzero(mask)[1].reshape(mask.shape[0], -1)
