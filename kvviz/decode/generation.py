"""Decoding a real model with a compressed KV cache, and what it does to the text.

The compressed cache (DESIGN.md sections 4 and 6):

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
              Only the oracle looks at the full cache: top-k of this step's own
              full-precision attention (the bound, not a real policy).

Evicted entries are deleted: every KV head keeps the same number of tokens, so the kept
K / V gather into dense (kv_heads, kept, head_dim) tensors. `mode="mask"` instead keeps
every entry and gives evicted ones -inf logits; the tests check both give the same
logits, and that both match transformers' own eager attention with a 2-D mask with holes.

We decode in our own loop (generate() derives positions from the mask, which is wrong
once the mask has holes): the model runs with use_cache=False and a registered
attention function that reads and writes this module's cache.

Quality against the full cache on the same text, teacher-forced: the prompt is the first
N tokens, the continuation the next M. The first continuation token is predicted by the
prefill, before any compression (as in real serving); each later one by a decode step
that reads the compressed cache.

    perplexity  = exp(mean_t  -log p_hat(x_t | x_<t))
    KL_t        = sum_v p(v | x_<t) (log p(v | x_<t) - log p_hat(v | x_<t))     nats
    top-1       = mean_t [argmax p_hat = argmax p]

torch is imported lazily (inside functions) so `import kvviz` stays fast.
"""

from __future__ import annotations

import math
from pathlib import Path
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvviz.engine import memory_for
from kvviz.policies import ScoreContext, evict_one, get_policy, select
from kvviz.quant import kivi_residual, quantize
from kvviz.quant.formats import hf_quantized_cache, quantize_tensor, uses_formats
from kvviz.quant.formats import residual_at as formats_residual_at
from kvviz.spec import FULL_BITS, Spec, SpecError
from kvviz.trace import Trace

ATTN_NAME = "kvviz_compressed"
MODES = ("delete", "mask")
MAX_PROMPT_TOKENS = 2048
MAX_NEW_TOKENS = 512

Progress = Callable[[float, str], None]
SAMPLE_TEXT_FILE = str(Path(__file__).resolve().parents[1] / "data" / "sample.txt")   # ~470 tokens of plain English


def sample_text() -> str:
    """The bundled English sample (written for kvviz) used by tests, demos and defaults."""
    with open(SAMPLE_TEXT_FILE, encoding="utf-8") as f:
        return f.read()

_LOCK = threading.RLock()        # one compressed run per model at a time (Streamlit threads)
_ACTIVE: dict[int, tuple] = {}   # id(model config) -> (cache, owning thread, the model's own attention)


# --- the compressed cache -------------------------------------------------------------

