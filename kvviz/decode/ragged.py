"""Real-model decoding under a budget allocation over heads and layers.

`CompressedCache` keeps every KV head of a layer at the same length. The allocations
change that:
    pyramid  each layer has its own heavy budget (still one length per layer): the layer
             runs under its own spec (`allocation.layer_spec`), everything else unchanged.
    adakv    the heads of a layer hold different numbers of tokens (ragged; so do policies that keep by
             their own rule, `Policy.ragged`: a threshold, DuoAttention, KVzip): at the
             compression point AdaKV gives each head its heavy budget from the scores of the
             whole layer; afterwards each head evicts within its own budget (one-shot
             scorers: the lowest score outside sinks and window, as `evict_one` does). The
             oracle re-allocates from every step's own attention. Attention runs one KV
             head at a time over that head's kept tokens (deleted entries, as in the
             delete mode; the mask mode gives the same logits).
"""

from __future__ import annotations

import numpy as np

from kvviz.decode.cache import CompressedCache
from kvviz.decode.place import host
from kvviz.policies import ScoreContext, evict_one
from kvviz.policies.allocation import allocation_for, layer_spec, select_heads
from kvviz.policies.base import group_union
from kvviz.policies.registry import get_policy
from kvviz.spec import Spec, SpecError


def cache_class(spec: Spec):
    """The cache class a spec decodes with."""
    allocation = allocation_for(spec)
    if spec.evicts and (allocation.ragged or get_policy(spec.scorer).ragged):
        return RaggedCache
    if spec.evicts and allocation.per_layer:
        return PyramidCache
    return CompressedCache


class PyramidCache(CompressedCache):
    """Each layer decodes under its own heavy budget (PyramidKV: the allocation's `layer_spec`)."""

    def _n_context(self) -> int:
        """The tokens at the compression point (the prompt), which kvpress's schedule depends on."""
        return self.trace.context_len if self.trace is not None else self.n_tokens

    def _with_layer_spec(self, layer: int, fn, *args):
        base = self.spec
        self.spec = layer_spec(base, layer, self.L, self._n_context())
        try:
            return fn(*args)
        finally:
            self.spec = base

    def _score_and_keep(self) -> None:
        super()._score_and_keep()  # the trace and the scores, once
        if self.policy.needs_query:
            return
        from kvviz.policies import select

        n = self.n_tokens
        for layer in range(self.L):
            s = layer_spec(self.spec, layer, self.L, n)
            own = self.policy.compression_kept(self.scores[layer, :, :n], s)
            mask = select(self.scores[layer, :, :n], s) if own is None else own
            self.kept[layer] = np.stack([np.flatnonzero(r) for r in mask])

    def attend(self, layer: int, q, k, v, scaling: float):
        return self._with_layer_spec(layer, super().attend, layer, q, k, v, scaling)

    def kept_tokens(self) -> int:
        """Tokens per KV head, averaged over the layers (the pyramid gives each layer its own)."""
        return round(float(np.mean([kept.shape[1] for kept in self.kept])))


