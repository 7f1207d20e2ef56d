"""The prompt's Trace where the cache lives: the policies score a device cache without copying its q, k, v.

At a compression point (the end of the prompt, each `compress_every` recompression) a policy scores the
prompt from a Trace. A float32 CPU cache hands it numpy views of its own tensors (no copy). A cache on a
GPU, or in a half dtype, hands it a Trace whose q, k, v are `DeviceStack`s: the tensors stay where they
are, in their dtype, and only what a scorer reads crosses to the host, as float32 numpy (float64 for the
sums), once per decision:

    context_rows(...)     chunks of attention rows (Hq, rows, keys) computed on the device:
                          SnapKV's observation window, TOVA's last query, any plug-in's
                          ScoreContext.context_attention
    attention_sums(...)   (Hq, keys) what the rows paid each key, summed on the device (float64 where
                          the device has it): H2O's accumulated attention, SnapKV's votes
    row_norms(layer, ..)  (H, keys) the L2 norm of each key (value): K-norm's scores
    normalised_mean(..)   the keys' norms, the mean of the normalised keys and each key's dot with
                          it, (H, keys), (H, D), (H, keys): KeyDiff's cosines
    moments(..), expected_attention(..)   Expected Attention's query statistics (Hq, d), (Hq, d, d)
                          and its expected attention (H, keys), ||v|| by row_norms
    stack[layer], ...     any other read (a plug-in reading trace.k):
                          the indexed part alone, as float32 numpy

kvviz.attention (and Expected Attention for its two steps) call these methods where an array has them
(a duck-typed hook: the core and the policies never import torch). A cache that will not score again
(no compress_every, no record) releases the prompt's queries after its compression point. Each call adds the
bytes it sends to the host to `Crossing.bytes` (the cache's
`crossed`), which the tests count: SnapKV at N tokens receives (Hq, N) sums per layer, not the (L, Hq +
2 H, N, D) q, k, v the host path copied. The attention is float32 (torch's softmax; the host's numpy
BLAS sums in another order): scores agree to float32's precision, so kept sets agree except where two
scores tie within it (tests/test_devtrace.py).
torch is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvviz.decode.place import host
from kvviz.limits import checkpoint


@dataclass
class Crossing:
    """Bytes sent from the device to the host (mutable: one per cache)."""

    bytes: int = 0
    calls: int = 0

    def send(self, x, float64: bool = False) -> np.ndarray:
        """x as numpy on the host: float32 (float64 where asked: sums), counted."""
        a = x.detach().to("cpu").double().numpy() if float64 else host(x)
        self.bytes += a.nbytes
        self.calls += 1
        return a


class DeviceStack:
    """(layers, heads, positions, head_dim) torch tensors (one per layer, or one 4-D tensor) as a lazy
    Trace array (kvviz.trace.is_lazy): indexing it copies the indexed part to the host, float32."""

    lazy = True

    def __init__(self, layers: Sequence | object, crossing: Crossing) -> None:
        self.layers = list(layers) if isinstance(layers, (list, tuple)) else list(layers.unbind(0))
        self.crossing = crossing
        self.shape = (len(self.layers), *(int(x) for x in self.layers[0].shape))
        self.dtype = np.dtype(np.float32)
        self.device = self.layers[0].device

    ndim = 4

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * 4

    held_bytes = 0  # host memory it holds (kvviz.trace.held_bytes)

    def release(self) -> None:
        """Let the tensors go (a cache whose later steps never read them): a later read is an error."""
        self.layers = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        import torch

        if self.layers is None:
            raise RuntimeError("this trace's device tensors were released after the compression point")
        if isinstance(key, tuple) and key and isinstance(key[0], (int, np.integer)):
            return self.crossing.send(self.layers[int(key[0])][_torch_key(key[1:])])
        if isinstance(key, (int, np.integer)):
            return self.crossing.send(self.layers[int(key)])
        return self.crossing.send(torch.stack(self.layers)[_torch_key(key)])

    # -- what the scorers read, computed here (kvviz.attention dispatches to these) -----------------
    def _attention_chunks(
        self, trace, layer: int, heads: np.ndarray, rows: np.ndarray, n_keys: int, chunk: int, trim: bool
    ):
        """kvviz.attention.context_rows on the device: (row indices, attention (heads, c, m) float32)."""
        import torch

        from kvviz.attention import chunk_rows

        heads = np.asarray(heads, dtype=np.int64)
        chunk = chunk_rows(len(heads), n_keys, chunk)
        dev = self.device
        q_all = trace.q.layers[layer][torch.tensor(heads, device=dev)]  # (H, Nq, D), its dtype
        kv = torch.tensor(trace.kv_head(heads), device=dev)
        k = self.layers[layer][kv, :n_keys].float()  # (H, n_keys, D)
        scale = torch.tensor(1.0 / np.sqrt(trace.head_dim), dtype=torch.float32, device=dev)
        key_pos = torch.arange(n_keys, device=dev)
        for start in range(0, len(rows), chunk):
            checkpoint()
            idx = np.asarray(rows[start : start + chunk])
            positions = trace.query_positions[idx]
            m = min(n_keys, int(positions.max()) + 1) if trim and len(idx) else n_keys
            q = q_all[:, torch.tensor(idx, device=dev)].float()  # (H, c, D)
            logits = (q @ k[:, :m].transpose(1, 2)) * scale  # (H, c, m)
            future = key_pos[None, :m] > torch.tensor(positions, device=dev)[:, None]  # (c, m)
            yield idx, torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)

    def context_rows(
        self, trace, layer: int, heads: np.ndarray, rows: np.ndarray, n_keys: int, chunk: int = 512, trim: bool = False
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for idx, a in self._attention_chunks(trace, layer, heads, rows, n_keys, chunk, trim):
            yield idx, self.crossing.send(a)

    def attention_sums(
        self, trace, layer: int, heads: np.ndarray, rows: np.ndarray, n_keys: int, trim: bool = False
    ) -> np.ndarray:
        import torch

        from kvviz.decode.devquant import float64_ok

        acc = torch.float64 if float64_ok(self.device) else torch.float32
        out = torch.zeros(len(heads), n_keys, dtype=acc, device=self.device)
        for _, a in self._attention_chunks(trace, layer, heads, rows, n_keys, 512, trim):
            out[:, : a.shape[-1]] += a.sum(dim=1, dtype=acc)
        return self.crossing.send(out, float64=True)

    def row_norms(self, layer: int, stop: int | None = None, float64: bool = False) -> np.ndarray:
        """(heads, positions): the L2 norm of each row of `layer` (up to `stop`), float32 or float64."""
        x = self.layers[layer][:, :stop]
        x = x.to(_wide(self.device)) if float64 else x.float()
        return self.crossing.send((x * x).sum(dim=-1).sqrt(), float64=float64)

    def moments(self, layer: int, rows: np.ndarray, positions: np.ndarray, inv_freq):
        """Expected Attention's query statistics (kvviz.policies.expected_attention.query_statistics) of
        this stack's queries `rows`: back to pre-RoPE (inv_freq, or None), then the mean (Hq, d) and the
        covariance / N (Hq, d, d), in float64 where the device has it (else float32, centred first)."""
        import torch

        wide = _wide(self.device)
        q = self.layers[layer][:, torch.tensor(np.asarray(rows), device=self.device)].to(wide)
        if inv_freq is not None:  # x cos + rotate_half(x) sin at -position
            pos = _on(-np.asarray(positions, dtype=np.float64), wide, self.device)
            angle = pos[:, None] * _on(inv_freq, wide, self.device)
            cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
            half = q.shape[-1] // 2
            q = q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin
        n = q.shape[1]
        mu = q.mean(dim=1)  # (Hq, d)
        centred = q - mu[:, None]
        cov = centred.transpose(1, 2) @ centred / n  # (Hq, d, d)
        return self.crossing.send(mu, float64=True), self.crossing.send(cov, float64=True)

    def expected_attention(self, layer: int, first: int, stop: int, mu: np.ndarray, cov):
        """kvviz.policies.expected_attention.expected_attention of this stack's keys first..stop-1, on
        the device: the linear term in float64 (where the device has it), the quadratic one in float32
        on the keys centred on their mean, as the host computes them. Returns (Hkv, stop - first)."""
        import torch

        wide = _wide(self.device)
        keys = self.layers[layer][:, first:stop].to(wide)  # (Hkv, n, d)
        d = keys.shape[-1]
        mu_t = _on(mu, wide, self.device)  # (Hkv, g, d)
        kbar = keys.mean(dim=1, keepdim=True)
        delta = keys - kbar
        w = mu_t / float(np.sqrt(d))
        if cov is not None:
            cov_t = _on(cov, wide, self.device)  # (Hkv, g, d, d)
            w = w + (cov_t @ kbar[:, None, 0, :, None])[..., 0] / d
        z = delta @ w.transpose(1, 2)  # (Hkv, n, g)
        if cov is not None:
            Hkv, g = mu_t.shape[:2]
            delta32 = delta.float()
            stacked = cov_t.transpose(1, 2).reshape(Hkv, d, g * d).float()  # [S_1 .. S_g]
            for start in range(0, delta32.shape[1], 1024):
                part = delta32[:, start : start + 1024]
                y = (part @ stacked).reshape(Hkv, -1, g, d)
                quad = (y @ part[..., None])[..., 0]  # (Hkv, m, g)
                z[:, start : start + 1024] += (quad * (0.5 / d)).to(wide)
        return self.crossing.send(torch.softmax(z, dim=1).mean(dim=2), float64=True)

    def normalised_mean(self, layer: int, stop: int):
        """kvviz.attention.normalised_mean in torch, float32: norms (H, stop), anchor (H, D), dots (H, stop)."""
        x = self.layers[layer][:, :stop].float()  # (H, c, D)
        norms = (x * x).sum(dim=-1).sqrt().clamp_min(1e-12)
        anchor = ((1.0 / norms)[:, None, :] @ x)[:, 0] / stop  # (H, D)
        dots = (x @ anchor[..., None])[..., 0]
        return self.crossing.send(norms), self.crossing.send(anchor), self.crossing.send(dots)


def _on(a, dtype, device):
    """A float64 numpy array as a tensor of `dtype` on `device` (converted on the host: MPS has no float64)."""
    import torch

    return torch.as_tensor(np.asarray(a, dtype=np.float64)).to(dtype).to(device)


def _wide(device):
    """float64 where the device has it (not MPS), else float32."""
    import torch

    from kvviz.decode.devquant import float64_ok

    return torch.float64 if float64_ok(device) else torch.float32


def _torch_key(key):
    """numpy index arrays as tensors (torch takes slices and ints as they are)."""
    import torch

    if isinstance(key, tuple):
        return tuple(_torch_key(k) for k in key)
    if isinstance(key, np.ndarray):
        return torch.from_numpy(key)
    return key


def device_trace(q_layers: Sequence, k_layers: Sequence, v_layers: Sequence | None, crossing: Crossing, **fields):
    """A Trace over device tensors: q (Hq, n, D) and k, v (H, n, D) per layer; fields: the Trace's other
    fields (context_len, tokens, query_positions, meta)."""
    from kvviz.trace import Trace

    return Trace(
        q=DeviceStack(q_layers, crossing),
        k=DeviceStack(k_layers, crossing),
        v=None if v_layers is None else DeviceStack(v_layers, crossing),
        **fields,
    )