class CompressedCache:
    """The K/V cache of one decode run under a Spec (mutable; one run only).

    Full-precision K / V of every position are stored (the oracle and the `mask` mode
    need them; the delete mode gathers what is kept). Shapes per layer:
        k, v     (kv_heads, capacity, head_dim)   post-RoPE, as the model's cache holds them
        kept     (kv_heads, m) int                positions the compressed cache holds, sorted
                                                  (every head holds the same number m)
        scores   (kv_heads, capacity) float      the policy's importance of each token
    """

    def __init__(self, spec: Spec, n_layers: int, n_q_heads: int, n_kv_heads: int, head_dim: int,
                 capacity: int, mode: str = "delete", tokens: Sequence[str] | None = None,
                 record: bool = False, inv_freq=None) -> None:
        import torch

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if spec.positions == "cache":
            if inv_freq is None:
                raise SpecError("re-rotating keys to their cache slots needs the model's rotary embedding "
                                "(RoPE); this model has none kvviz can find")
            if mode != "delete":
                raise SpecError("keys re-rotated to cache slots are only simulated with deleted entries")
        self.inv_freq = None if inv_freq is None else torch.as_tensor(inv_freq, dtype=torch.float32)
        if spec.quant_model == "noise" and spec.noise_sigma > 0:
            raise SpecError("the logit-noise model is a stand-in for attention rows only; "
                            "on a real model use real K/V quantization (quant_model 'kv')")
        self.spec, self.mode = spec, mode
        self.policy = get_policy(spec.scorer)
        self.L, self.Hq, self.H, self.D = n_layers, n_q_heads, n_kv_heads, head_dim
        self.group = n_q_heads // n_kv_heads
        self.capacity = capacity
        self.k = torch.zeros(n_layers, n_kv_heads, capacity, head_dim)
        self.v = torch.zeros(n_layers, n_kv_heads, capacity, head_dim)
        self.kept: list[np.ndarray] = [np.zeros((n_kv_heads, 0), dtype=np.int64)] * n_layers
        self.scores = np.zeros((n_layers, n_kv_heads, capacity))
        self.length = [0] * n_layers
        self.prefill_q: list[np.ndarray | None] = [None] * n_layers
        self.tokens = tuple(tokens) if tokens is not None else None
        self.trace: Trace | None = None
        self.compressed = False
        self._quant_memo: dict[tuple[int, str], Any] = {}   # see _quantized
        self._rows = torch.arange(n_kv_heads)[:, None]   # (H, 1) for gathers
        self.block = False   # True: teacher-forced steps may arrive as one block (see block_ok)
        # record=True keeps every decode query and kept set, to rebuild the run as a Trace
        self.record = record
        self.step_q: list[list[np.ndarray]] = [[] for _ in range(n_layers)]       # (Hq, D) per step
        self.step_kept: list[list[np.ndarray]] = [[] for _ in range(n_layers)]    # (H, m) per step

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

    def kept_mask(self, layer: int) -> np.ndarray:
        """(kv_heads, n_tokens) bool: what layer's compressed cache holds now."""
        mask = np.zeros((self.H, self.length[layer]), dtype=bool)
        np.put_along_axis(mask, self.kept[layer], True, axis=1)
        return mask

    def seed(self, prefix: "Prefill", n: int) -> None:
        """Fill the cache with the first n positions of a full-cache prefill (instead of running them)."""
        if self.compressed or self.length[0]:
            raise RuntimeError("seed an empty cache only")
        self.k[:, :, :n] = prefix.k[:, :, :n]
        self.v[:, :, :n] = prefix.v[:, :, :n]
        self.length = [n] * self.L
        self.prefill_q = [np.ascontiguousarray(prefix.q[layer, :, :n]) for layer in range(self.L)]

    def compress(self) -> None:
        """The compression point: score the prompt from its own attention and select."""
        n = self.n_tokens
        q = np.stack(self.prefill_q)                                      # (L, Hq, n, D)
        k = self.k[:, :, :n].numpy()
        v = self.v[:, :, :n].numpy()
        tokens = self.tokens[:n] if self.tokens is not None else tuple(f"t{i}" for i in range(n))
        self.trace = Trace(q=q, k=k, v=v, context_len=n, tokens=tuple(tokens),
                           query_positions=np.arange(n), meta={"source": "model prefill", **(
                               {} if self.inv_freq is None else {"rope_inv_freq": self.inv_freq.tolist()})})
        self._context_q = q if self.record else None
        self.prefill_q = [None] * self.L
        for layer in range(self.L):
            if not self.evicts or self.policy.needs_query:
                self.kept[layer] = np.tile(np.arange(n), (self.H, 1))
                continue
            ctx = ScoreContext(self.trace, layer, self.spec)
            scores = np.broadcast_to(np.asarray(self.policy.score(ctx), dtype=np.float64), (self.H, n))
            self.scores[layer, :, :n] = scores
            self.kept[layer] = _indices(select(self.scores[layer, :, :n], self.spec))
        self.compressed = True

    def run_trace(self) -> Trace:
        """The run as a Trace (needs record=True): prefill queries, then every decode query.

        Keys and values are the full-precision ones the cache received, so the policies'
        own simulation can replay the run (the tests check it makes the same decisions).
        """
        if not self.record or self.trace is None:
            raise RuntimeError("run_trace needs CompressedCache(record=True) and a finished prefill")
        n = self.n_tokens
        steps = np.stack([np.stack(s_, axis=1) for s_ in self.step_q]) if self.step_q[0] else None
        q = self._context_q if steps is None else np.concatenate([self._context_q, steps], axis=2)
        tokens = self.tokens[:n] if self.tokens is not None and len(self.tokens) >= n else tuple(f"t{i}" for i in range(n))
        return Trace(q=q.astype(np.float32), k=self.k[:, :, :n].numpy().copy(), v=self.v[:, :, :n].numpy().copy(),
                     context_len=self.trace.context_len, tokens=tuple(tokens), query_positions=np.arange(n),
                     meta={"source": "compressed decode", "spec": self.spec.label()})

    def kept_history(self, layer: int) -> np.ndarray:
        """(steps, kv_heads, n_tokens) bool: what the cache held at each decode step (record=True)."""
        n = self.n_tokens
        out = np.zeros((len(self.step_kept[layer]), self.H, n), dtype=bool)
        for i, kept in enumerate(self.step_kept[layer]):
            np.put_along_axis(out[i], kept, True, axis=1)
        return out

    # -- quantization of what is kept ------------------------------------------------------
    def _quantized(self, layer: int, which: str, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """quantize(x[kept]) with the spec's settings, x (H, m, D) gathered at idx (H, m).

        Identical to calling kvviz.quant.quantize on the kept tokens every step, but each
        token is quantized once, when it leaves the residual window (token axis: a group
        is G channels of one token, so its value never changes), and each channel group
        once when it fills (channel axis; a group whose tokens change by an eviction in
        the middle of the cache is quantized again, as its members changed).
        """
        s = self.spec
        bits, axis = (s.key_bits, s.key_axis) if which == "k" else (s.value_bits, s.value_axis)
        m = x.shape[1]
        n_quant = max(0, m - s.residual)
        if n_quant == 0:
            return x
        sel = idx[:, :n_quant]
        out = np.empty_like(x)
        out[:, n_quant:] = x[:, n_quant:]
        memo = self._quant_memo.get((layer, which))
        if axis == "token":
            if memo is None:          # per cache position: its quantized value, and whether it is there yet
                memo = (np.zeros((self.H, self.capacity, self.D), dtype=x.dtype),
                        np.zeros((self.H, self.capacity), dtype=bool))
                self._quant_memo[(layer, which)] = memo
            values, done = memo
            todo = ~np.take_along_axis(done, sel, axis=1)                         # (H, n_quant)
            if todo.any():
                heads, cols = np.nonzero(todo)
                fresh = self._quantize_block(which, x[:, :n_quant][heads, cols][None])[0]   # (P, D)
                values[heads, sel[heads, cols]] = fresh
                done[heads, sel[heads, cols]] = True
            out[:, :n_quant] = values[self._rows.numpy(), sel]
            return out
        # channel axis: a group of G consecutive kept tokens; keep the quantized compacted cache
        if memo is None:
            memo = [np.full((self.H, self.capacity), -1, dtype=np.int64),
                    np.zeros((self.H, self.capacity, self.D), dtype=x.dtype), 0]
            self._quant_memo[(layer, which)] = memo
        kept_idx, values, length = memo
        same = _common_prefix(kept_idx[:, :length], sel)
        start = (same // s.group_size) * s.group_size
        values[:, start:n_quant] = self._quantize_block(which, x[:, start:n_quant])
        kept_idx[:, start:n_quant] = sel[:, start:]
        memo[2] = n_quant
        out[:, :n_quant] = values[:, :n_quant]
        return out

    def _quantize_block(self, which: str, x: np.ndarray) -> np.ndarray:
        """kvviz.quant.quantize of x (..., tokens, D) with the spec's K or V settings, no residual."""
        s = self.spec
        bits, axis = (s.key_bits, s.key_axis) if which == "k" else (s.value_bits, s.value_axis)
        return quantize(x, bits, axis, s.group_size, 0, s.symmetric, zero_point=s.zero_point, partial=s.partial)

    # -- attention ------------------------------------------------------------------------
    def attend(self, layer: int, q, k, v, scaling: float):
        """Attention of new queries q (Hq, t, D) given their k, v (H, t, D). Returns (Hq, t, D)."""
        import torch

        t = q.shape[1]
        start = self.length[layer]
        if start + t > self.capacity:
            raise RuntimeError(f"compressed cache capacity {self.capacity} exceeded")
        self.k[layer, :, start:start + t] = k
        self.v[layer, :, start:start + t] = v
        self.length[layer] = start + t
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
        scores = self.scores[layer]                                           # (H, capacity)
        qg = q[:, 0].reshape(self.H, self.group, self.D)                      # (H, g, D)
        if self.policy.needs_query and self.evicts:
            # oracle: top-k by this step's full-precision attention (the policy sums the group)
            K_all = self.k[layer, :, : p + 1]                                 # (H, p+1, D)
            a_full = torch.softmax(qg @ K_all.transpose(1, 2) * scaling, dim=-1)   # (H, g, p+1)
            attention = a_full.reshape(self.Hq, -1).numpy().astype(np.float64)     # (Hq, p+1)
            kept = _indices(self.policy.query_kept(attention, ScoreContext(self.trace, layer, spec),
                                                   query=q[:, 0].numpy(), keys=K_all.numpy()))
        else:
            kept = self._arrive(layer, p)
        self.kept[layer] = kept
        if self.record:
            self.step_q[layer].append(q[:, 0].numpy().copy())
            self.step_kept[layer].append(kept.copy())
        if self.mode == "delete":
            a, out = self._attend_deleted(layer, qg, kept, scaling)           # a (H, g, m)
        else:
            a, out = self._attend_masked(layer, qg, kept, scaling)
        if self.policy.streaming and self.evicts:
            seen = np.take_along_axis(scores, kept, axis=1)                   # (H, m)
            seen[np.isposinf(seen)] = 0.0         # the new token has now been seen by a query
            # every position has a query here: before this one, p - i queries saw token i
            self.policy.update(seen, a.reshape(self.Hq, -1).numpy().astype(np.float64),
                               ScoreContext(self.trace, layer, spec), (p - kept).astype(np.float64))
            np.put_along_axis(scores, kept, seen, axis=1)
        return out.reshape(self.Hq, 1, self.D)

    def _arrive(self, layer: int, p: int) -> np.ndarray:
        """Token p joins layer's cache; the cache is trimmed back to the budget. Returns the kept set."""
        spec = self.spec
        kept = np.concatenate([self.kept[layer], np.full((self.H, 1), p)], axis=1)   # arrives
        self.scores[layer, :, p] = self.policy.arrival_score(self.k[layer, :, p].numpy(), layer, p, spec)
        if self.evicts and kept.shape[1] > spec.budget:                       # evict one per head
            kept = evict_one(kept, self.scores[layer], spec, p, ties_evict_later=not self.policy.streaming)
        return kept

    # -- teacher forcing in one pass ---------------------------------------------------------
    def block_ok(self) -> bool:
        """Can the steps after the compression point run as one masked pass?

        Yes when the kept set at a step depends only on the tokens before it, never on the
        compressed model's own later attention: one-shot policies (their scores are fixed at
        the compression point; a later token's arrival score comes from its own key) and
        quantization alone. Not for streaming policies (H2O, TOVA: scores fold in each
        step's attention), the oracle (the step's own attention), the mask mode or a
        recorded run; nor for the serving formats, rotation or HF's residual flush (kvviz.quant.formats),
        which quantize each step's whole kept set afresh, with scales and a residual of that step.
        """
        return (self.mode == "delete" and not self.record
                and not (self.evicts and (self.policy.streaming or self.policy.needs_query))
                and not (self.spec.quant_model == "kv" and self.spec.quantizes and uses_formats(self.spec)))

    def _attend_block(self, layer: int, q, start: int, scaling: float):
        """t teacher-forced tokens at positions start.. in one pass, each query reading exactly
        the cache the step loop would give it: the kept set after its own arrival (and
        eviction), quantized as the loop quantizes it. Equal to t single steps."""
        import torch

        t = q.shape[1]
        kept_steps = []
        for i in range(t):                                   # the loop's own bookkeeping, token by token
            self.kept[layer] = self._arrive(layer, start + i)
            kept_steps.append(self.kept[layer])
        qg = q.reshape(self.H, self.group, t, self.D)                         # (H, g, t, D)
        s = self.spec
        quantized = s.quant_model == "kv" and (s.key_bits < FULL_BITS or s.value_bits < FULL_BITS)
        if not quantized and s.positions == "true":
            # one mask over the full cache: -inf where a step's cache does not hold a token
            n = start + t
            hole = np.full((t, self.H, n), -np.inf, dtype=np.float32)
            for i, kept in enumerate(kept_steps):
                np.put_along_axis(hole[i], kept, 0.0, axis=1)
            bias = torch.from_numpy(hole).permute(1, 0, 2)[:, None]           # (H, 1, t, n)
            K, V = self.k[layer, :, :n], self.v[layer, :, :n]                 # (H, n, D)
            a = torch.softmax(qg @ K[:, None].transpose(-1, -2) * scaling + bias, dim=-1)   # (H, g, t, n)
            out = a @ V[:, None]                                              # (H, g, t, D)
        else:
            # every step's own cache, gathered (quantized, re-rotated) and padded to the longest
            M = max(k.shape[1] for k in kept_steps)
            Ks = torch.zeros(t, self.H, M, self.D)
            Vs = torch.zeros(t, self.H, M, self.D)
            hole = np.full((t, self.H, M), -np.inf, dtype=np.float32)
            for i, kept in enumerate(kept_steps):
                m = kept.shape[1]
                K, V = self._kept_kv(layer, kept)
                if s.positions == "cache":
                    K = self._rerotated(K, kept, start + i)
                Ks[i, :, :m], Vs[i, :, :m] = K, V
                hole[i, :, :m] = 0.0
            bias = torch.from_numpy(hole)[:, :, None]                         # (t, H, 1, M)
            qt = qg.permute(2, 0, 1, 3)                                       # (t, H, g, D)
            a = torch.softmax(qt @ Ks.transpose(-1, -2) * scaling + bias, dim=-1)   # (t, H, g, M)
            out = (a @ Vs).permute(1, 2, 0, 3)                                # (H, g, t, D)
        return out.reshape(self.Hq, t, self.D)

    def _prefill(self, layer: int, q, scaling: float):
        """Full causal attention over the prompt; q is kept for the policies' Trace."""
        import torch

        n = q.shape[1]
        self.prefill_q[layer] = q.numpy().astype(np.float32, copy=True)
        K = self.k[layer, :, :n].repeat_interleave(self.group, dim=0)        # (Hq, n, D)
        V = self.v[layer, :, :n].repeat_interleave(self.group, dim=0)
        logits = q @ K.transpose(1, 2) * scaling                              # (Hq, n, n)
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        return torch.softmax(logits, dim=-1) @ V                              # (Hq, n, D)

    def _kept_kv(self, layer: int, idx: np.ndarray):
        """Kept K and V gathered at idx (H, m), quantized per the spec: (H, m, D) each."""
        import torch

        it = torch.from_numpy(idx)
        K = self.k[layer][self._rows, it]                                     # (H, m, D)
        V = self.v[layer][self._rows, it]
        s = self.spec
        if s.quant_model == "kv" and uses_formats(s):
            return self._kept_kv_formats(layer, K.numpy(), V.numpy(), idx)
        if s.quant_model == "kv" and s.key_bits < FULL_BITS:
            K = torch.from_numpy(self._quantized(layer, "k", K.numpy(), idx))
        if s.quant_model == "kv" and s.value_bits < FULL_BITS:
            V = torch.from_numpy(self._quantized(layer, "v", V.numpy(), idx))
        return K, V

    def _kept_kv_formats(self, layer: int, K: np.ndarray, V: np.ndarray, idx: np.ndarray):
        """FP8 / FP4 formats, rotation, HF's residual flush (kvviz.quant.formats): the whole
        kept set of every KV head is quantized afresh at each step (no reuse across steps)."""
        import torch

        s = self.spec
        residual = formats_residual_at(s, idx, self.length[layer] - 1, self.trace.context_len)
        if s.quantizes_keys:
            K = quantize_tensor(K, s, "k", residual)
        if s.quantizes_values:
            V = quantize_tensor(V, s, "v", residual)
        return torch.from_numpy(np.ascontiguousarray(K)), torch.from_numpy(np.ascontiguousarray(V))

    def _attend_deleted(self, layer: int, qg, kept: np.ndarray, scaling: float):
        import torch

        K, V = self._kept_kv(layer, kept)                                     # (H, m, D)
        if self.spec.positions == "cache":
            K = self._rerotated(K, kept, self.length[layer] - 1)
        a = torch.softmax(qg @ K.transpose(1, 2) * scaling, dim=-1)            # (H, g, m)
        return a, a @ V                                                        # out (H, g, D)

    def _rerotated(self, K, kept: np.ndarray, p: int):
        """Kept keys as if each sat at its cache slot, the query at its own slot (StreamingLLM).

        The cache holds post-RoPE keys at their true positions i; the query is rotated for
        its true position p. RoPE makes q_p . k_i depend on p - i only, so rotating each key
        by delta = (slot_k - slot_q) - (i - p) gives the logits of slot positions.
        """
        import torch

        m = kept.shape[1]
        slot_q = m - 1 if int(kept[0, -1]) == p else m        # the query's own slot (its token is kept)
        delta = (np.arange(m)[None, :] - slot_q) - (kept - p)                 # (H, m)
        angle = torch.from_numpy(delta.astype(np.float32))[..., None] * self.inv_freq   # (H, m, D/2)
        cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
        half = K.shape[-1] // 2
        rotated_half = torch.cat([-K[..., half:], K[..., :half]], dim=-1)     # transformers' rotate_half
        return K * cos + rotated_half * sin

    def _attend_masked(self, layer: int, qg, kept: np.ndarray, scaling: float):
        """Every entry stays; evicted ones get -inf logits. Returns a over the kept (H, g, m)."""
        import torch

        n = self.length[layer]
        K = self.k[layer, :, :n].clone()
        V = self.v[layer, :, :n].clone()
        s = self.spec
        it = torch.from_numpy(kept)
        if s.quant_model == "kv" and s.quantizes:
            Kq, Vq = self._kept_kv(layer, kept)
            K[self._rows, it] = Kq
            V[self._rows, it] = Vq
        mask = np.zeros((self.H, n), dtype=bool)
        np.put_along_axis(mask, kept, True, axis=1)
        hole = torch.from_numpy(np.where(mask, 0.0, -np.inf)).float()[:, None, :]   # (H, 1, n)
        a = torch.softmax(qg @ K.transpose(1, 2) * scaling + hole, dim=-1)          # (H, g, n)
        a_kept = torch.gather(a, 2, it[:, None, :].expand(-1, self.group, -1))       # (H, g, m)
        return a_kept, a @ V


def _indices(mask: np.ndarray) -> np.ndarray:
    """(H, n) bool with the same count per row -> (H, m) sorted kept positions."""
    counts = mask.sum(axis=1)
    if not np.all(counts == counts[0]):
        raise RuntimeError("KV heads hold different numbers of tokens")
    return np.nonzero(mask)[1].reshape(mask.shape[0], -1)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two (H, n) index arrays (all heads agreeing)."""
    n = min(a.shape[1], b.shape[1])
    diff = np.flatnonzero((a[:, :n] != b[:, :n]).any(axis=0))
    return int(diff[0]) if len(diff) else n


# --- plugging the cache into the model ----------------------------------------------------

def _fallback(module, implementation: str | None):
    """The attention function the model had before (for other threads sharing the model)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation in (None, "eager") and eager is not None:
        return eager
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: (B, Hq, t, D) query -> (B, t, Hq, D) output.

    Only the thread running the compressed decode reads the compressed cache; any other
    thread using the same model object meanwhile gets the model's own attention (and the
    eager mask transformers built for it), so a shared app model is never corrupted.
    """
    entry = _ACTIVE.get(id(module.config))
    if entry is None or entry[1] != threading.get_ident():
        before = entry[2] if entry is not None else "eager"
        return _fallback(module, before)(module, query, key, value, attention_mask, scaling=scaling,
                                         dropout=dropout, **kwargs)
    cache = entry[0]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(cache, list):          # a batch: row b reads and writes its own cache (decode_many)
        if query.shape[0] != len(cache):
            raise RuntimeError(f"a batch of {query.shape[0]} rows for {len(cache)} caches")
        import torch
        outs = [c.attend(module.layer_idx, query[b], key[b], value[b], scale) for b, c in enumerate(cache)]
        return torch.stack(outs).transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise RuntimeError("compressed decoding runs one sequence at a time")
    out = cache.attend(module.layer_idx, query[0], key[0], value[0], scale)    # (Hq, t, D)
    return out.transpose(0, 1)[None].contiguous(), None


@contextmanager
def compressed_cache(model, cache: CompressedCache):
    """Run `model` with its attention reading and writing `cache` (one run per model at a time)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, eager_mask)   # other threads still get causal masks
    with _LOCK:
        config = model.config
        before = config._attn_implementation
        _ACTIVE[id(config)] = (cache, threading.get_ident(), before)
        config._attn_implementation = ATTN_NAME
        try:
            yield cache
        finally:
            config._attn_implementation = before
            _ACTIVE.pop(id(config), None)


