"""How the queries of a compressed cache attend to what it keeps: the prompt's full causal attention at the
prefill, a decode query over its KV head's kept tokens (the delete or the mask mode, MODES), Quest's reads
per query head, and teacher-forced steps in one masked pass where the spec allows it (block_ok); and what a
real-model run refuses. A base class of kvviz.decode.cache.CompressedCache, whose state it reads (the kept
sets, and its `_arrive` for each step of a block). torch is imported lazily (inside methods).
"""

from __future__ import annotations

import numpy as np

from kvviz.decode.place import host, on
from kvviz.decode.stored import StoredKV
from kvviz.quant.formats import uses_formats
from kvviz.spec import FULL_BITS, Spec, SpecError

MODES = ("delete", "mask")


def check_run(spec: Spec, mode: str, inv_freq) -> None:
    """What a real-model run refuses: an unknown mode, re-rotation without RoPE or with masked entries, and
    the logit-noise model (a stand-in for attention rows only)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if spec.positions == "cache":
        if inv_freq is None:
            raise SpecError(
                "re-rotating keys to their cache slots needs the model's rotary embedding "
                "(RoPE); this model has none kvviz can find"
            )
        if mode != "delete":
            raise SpecError("keys re-rotated to cache slots are only simulated with deleted entries")
    if spec.quant_model == "noise" and spec.noise_sigma > 0:
        raise SpecError(
            "the logit-noise model is a stand-in for attention rows only; "
            "on a real model use real K/V quantization (quant_model 'kv')"
        )


class KeptAttention(StoredKV):
    """Attention of a CompressedCache's queries over what it keeps (its K / V as StoredKV hands them over)."""

    def _attend_reads(self, layer: int, q, reads: np.ndarray, scaling: float):
        """Each query head attends over its own reads (Hq, p + 1) (Quest per query head): its read tokens of
        the whole stored cache, quantized whole as the engine quantizes it (integer formats)."""
        import torch

        out = torch.empty(self.Hq, self.D, device=self.device)
        # KV head -> its whole cache (K, V), quantized
        stored = {}
        for j in range(self.Hq):
            h = j // self.group
            if h not in stored:
                stored[h] = self._kv_head(layer, h, np.arange(reads.shape[1]))
            K, V = stored[h]
            idx = on(np.flatnonzero(reads[j]), self.device)
            out[j] = torch.softmax(q[j, 0] @ K[idx].T * scaling, dim=-1) @ V[idx]
        return out.reshape(self.Hq, 1, self.D)

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
        return (
            self.mode == "delete"
            and not self.record
            and not (self.evicts and self.spec.compress_every)
            and not (self.evicts and (self.policy.streaming or self.policy.needs_query))
            and not (self.spec.quant_model == "kv" and self.spec.quantizes and uses_formats(self.spec))
        )

    def _attend_block(self, layer: int, q, start: int, scaling: float):
        """t teacher-forced tokens at positions start.. in one pass, each query reading exactly
        the cache the step loop would give it: the kept set after its own arrival (and
        eviction), quantized as the loop quantizes it. Equal to t single steps."""
        import torch

        t = q.shape[1]
        kept_steps = []
        # the loop's own bookkeeping, token by token
        for i in range(t):
            self.kept[layer] = self._arrive(layer, start + i)
            kept_steps.append(self.kept[layer])
        qg = q.reshape(self.H, self.group, t, self.D)  # (H, g, t, D)
        s = self.spec
        quantized = s.quant_model == "kv" and (s.key_bits < FULL_BITS or s.value_bits < FULL_BITS)
        if not quantized and s.positions == "true":
            # one mask over the full cache: -inf where a step's cache does not hold a token
            n = start + t
            hole = np.full((t, self.H, n), -np.inf, dtype=np.float32)
            for i, kept in enumerate(kept_steps):
                np.put_along_axis(hole[i], kept, 0.0, axis=1)
            bias = on(hole, self.device).permute(1, 0, 2)[:, None]  # (H, 1, t, n)
            K, V = self.k[layer, :, :n].float(), self.v[layer, :, :n].float()  # (H, n, D)
            # (H, g, t, n)
            a = torch.softmax(qg @ K[:, None].transpose(-1, -2) * scaling + bias, dim=-1)
            out = a @ V[:, None]  # (H, g, t, D)
        else:
            # every step's own cache, gathered (quantized, re-rotated) and padded to the longest
            M = max(k.shape[1] for k in kept_steps)
            Ks = torch.zeros(t, self.H, M, self.D, device=self.device)
            Vs = torch.zeros(t, self.H, M, self.D, device=self.device)
            hole = np.full((t, self.H, M), -np.inf, dtype=np.float32)
            for i, kept in enumerate(kept_steps):
                m = kept.shape[1]
                K, V = self._kept_kv(layer, kept)
                if s.positions == "cache":
                    K = self._rerotated(K, kept, start + i)
                Ks[i, :, :m], Vs[i, :, :m] = K, V
                hole[i, :, :m] = 0.0
            bias = on(hole, self.device)[:, :, None]  # (t, H, 1, M)
            qt = qg.permute(2, 0, 1, 3)  # (t, H, g, D)
            a = torch.softmax(qt @ Ks.transpose(-1, -2) * scaling + bias, dim=-1)  # (t, H, g, M)
            out = (a @ Vs).permute(1, 2, 0, 3)  # (H, g, t, D)
        return out.reshape(self.Hq, t, self.D)

    def _prefill(self, layer: int, q, scaling: float):
        """Full causal attention over the prompt; q is kept for the policies' Trace."""
        import torch

        n = q.shape[1]
        # the policies' Trace: numpy on the fast path; else on the device in the model's dtype (q came so)
        self.prefill_q[layer] = host(q).copy() if self.fast else q.to(self.dtype)
        K = self.k[layer, :, :n].float().repeat_interleave(self.group, dim=0)  # (Hq, n, D)
        V = self.v[layer, :, :n].float().repeat_interleave(self.group, dim=0)
        # a GPU (or a half-precision model): no (Hq, n, n) matrix; 32k tokens fit
        if not self.fast:
            return torch.nn.functional.scaled_dot_product_attention(
                q[None], K[None], V[None], is_causal=True, scale=scaling
            )[0]
        logits = q @ K.transpose(1, 2) * scaling  # (Hq, n, n)
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        return torch.softmax(logits, dim=-1) @ V  # (Hq, n, D)

    def _attend_deleted(self, layer: int, qg, kept: np.ndarray, scaling: float):
        import torch

        K, V = self._kept_kv(layer, kept)  # (H, m, D)
        if self.spec.positions == "cache":
            K = self._rerotated(K, kept, self.length[layer] - 1)
        a = torch.softmax(qg @ K.transpose(1, 2) * scaling, dim=-1)  # (H, g, m)
        return a, a @ V  # out (H, g, D)

    def _attend_masked(self, layer: int, qg, kept: np.ndarray, scaling: float):
        """Every entry stays; evicted ones get -inf logits. Returns a over the kept (H, g, m)."""
        import torch

        n = self.length[layer]
        K = self.k[layer, :, :n].float().clone()
        V = self.v[layer, :, :n].float().clone()
        s = self.spec
        it = on(kept, self.device)
        if s.quant_model == "kv" and s.quantizes:
            Kq, Vq = self._kept_kv(layer, kept)
            K[self._rows, it] = Kq
            V[self._rows, it] = Vq
        mask = np.zeros((self.H, n), dtype=bool)
        np.put_along_axis(mask, kept, True, axis=1)
        # (H, 1, n)
        hole = on(np.where(mask, 0.0, -np.inf).astype(np.float32), self.device)[:, None, :]
        a = torch.softmax(qg @ K.transpose(1, 2) * scaling + hole, dim=-1)  # (H, g, n)
        a_kept = torch.gather(a, 2, it[:, None, :].expand(-1, self.group, -1))  # (H, g, m)
        return a_kept, a @ V
