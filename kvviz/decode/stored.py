"""How a compressed cache stores what it keeps and hands it to attention: K / V gathered at the kept
positions, quantized per the spec (integer groups, or a serving format) on the cache's device, and keys
re-rotated to their cache slots where the spec asks. A base class of kvviz.decode.cache.CompressedCache
(its state: the spec, the device, the per-layer K / V and the quantized-block reuse).
"""

from __future__ import annotations

import numpy as np

from kvviz.decode.devquant import device_quantizes, float64_ok, quantize_tensor_torch
from kvviz.decode.place import host, on
from kvviz.quant import quantize
from kvviz.quant.formats import quantize_tensor, uses_formats
from kvviz.quant.formats import residual_at as formats_residual_at
from kvviz.spec import FULL_BITS


class StoredKV:
    """The kept K / V of a CompressedCache as attention reads them."""

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
            # per cache position: its quantized value, and whether it is there yet
            if memo is None:
                memo = (
                    np.zeros((self.H, self.capacity, self.D), dtype=x.dtype),
                    np.zeros((self.H, self.capacity), dtype=bool),
                )
                self._quant_memo[(layer, which)] = memo
            values, done = memo
            todo = ~np.take_along_axis(done, sel, axis=1)  # (H, n_quant)
            if todo.any():
                heads, cols = np.nonzero(todo)
                fresh = self._quantize_block(which, x[:, :n_quant][heads, cols][None])[0]  # (P, D)
                values[heads, sel[heads, cols]] = fresh
                done[heads, sel[heads, cols]] = True
            out[:, :n_quant] = values[self._rows_np, sel]
            return out
        # channel axis: a group of G consecutive kept tokens; keep the quantized compacted cache
        if memo is None:
            memo = [
                np.full((self.H, self.capacity), -1, dtype=np.int64),
                np.zeros((self.H, self.capacity, self.D), dtype=x.dtype),
                0,
            ]
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
    def _kv_head(self, layer: int, h: int, idx: np.ndarray):
        """One head's K, V (m, D) at idx, quantized per the spec as a compacted cache (integer formats)."""

        at = on(idx, self.device)
        K, V = self.k[layer, h, at].float(), self.v[layer, h, at].float()
        s = self.spec
        settings = dict(zero_point=s.zero_point, partial=s.partial)
        n_quant = max(0, len(idx) - s.residual)
        # on the model's device (kvviz.decode.devquant)
        if not self.fast and s.quant_model == "kv":
            return self._on_device(K, "k"), self._on_device(V, "v")
        for which, bits, axis in (("k", s.key_bits, s.key_axis), ("v", s.value_bits, s.value_axis)):
            if s.quant_model != "kv" or bits >= FULL_BITS or n_quant == 0:
                continue
            x = host(K if which == "k" else V).copy()
            x[:n_quant] = quantize(x[None, :n_quant], bits, axis, s.group_size, 0, s.symmetric, **settings)[0]
            if which == "k":
                K = on(x, self.device)
            else:
                V = on(x, self.device)
        return K, V

    def _kept_kv(self, layer: int, idx: np.ndarray):
        """Kept K and V gathered at idx (H, m), quantized per the spec: (H, m, D) each."""
        import torch

        m = idx.shape[1]
        if m and (idx[:, -1] == m - 1).all():  # sorted positions ending at m - 1: the whole prefix
            # float32: views, no gather
            K, V = self.k[layer, :, :m].float(), self.v[layer, :, :m].float()
        # numpy's gather on the shared storage: the same values, without torch's indexing overhead
        elif self.fast:
            K = torch.from_numpy(self.k[layer].numpy()[self._rows_np, idx])  # (H, m, D)
            V = torch.from_numpy(self.v[layer].numpy()[self._rows_np, idx])
        else:  # on the model's device, then float32
            at = on(idx, self.device)
            K, V = self.k[layer][self._rows, at].float(), self.v[layer][self._rows, at].float()
        s = self.spec
        if (
            s.quant_model == "kv"
            and uses_formats(s)
            and not self.fast
            and float64_ok(self.device)
            and device_quantizes(s)
        ):
            residual = formats_residual_at(s, idx, self.length[layer] - 1, self.trace.context_len)
            return quantize_tensor_torch(K, s, "k", residual), quantize_tensor_torch(V, s, "v", residual)
        if s.quant_model == "kv" and uses_formats(s):
            return self._kept_kv_formats(layer, host(K), host(V), idx)
        # on the model's device (kvviz.decode.devquant)
        if not self.fast and s.quant_model == "kv":
            return self._on_device(K, "k"), self._on_device(V, "v")
        if s.quant_model == "kv" and s.key_bits < FULL_BITS:
            K = on(self._quantized(layer, "k", host(K), idx), self.device)
        if s.quant_model == "kv" and s.value_bits < FULL_BITS:
            V = on(self._quantized(layer, "v", host(V), idx), self.device)
        return K, V

    def _on_device(self, x, which: str):
        """x (..., m, D) float32 quantized per the spec's integer K or V settings where it lives: the
        torch twin of kvviz.quant.quantize (bit for bit on a CPU; kvviz.decode.devquant)."""
        from kvviz.decode.devquant import quantize_torch

        s = self.spec
        bits, axis = (s.key_bits, s.key_axis) if which == "k" else (s.value_bits, s.value_axis)
        return quantize_torch(x, bits, axis, s.group_size, s.residual, s.symmetric, s.zero_point, s.partial)

    def _kept_kv_formats(self, layer: int, K: np.ndarray, V: np.ndarray, idx: np.ndarray):
        """FP8 / FP4 formats, rotation, HF's residual flush (kvviz.quant.formats): the whole
        kept set of every KV head is quantized afresh at each step (no reuse across steps)."""

        s = self.spec
        residual = formats_residual_at(s, idx, self.length[layer] - 1, self.trace.context_len)
        if s.quantizes_keys:
            K = quantize_tensor(K, s, "k", residual)
        if s.quantizes_values:
            V = quantize_tensor(V, s, "v", residual)
        return on(K, self.device), on(V, self.device)

    def _rerotated(self, K, kept: np.ndarray, p: int):
        """Kept keys as if each sat at its cache slot, the query at its own slot (StreamingLLM).

        The cache holds post-RoPE keys at their true positions i; the query is rotated for
        its true position p. RoPE makes q_p . k_i depend on p - i only, so rotating each key
        by delta = (slot_k - slot_q) - (i - p) gives the logits of slot positions.
        """
        import torch

        m = kept.shape[1]
        # the query's own slot (its token is kept)
        slot_q = m - 1 if int(kept[0, -1]) == p else m
        delta = (np.arange(m)[None, :] - slot_q) - (kept - p)  # (H, m)
        angle = on(delta.astype(np.float32), self.device)[..., None] * self.inv_freq  # (H, m, D/2)
        cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
        half = K.shape[-1] // 2
        # transformers' rotate_half
        rotated_half = torch.cat([-K[..., half:], K[..., :half]], dim=-1)
        return K * cos + rotated_half * sin


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two (H, n) index arrays (all heads agreeing)."""
    n = min(a.shape[1], b.shape[1])
    diff = np.flatnonzero((a[:, :n] != b[:, :n]).any(axis=0))
    return int(diff[0]) if len(diff) else n