def rope_inv_freq(model):
    """The model's RoPE inverse frequencies (head_dim / 2,), or None if it has no rotary embedding."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and getattr(module, "inv_freq", None) is not None:
            return module.inv_freq.detach().float().cpu()
    return None


def model_dims(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) of a causal LM's text config."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_q = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return cfg.num_hidden_layers, n_q, getattr(cfg, "num_key_value_heads", None) or n_q, head_dim


# --- decode loops ------------------------------------------------------------------------

def _forward(model, ids: Sequence[int], start: int):
    """Logits (t, vocab) of tokens ids at positions start.. (explicit position_ids, no HF cache)."""
    import torch

    x = torch.tensor([list(ids)], dtype=torch.long)
    pos = torch.arange(start, start + len(ids))[None]
    return model(input_ids=x, position_ids=pos, use_cache=False).logits[0].float()


@dataclass(frozen=True, eq=False)
class Prefill:
    """One full-cache forward pass over a text, kept so every later run can start from it.

    Attention is full and causal, so the first n positions' q, k, v are exactly what a
    prefill of the first n tokens alone gives: a compressed run (any spec) over a prompt
    of n <= len(ids) tokens starts from here instead of running the prompt again.
        logits  (N, vocab) float32   the full-cache logits at every position
        k, v    (L, kv_heads, N, D)  post-RoPE, as a cache holds them
        q       (L, q_heads, N, D)   float32 numpy, for the policies' Trace of the prompt
    """

    ids: tuple[int, ...]
    logits: Any
    k: Any
    v: Any
    q: np.ndarray
    seconds: float

    def covers(self, prompt_ids: Sequence[int]) -> bool:
        n = len(prompt_ids)
        return 0 < n <= len(self.ids) and tuple(int(i) for i in prompt_ids) == self.ids[:n]


def prefill(model, ids: Sequence[int]) -> Prefill:
    """The full-cache forward over ids, keeping every layer's q, k, v (see Prefill)."""
    import torch

    ids = [int(i) for i in ids]
    if not ids:
        raise SpecError("the prompt is empty")
    L, Hq, Hkv, D = model_dims(model)
    cache = CompressedCache(Spec(), L, Hq, Hkv, D, capacity=len(ids))
    t0 = time.perf_counter()
    with torch.inference_mode(), compressed_cache(model, cache):
        logits = _forward(model, ids, 0)
    return Prefill(ids=tuple(ids), logits=logits, k=cache.k, v=cache.v, q=np.stack(cache.prefill_q),
                   seconds=time.perf_counter() - t0)


