"""What every cache format shares: bytes of the quantized payload, its scales and the full-precision rest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheBytes:
    """Bytes of one tensor's cache (K or V) for n tokens of `dim` channels."""

    payload: float
    overhead: float  # scales and zero points / offsets
    residual: float  # the full-precision residual window
    partial: float = 0.0  # partial trailing groups kept at 16 bits

    @property
    def total(self) -> float:
        return self.payload + self.overhead + self.residual + self.partial


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: float = 2.0) -> float:
    """Full-cache bytes per token: K and V, every layer and KV head (fp16: 2 bytes)."""
    return 2 * bytes_per_value * layers * kv_heads * head_dim