class RaggedCache(CompressedCache):
    """KV heads of one layer hold different numbers of tokens (AdaKV: the allocation's `head_budgets`)."""

    def __init__(self, spec: Spec, *args, **kwargs) -> None:
        super().__init__(spec, *args, **kwargs)
        if spec.positions == "cache":
            raise SpecError("re-rotating keys to cache slots is not simulated for ragged (AdaKV) caches")
        # per layer, per head (m_h,)
        self.heads_kept: list[list[np.ndarray]] = [[] for _ in range(self.L)]
        self.head_budget: list[np.ndarray | None] = [None] * self.L
        # record: (H, n) per step
        self.step_masks: list[list[np.ndarray]] = [[] for _ in range(self.L)]

    def _score_and_keep(self) -> None:
        super()._score_and_keep()
        n = self.n_tokens
        for layer in range(self.L):
            if self.policy.needs_query:
                self.heads_kept[layer] = [np.arange(n) for _ in range(self.H)]
                continue
            scores = self.scores[layer, :, :n]
            # a policy that keeps by its own rule gives the kept sets and caps (threshold, DuoAttention, KVzip)
            if self.policy.ragged:
                mask = self.policy.compression_kept(scores, self.spec)
                self.head_budget[layer] = self.policy.head_caps(scores, self.spec)
            else:
                heavy = allocation_for(self.spec).head_budgets(scores, self.spec)
                self.head_budget[layer] = self.spec.sink + self.spec.recent + heavy
                mask = select_heads(scores, self.spec, heavy)
            self.heads_kept[layer] = [np.flatnonzero(r) for r in mask]

    def kept_tokens(self) -> int:
        """Tokens per KV head, averaged over heads and layers (the heads of a layer differ)."""
        return round(float(np.mean([len(k) for heads in self.heads_kept for k in heads])))

    def kept_positions(self, layer: int) -> list[np.ndarray]:
        return list(self.heads_kept[layer])

    def head_counts(self) -> np.ndarray | None:
        """(layers, KV heads): the tokens each head's cache holds now (Quest: read at the last step)."""
        if self.evicts and self.policy.needs_query:
            return super().head_counts()
        return np.array([[len(k) for k in heads] for heads in self.heads_kept], dtype=np.int64)

    def kept_history(self, layer: int) -> np.ndarray:
        n = self.n_tokens
        out = np.zeros((len(self.step_masks[layer]), self.H, n), dtype=bool)
        for i, m in enumerate(self.step_masks[layer]):
            out[i, :, : m.shape[1]] = m
        return out

    def block_ok(self) -> bool:
        """Ragged heads attend one at a time over their own kept tokens: the exact step loop only."""
        return False

    def attend(self, layer: int, q, k, v, scaling: float):
        import torch

        if not self.compressed:
            return super().attend(layer, q, k, v, scaling)
        t = q.shape[1]
        start = self.length[layer]
        if start + t > self.capacity:
            raise RuntimeError(f"compressed cache capacity {self.capacity} exceeded")
        if t != 1:
            raise RuntimeError("after the prefill, decode one token at a time")
        self.k[layer, :, start] = k[:, 0]
        self.v[layer, :, start] = v[:, 0]
        p = start
        self.length[layer] = start + 1
        q = q.to(self.device, torch.float32)  # attention in float32 (kvviz.decode.place)
        spec, scores = self.spec, self.scores[layer]
        qg = q[:, 0].reshape(self.H, self.group, self.D)  # (H, g, D)
        ctx = ScoreContext(self.trace, layer, spec)
        if self.policy.needs_query:
            K_all = self.k[layer, :, : p + 1].float()
            a_full = torch.softmax(qg @ K_all.transpose(1, 2) * scaling, dim=-1)
            attention = host(a_full.reshape(self.Hq, -1)).astype(np.float64)
            query, keys = host(q[:, 0]), host(K_all)
            reads = self.policy.query_reads(attention, ctx, query=query, keys=keys)
            # Quest per query head: each head reads its own pages
            if reads is not None:
                # Quest stores all
                self.heads_kept[layer] = [np.arange(p + 1) for _ in range(self.H)]
                served = group_union(reads, self.H)
                self.read_counts[layer] = served.sum(axis=1)
                if self.record:
                    self.step_q[layer].append(query.copy())
                    self.step_masks[layer].append(served)
                return self._attend_reads(layer, q, reads, scaling)
            mask = self.policy.query_kept(attention, ctx, query=query, keys=keys)
            heads = [np.flatnonzero(r) for r in mask]
            self.read_counts[layer] = mask.sum(axis=1)
        else:
            scores[:, p] = self.policy.arrival_score(host(self.k[layer, :, p]), layer, p, spec)
            heads = []
            for h, idx in enumerate(self.heads_kept[layer]):
                idx = np.append(idx, p)
                if len(idx) > self.head_budget[layer][h]:
                    idx = evict_one(idx[None], scores[h : h + 1], spec, p)[0]
                heads.append(idx)
        self.heads_kept[layer] = heads
        if self.record:
            self.step_q[layer].append(host(q[:, 0]).copy())
            m = np.zeros((self.H, p + 1), dtype=bool)
            for h, idx in enumerate(heads):
                m[h, idx] = True
            self.step_masks[layer].append(m)
        out = torch.empty(self.H, self.group, self.D, device=self.device)
        for h, idx in enumerate(heads):
            K, V = self._kv_head(layer, h, idx)
            a = torch.softmax(qg[h] @ K.T * scaling, dim=-1)  # (g, m_h)
            out[h] = a @ V
        return out.reshape(self.Hq, 1, self.D)