def decode(model, prompt_ids: Sequence[int], spec: Spec, steps: int,
           feed: Sequence[int] | None = None, mode: str = "delete", tokens: Sequence[str] | None = None,
           record: bool = False, on_step: Callable[[int, Any], None] | None = None, progress: Progress | None = None,
           timings: dict | None = None, prefix: Prefill | None = None, block: bool = False):
    """Prefill the prompt, compress, then run `steps` decode steps.

    Step i feeds feed[i] (teacher forcing) or, when feed is None, the greedy choice of
    the previous logits. Returns (logits (steps + 1, vocab) float32 tensor — row 0 from
    the prefill, row i+1 after feeding token i — the fed tokens, the cache). `timings`,
    if given, receives the seconds of the prefill (with the policy's scoring) and of the
    decode steps.

    `prefix`: a Prefill whose ids start with prompt_ids; the prompt is not run again.
    `block=True` with teacher forcing: when the spec allows it (CompressedCache.block_ok,
    one-shot policies and quantization), all steps run as one masked pass, equal to the
    step loop; otherwise the steps run one by one as usual.
    """
    import torch

    L, Hq, Hkv, D = model_dims(model)
    n = len(prompt_ids)
    if n < 1:
        raise SpecError("the prompt is empty")
    from kvviz.decode.ragged import cache_class   # allocations over heads / layers: ragged caches
    cache = cache_class(spec)(spec, L, Hq, Hkv, D, capacity=n + steps, mode=mode, tokens=tokens, record=record,
                              inv_freq=rope_inv_freq(model))   # RoPE: re-rotation, Expected Attention
    say = progress or (lambda f, m: None)
    rows, fed = [], []
    if prefix is not None and not prefix.covers(prompt_ids):
        prefix = None
    with torch.inference_mode(), compressed_cache(model, cache):
        say(0.0, f"prefill of {n} prompt tokens")
        t0 = time.perf_counter()
        if prefix is not None:
            cache.seed(prefix, n)
            last = prefix.logits[n - 1]
        else:
            last = _forward(model, prompt_ids, 0)[-1]
        cache.compress()
        t1 = time.perf_counter()
        rows.append(last)
        if block and feed is not None and steps > 1 and on_step is None and cache.block_ok():
            cache.block = True
            say(0.0, f"{steps} teacher-forced steps in one masked pass")
            rows.extend(_forward(model, [int(x) for x in feed[:steps]], n))
            fed = [int(x) for x in feed[:steps]]
            steps = 0
        for i in range(steps):
            tok = int(feed[i]) if feed is not None else int(torch.argmax(last))
            last = _forward(model, [tok], n + i)[-1]
            rows.append(last)
            fed.append(tok)
            if on_step is not None:
                on_step(i, last)
            if progress is not None and (i % 4 == 0 or i == steps - 1):
                say((i + 1) / max(steps, 1), f"decode step {i + 1}/{steps}")
        if timings is not None:
            timings.update(prefill=t1 - t0, decode=time.perf_counter() - t1)
    return torch.stack(rows), fed, cache


def decode_many(model, prompt_ids: Sequence[int], specs: Sequence[Spec], steps: Sequence[int],
                feeds: Sequence[Sequence[int] | None], prefix: Prefill | None = None,
                on_step: Callable[[int, int, Any], None] | None = None, tokens: Sequence[str] | None = None):
    """Several decode runs of one prompt side by side, one batched forward a step.

    Run r has its own spec and cache, runs steps[r] steps and feeds feeds[r][i] (teacher
    forcing) or, when feeds[r] is None, its own greedy choice. Each batch row attends over
    its own cache only, so every run gives what decode() gives it alone (the weights are
    read once a step for all of them: on a CPU a batch of 2-3 costs about one step).
    on_step(r, i, logits) after run r's step i. Returns [(logits, fed, cache)] per run.
    """
    import torch

    L, Hq, Hkv, D = model_dims(model)
    n = len(prompt_ids)
    if n < 1:
        raise SpecError("the prompt is empty")
    if prefix is None or not prefix.covers(prompt_ids):
        prefix = prefill(model, prompt_ids)
    R = len(specs)
    caches = [CompressedCache(spec, L, Hq, Hkv, D, capacity=n + st, tokens=tokens,
                              inv_freq=rope_inv_freq(model) if spec.positions == "cache" else None)
              for spec, st in zip(specs, steps)]
    rows = [[prefix.logits[n - 1]] for _ in range(R)]
    fed: list[list[int]] = [[] for _ in range(R)]
    active: list = []
    with torch.inference_mode(), compressed_cache(model, active):
        for c in caches:
            c.seed(prefix, n)
            c.compress()
        for i in range(max(steps, default=0)):
            live = [r for r in range(R) if steps[r] > i]
            toks = [int(feeds[r][i]) if feeds[r] is not None else int(torch.argmax(rows[r][-1])) for r in live]
            active[:] = [caches[r] for r in live]
            x = torch.tensor([[t] for t in toks], dtype=torch.long)
            pos = torch.full((len(live), 1), n + i, dtype=torch.long)
            logits = model(input_ids=x, position_ids=pos, use_cache=False).logits[:, -1].float()
            for j, r in enumerate(live):
                rows[r].append(logits[j])
                fed[r].append(toks[j])
                if on_step is not None:
                    on_step(r, i, logits[j])
    return [(torch.stack(rows[r]), fed[r], caches[r]) for r in range(R)]


def plain_decode(model, prompt_ids: Sequence[int], steps: int, feed: Sequence[int] | None = None,
                 timings: dict | None = None):
    """The plain full-cache baseline: transformers' DynamicCache, one token a step.

    Returns (logits (steps + 1, vocab), fed tokens). Used by the benchmark and as an
    independent check of the compressed path with compression off.
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    rows, fed = [], []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([list(prompt_ids)]), past_key_values=cache, use_cache=True)
        last = out.logits[0, -1].float()
        t1 = time.perf_counter()
        rows.append(last)
        for i in range(steps):
            tok = int(feed[i]) if feed is not None else int(torch.argmax(last))
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            last = out.logits[0, -1].float()
            rows.append(last)
            fed.append(tok)
        if timings is not None:
            timings.update(prefill=t1 - t0, decode=time.perf_counter() - t1)
    return torch.stack(rows), fed


def masked_reference_logits(model, ids: Sequence[int], prompt_len: int, evicted: Callable[[int], Sequence[int]]):
    """transformers' own eager attention with a 2-D mask with holes and explicit position_ids.

    The full DynamicCache is kept; at decode position p the mask zeroes `evicted(p)`.
    Returns logits (len(ids) - prompt_len + 1, vocab): the same rows `decode` returns.
    The independent check that deleting cache entries equals masking them.
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    rows = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids[:prompt_len])]), past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(prompt_len)[None])
        rows.append(out.logits[0, -1].float())
        for p in range(prompt_len, len(ids)):
            mask = torch.ones(1, p + 1, dtype=torch.long)
            mask[0, list(evicted(p))] = 0
            out = model(input_ids=torch.tensor([[ids[p]]]), past_key_values=cache, use_cache=True,
                        attention_mask=mask, position_ids=torch.tensor([[p]]))
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


# --- quality against the full cache ---------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Reference:
    """The full-cache model on one text: token ids and the continuation's true log-probs."""

    ids: tuple[int, ...]
    prompt_len: int
    tokens: tuple[str, ...]          # display strings of every token
    logp: Any                        # torch (M, vocab) full-cache log-probs predicting each continuation token
    seconds: float
    prefill: Prefill | None = None   # the full-cache pass it came from: compressed runs start from it

    @property
    def n_continuation(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def targets(self) -> np.ndarray:
        return np.asarray(self.ids[self.prompt_len:])


def token_strings(tokenizer, ids: Sequence[int]) -> tuple[str, ...]:
    """Each token as the text it adds (leading spaces kept)."""
    return tuple(tokenizer.decode([int(i)]) for i in ids)


def tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def check_lengths(n_ids: int, prompt_tokens: int, continuation_tokens: int | None,
                  max_prompt: int = MAX_PROMPT_TOKENS, max_new: int = MAX_NEW_TOKENS) -> tuple[int, int]:
    """Validated (prompt length, continuation length) for a text of n_ids tokens."""
    if prompt_tokens < 1:
        raise SpecError(f"the prompt needs at least 1 token, got {prompt_tokens}")
    if prompt_tokens > max_prompt:
        raise SpecError(f"the prompt is capped at {max_prompt} tokens (asked for {prompt_tokens})")
    if n_ids <= prompt_tokens:
        raise SpecError(f"the text has {n_ids} tokens: nothing is left after a {prompt_tokens}-token prompt; "
                        "use a longer text or fewer --prompt-tokens")
    if continuation_tokens is None:          # the rest of the text, up to the cap
        return prompt_tokens, min(n_ids - prompt_tokens, max_new)
    m = min(continuation_tokens, n_ids - prompt_tokens)
    if m < 1:
        raise SpecError(f"the continuation needs at least 1 token, got {continuation_tokens}")
    if m > max_new:
        raise SpecError(f"the continuation is capped at {max_new} tokens (asked for {m}); "
                        "use fewer continuation tokens")
    return prompt_tokens, m


def reference(model, tokenizer, text_or_ids: str | Sequence[int], prompt_tokens: int,
              continuation_tokens: int | None = None) -> Reference:
    """One full-cache forward pass over prompt + continuation (the quality baseline)."""
    import torch

    ids = tokenize(tokenizer, text_or_ids) if isinstance(text_or_ids, str) else [int(i) for i in text_or_ids]
    n, m = check_lengths(len(ids), prompt_tokens, continuation_tokens)
    ids = ids[: n + m]
    t0 = time.perf_counter()
    pre = prefill(model, ids)                      # the full-cache logits and every layer's q, k, v
    with torch.inference_mode():
        logp = torch.log_softmax(pre.logits[n - 1: n + m - 1], dim=-1)                    # (m, V)
    return Reference(ids=tuple(ids), prompt_len=n, tokens=token_strings(tokenizer, ids), logp=logp,
                     seconds=time.perf_counter() - t0, prefill=pre)


@dataclass(frozen=True, eq=False)
class Quality:
    """A compressed cache against the full cache on the same continuation (teacher-forced)."""

    spec: Spec
    prompt_len: int
    tokens: tuple[str, ...]         # the M continuation tokens
    nll: np.ndarray                 # (M,) -log p_hat of each continuation token (nats)
    nll_full: np.ndarray            # (M,) -log p of it under the full cache
    kl: np.ndarray                  # (M,) KL(full || compressed) of the next-token distributions
    top1: np.ndarray                # (M,) compressed-cache argmax
    top1_full: np.ndarray           # (M,) full-cache argmax
    kv_bytes: float                 # compressed K+V at the end, all layers / KV heads
    kv_bytes_full: float            # the same tokens in a full fp16 cache
    kept_tokens: int                # tokens per KV head at the end
    total_tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return float(math.exp(self.nll.mean()))

    @property
    def perplexity_full(self) -> float:
        return float(math.exp(self.nll_full.mean()))

    @property
    def kl_mean(self) -> float:
        return float(self.kl.mean())

    @property
    def kl_max(self) -> float:
        return float(self.kl.max())

    @property
    def top1_agreement(self) -> float:
        return float((self.top1 == self.top1_full).mean())

    @property
    def compression_ratio(self) -> float:
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes else float("inf")

    @property
    def memory_ratio(self) -> float:
        return self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else 1.0

    def as_dict(self) -> dict:
        return {
            "spec": self.spec.label(),
            "scorer": self.spec.scorer, "sink": self.spec.sink, "recent": self.spec.recent,
            "heavy": self.spec.heavy, "key_bits": self.spec.key_bits, "value_bits": self.spec.value_bits,
            "key_axis": self.spec.key_axis, "value_axis": self.spec.value_axis,
            "group_size": self.spec.group_size, "residual": self.spec.residual,
            "key_format": self.spec.key_format, "value_format": self.spec.value_format,
            "rotate": self.spec.rotate, "residual_mode": self.spec.residual_mode,
            "prompt_tokens": self.prompt_len, "continuation_tokens": len(self.tokens),
            "perplexity": self.perplexity, "perplexity_full": self.perplexity_full,
            "perplexity_ratio": self.perplexity / self.perplexity_full,
            "kl_mean": self.kl_mean, "kl_max": self.kl_max, "top1_agreement": self.top1_agreement,
            "kv_bytes": self.kv_bytes, "kv_bytes_full": self.kv_bytes_full,
            "compression_ratio": self.compression_ratio, "memory_ratio": self.memory_ratio,
            "kept_tokens": self.kept_tokens, "total_tokens": self.total_tokens,
            "seconds": self.seconds,
        }


def evaluate(model, ref: Reference, spec: Spec, mode: str = "delete", progress: Progress | None = None,
             block: bool = True) -> Quality:
    """Teacher-forced decoding of ref's continuation with the compressed cache vs the full cache.

    Starts from ref's prefill (the prompt is not run again). One-shot policies and
    quantization score the whole continuation in one masked pass (block=True, equal to
    the step loop); streaming policies and the oracle step token by token.
    """
    n, m = ref.prompt_len, ref.n_continuation
    t0 = time.perf_counter()
    logits, _, cache = decode(model, ref.ids[:n], spec, steps=m - 1, feed=ref.ids[n: n + m - 1],
                              mode=mode, tokens=ref.tokens, prefix=ref.prefill, block=block,
                              progress=None if progress is None else
                              (lambda f, msg: progress(f, f"{spec.label()}: {msg}")))
    return quality_from(ref, spec, logits, cache, t0)


def quality_from(ref: Reference, spec: Spec, logits, cache: CompressedCache, t0: float) -> Quality:
    """Quality of a teacher-forced run's logits (m, vocab) against the reference (see evaluate)."""
    import torch

    n = ref.prompt_len
    logp_hat = torch.log_softmax(logits, dim=-1)                                 # (m, V)
    logp = ref.logp
    target = torch.as_tensor(ref.targets)[:, None]
    kl = (logp.exp() * (logp - logp_hat)).sum(dim=-1).clamp_min(0.0)            # (m,)
    mem = memory_for(cache.trace, spec, cache.n_tokens)
    return Quality(
        spec=spec, prompt_len=n, tokens=ref.tokens[n:],
        nll=(-logp_hat.gather(1, target)[:, 0]).numpy().astype(np.float64),
        nll_full=(-logp.gather(1, target)[:, 0]).numpy().astype(np.float64),
        kl=kl.numpy().astype(np.float64),
        top1=logp_hat.argmax(dim=-1).numpy(), top1_full=logp.argmax(dim=-1).numpy(),
        kv_bytes=mem.kv_bytes, kv_bytes_full=mem.kv_bytes_full,
        kept_tokens=cache.kept_tokens(), total_tokens=cache.n_tokens,
        seconds=time.perf_counter() - t0)


# --- greedy continuation side by side ----------------------------------------------------------

@dataclass(frozen=True)
class SideBySide:
    """Greedy continuations of one prompt with the full and the compressed cache."""

    spec: Spec
    prompt: str
    full_ids: tuple[int, ...]
    compressed_ids: tuple[int, ...]
    full_tokens: tuple[str, ...]
    compressed_tokens: tuple[str, ...]
    first_divergence: int | None     # index of the first differing token, None if identical

    @property
    def full_text(self) -> str:
        return "".join(self.full_tokens)

    @property
    def compressed_text(self) -> str:
        return "".join(self.compressed_tokens)

    @property
    def same_prefix(self) -> int:
        return len(self.full_ids) if self.first_divergence is None else self.first_divergence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy(model, prompt_ids: Sequence[int], spec: Spec, max_new_tokens: int,
           progress: Progress | None = None, prefix: Prefill | None = None,
           on_token: Callable[[int, int], None] | None = None) -> list[int]:
    """Greedy continuation (max_new_tokens ids) with the compressed cache.

    prefix: a Prefill covering the prompt (not run again). on_token(i, id) is called as
    each token is chosen, so a caller can stream the text (and stop the run by raising).
    """
    import torch

    n = len(prompt_ids)
    if prefix is not None and not prefix.covers(prompt_ids):
        prefix = None
    if prefix is None:
        prefix = prefill(model, prompt_ids)
    first = int(torch.argmax(prefix.logits[n - 1]))
    if on_token is not None:
        on_token(0, first)

    def step(i: int, last) -> None:
        on_token(i + 1, int(torch.argmax(last)))

    logits, fed, _ = decode(model, prompt_ids, spec, steps=max_new_tokens - 1, progress=progress, prefix=prefix,
                            on_step=step if on_token is not None else None)
    return fed + [int(torch.argmax(logits[-1]))]


def side_by_side(model, tokenizer, prompt: str | Sequence[int], spec: Spec, max_new_tokens: int = 48,
                 progress: Progress | None = None, prefix: Prefill | None = None,
                 full_ids: Sequence[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> SideBySide:
    """Greedy text of the full cache next to the compressed cache's, first divergence marked.

    Both runs start from one prefill of the prompt (`prefix`, or one made here).
    full_ids: the full cache's greedy ids computed before (they do not depend on the spec).
    on_token streams the compressed run's tokens (see greedy).
    """
    ids = tokenize(tokenizer, prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    check_lengths(len(ids) + max_new_tokens, len(ids), max_new_tokens)
    say = progress or (lambda f, m: None)
    if prefix is None or not prefix.covers(ids):
        prefix = prefill(model, ids)
    if full_ids is not None and len(full_ids) >= max_new_tokens:
        full = [int(i) for i in full_ids[:max_new_tokens]]
    else:
        full = greedy(model, ids, Spec(), max_new_tokens, prefix=prefix,
                      progress=lambda f, m: say(0.5 * f, "full cache: " + m))
    comp = greedy(model, ids, spec, max_new_tokens, prefix=prefix, on_token=on_token,
                  progress=lambda f, m: say(0.5 + 0.5 * f, "compressed: " + m))
    return SideBySide(spec=spec, prompt=prompt if isinstance(prompt, str) else tokenizer.decode(ids),
                      full_ids=tuple(full), compressed_ids=tuple(comp),
                      full_tokens=token_strings(tokenizer, full), compressed_tokens=token_strings(tokenizer, comp),
                      first_divergence=first_divergence(full, comp))


# --- sweeps ------------------------------------------------------------------------------

SWEEP_FIELDS = ("method", "budget", "spec", "residual", "perplexity", "perplexity_full", "perplexity_ratio", "kl_mean", "kl_max",
                "top1_agreement", "kv_bytes", "kv_bytes_full", "compression_ratio", "memory_ratio",
                "kept_tokens", "total_tokens")

SWEEP_METHODS: dict[str, Callable[[int], Spec]] = {
    "streaming": lambda b: Spec(sink=4, recent=max(b - 4, 1), scorer="streaming"),
    "recent-only": lambda b: Spec(sink=0, recent=b, scorer="streaming"),
    "h2o": lambda b: Spec(sink=4, recent=max(b // 2 - 4, 1), heavy=b - max(b // 2 - 4, 1) - 4, scorer="h2o"),
    "tova": lambda b: Spec(sink=4, recent=max(b // 2 - 4, 1), heavy=b - max(b // 2 - 4, 1) - 4, scorer="tova"),
    "snapkv": lambda b: Spec(sink=4, recent=max(b // 2 - 4, 1), heavy=b - max(b // 2 - 4, 1) - 4, scorer="snapkv"),
    "knorm": lambda b: Spec(sink=4, recent=max(b // 2 - 4, 1), heavy=b - max(b // 2 - 4, 1) - 4, scorer="knorm"),
    "oracle": lambda b: Spec(sink=4, recent=max(b // 2 - 4, 1), heavy=b - max(b // 2 - 4, 1) - 4, scorer="oracle"),
}
# issue #12: the newer scorers with the same split, and allocations over heads / layers
SWEEP_METHODS.update({name: (lambda s_: lambda b: SWEEP_METHODS["h2o"](b).with_(scorer=s_))(name)
                      for name in ("expected_attention", "keydiff", "chunkkv", "quest")})
SWEEP_METHODS.update({f"{al}-{name}": (lambda a_, s_: lambda b: SWEEP_METHODS["h2o"](b).with_(scorer=s_, allocation=a_))(al, name)
                      for al in ("adakv", "pyramid") for name in ("snapkv", "expected_attention", "knorm", "oracle")})
# Whole-cache quantizers as a function of the prompt length n. KIVI as published: keys per
# channel, values per token, groups of 32, float offset, the last 128 tokens at full
# precision (kivi_residual: less on a prompt too short to quantize a group otherwise).
QUANT_METHODS: dict[str, Callable[[int], Spec]] = {
    "kivi-2bit": lambda n: Spec(key_bits=2, value_bits=2, key_axis="channel", value_axis="token", group_size=32,
                                residual=kivi_residual(n)),
    "kv-4bit": lambda n: Spec(key_bits=4, value_bits=4, key_axis="channel", value_axis="token", group_size=32),
    "kv-8bit": lambda n: Spec(key_bits=8, value_bits=8, key_axis="channel", value_axis="token", group_size=32),
    "2bit-per-token-keys": lambda n: Spec(key_bits=2, value_bits=2, key_axis="token", value_axis="token",
                                          group_size=32),
}
# Serving formats (kvviz.quant.formats): FP8 with FP32 scales, block-scaled FP4, Hadamard rotation
# before quantizing, and transformers' QuantizedCache (per-token groups, residual flushed every 128).
QUANT_METHODS.update({
    "fp16": lambda n: Spec(),   # the full cache: the baseline row
    "fp8-e4m3-tensor": lambda n: Spec(key_format="e4m3", value_format="e4m3", fp8_scale="tensor"),
    "fp8-e4m3-head": lambda n: Spec(key_format="e4m3", value_format="e4m3", fp8_scale="head"),
    "fp8-e4m3-token": lambda n: Spec(key_format="e4m3", value_format="e4m3", fp8_scale="token"),
    "fp8-e5m2-head": lambda n: Spec(key_format="e5m2", value_format="e5m2", fp8_scale="head"),
    "nvfp4": lambda n: Spec(key_format="nvfp4", value_format="nvfp4"),
    "mxfp4": lambda n: Spec(key_format="mxfp4", value_format="mxfp4"),
    "nvfp4-rotated": lambda n: Spec(key_format="nvfp4", value_format="nvfp4", rotate="keys"),
    "kivi-2bit-rotated": lambda n: QUANT_METHODS["kivi-2bit"](n).with_(rotate="keys"),
    "2bit-per-token-keys-rotated": lambda n: QUANT_METHODS["2bit-per-token-keys"](n).with_(rotate="keys"),
    "hf-qc-4bit": lambda n: hf_quantized_cache(4),
    "hf-qc-2bit": lambda n: hf_quantized_cache(2),
})


def sweep(model, ref: Reference, methods: Sequence[str], budgets: Sequence[int],
          progress: Progress | None = None) -> list[dict]:
    """Quality against memory ratio: every eviction method at every budget, plus quantizers."""
    jobs: list[tuple[str, int | str, Spec]] = []
    for name in methods:
        if name in SWEEP_METHODS:
            jobs += [(name, b, SWEEP_METHODS[name](b)) for b in budgets]
        elif name in QUANT_METHODS:
            jobs.append((name, "", QUANT_METHODS[name](ref.prompt_len)))
        else:
            raise SpecError(f"unknown sweep method {name!r}; choose from "
                            f"{', '.join([*SWEEP_METHODS, *QUANT_METHODS])}")
    rows = []
    for j, (name, budget, spec) in enumerate(jobs):
        if progress is not None:
            progress(j / len(jobs), f"{name} {budget}")
        q = evaluate(model, ref, spec)
        d = q.as_dict()
        rows.append({"method": name, "budget": budget, **{k: d[k] for k in SWEEP_FIELDS[2:]}})
    return rows
