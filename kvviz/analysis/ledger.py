"""The budget ledger: declared vs actual kept tokens and bytes, per layer and KV head.

Where a "compression ratio" is reconciled with what is stored. For one setting and one
evaluated query it lists, for every (layer, KV head) cache:
    declared   sink + recent + the heavy budget the allocation declares for it (uniform:
               heavy; pyramid: the layer's budget; AdaKV: heavy, of which the layer total
               kv_heads * heavy is what is promised — heads trade slots), capped at the tokens seen
    kept       what the cache actually holds: sinks, recent window, heavy hitters
    bytes      K + V: quantized payload, scale / zero-point overhead, residual tokens kept at
               16 bits, trailing partial groups kept at 16 bits; Quest adds its per-page
               min / max keys and stores every token (it saves bytes *read*, not stored)
    prefill    the cache at its peak: the whole context at 16 bits, as the prefill holds it before
               the compression point (kvviz.memory.prefill_peak_bytes); the peak is the larger of its
               total and what is stored (the memory card's)
Ratios people quote differ for reasons the totals show: a token ratio (kept / seen) counts
sinks and the window inside the budget, a byte ratio adds the quantizer's overhead and
the full-precision residual, and kvpress's compression_ratio is of the context only.
A sliding-window layer (Trace.layer_windows) is not compressed: its caches hold the model's own window,
min(W, tokens) at 16 bits, which is also what "full" and the prefill count for it (kvviz.memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvviz.engine import ALL, EVICTED, HEAVY, RECENT, SINK, check_view, kept_at_query, reasons_for
from kvviz.memory import head_parts, page_meta_bytes, prefill_peak_bytes, seen_tokens
from kvviz.policies import get_policy
from kvviz.policies.allocation import layer_spec
from kvviz.quant import kv_bytes_per_token
from kvviz.spec import Spec, View
from kvviz.trace import Trace

COLUMNS = (
    "layer",
    "kv_head",
    "declared_tokens",
    "kept_tokens",
    "sink",
    "recent",
    "heavy",
    "payload_bytes",
    "overhead_bytes",
    "residual_bytes",
    "partial_bytes",
    "page_meta_bytes",
    "stored_bytes",
    "read_bytes",
    "full_bytes",
    "prefill_bytes",
)


@dataclass(frozen=True)
class Ledger:
    spec: Spec
    position: int  # the evaluated query's position; the caches hold tokens 0..position
    n_tokens: int
    rows: tuple[dict, ...]  # one per (layer, KV head), keys COLUMNS
    # the sliding-window layers' windows, by the model's layer number (not compressed)
    sliding: tuple[tuple[int, int], ...] = ()

    def column(self, name: str) -> np.ndarray:
        return np.array([r[name] for r in self.rows])

    def per_layer(self, name: str) -> np.ndarray:
        """A column summed over the KV heads of each layer, (layers,)."""
        layers = self.column("layer")
        vals = self.column(name)
        return np.array([vals[layers == layer].sum() for layer in sorted(set(layers.tolist()))])

    @property
    def totals(self) -> dict:
        t = {name: float(self.column(name).sum()) for name in COLUMNS[2:]}
        t["token_ratio_declared"] = t["declared_tokens"] / max(len(self.rows) * self.n_tokens, 1)
        t["token_ratio_kept"] = t["kept_tokens"] / max(len(self.rows) * self.n_tokens, 1)
        t["byte_ratio_stored"] = t["stored_bytes"] / t["full_bytes"] if t["full_bytes"] else 1.0
        t["byte_ratio_read"] = t["read_bytes"] / t["full_bytes"] if t["full_bytes"] else 1.0
        t["peak_bytes"] = max(t["prefill_bytes"], t["stored_bytes"])
        return t

    def notes(self) -> list[str]:
        """Why the ratios differ, in words, with this setting's numbers."""
        t, s = self.totals, self.spec
        out = [
            f"declared: {t['declared_tokens']:.0f} token slots of {len(self.rows) * self.n_tokens} "
            f"({t['token_ratio_declared']:.1%}); kept: {t['kept_tokens']:.0f} ({t['token_ratio_kept']:.1%})"
        ]
        if s.evicts and (s.sink or s.recent):
            out.append(
                f"sinks and the recent window are inside the budget: {t['sink'] + t['recent']:.0f} of the "
                f"{t['kept_tokens']:.0f} kept tokens are chosen by position, not by the scorer"
            )
        if t["overhead_bytes"]:
            out.append(
                f"scale / zero-point overhead: {t['overhead_bytes']:,.0f} B "
                f"({t['overhead_bytes'] / max(t['stored_bytes'], 1):.1%} of what is stored)"
            )
        if t["residual_bytes"] and s.quantizes:
            out.append(f"residual tokens kept at 16 bits: {t['residual_bytes']:,.0f} B")
        if t["partial_bytes"]:
            out.append(f"trailing partial groups kept at 16 bits: {t['partial_bytes']:,.0f} B")
        if t["prefill_bytes"] > t["stored_bytes"]:
            out.append(
                f"at its peak the cache holds {t['prefill_bytes']:,.0f} B: the full 16-bit prefill of the "
                f"context, before the compression point; after it, {t['stored_bytes']:,.0f} B "
                f"({t['stored_bytes'] / t['prefill_bytes']:.1%} of the peak)"
            )
        if t["page_meta_bytes"]:
            out.append(
                f"Quest keeps every token plus per-page min / max keys ({t['page_meta_bytes']:,.0f} B): it "
                f"stores {t['byte_ratio_stored']:.2f}x the full cache and reads {t['byte_ratio_read']:.1%} "
                "of it per step"
            )
        out.append(
            f"bytes stored / full 16-bit cache: {t['byte_ratio_stored']:.1%} (compression ratio "
            f"{1 / t['byte_ratio_stored'] if t['byte_ratio_stored'] else float('inf'):.2f}x)"
        )
        if self.sliding:
            windows = sorted({w for _, w in self.sliding})
            out.append(
                f"{len(self.sliding)} sliding-window layer{'s' if len(self.sliding) > 1 else ''} "
                f"(window {', '.join(map(str, windows))}) "
                "hold the model's own window at 16 bits, in the full cache too: compression leaves them "
                "alone, as kvpress does"
            )
        if s.allocation == "adakv":
            out.append(
                "AdaKV declares a budget per layer (kv_heads x budget): heads trade slots, so per-head "
                "counts differ while each layer's total matches"
            )
        if s.evicts and t["kept_tokens"] < t["declared_tokens"]:
            why = get_policy(s.scorer).underfill_note(s, t["kept_tokens"], t["declared_tokens"])
            if why:
                out.append(why)
        return out


def _bytes(spec: Spec, n_kept: int, trace: Trace, n_tokens: int) -> dict:
    parts = dict(payload_bytes=0.0, overhead_bytes=0.0, residual_bytes=0.0, partial_bytes=0.0)
    for b in head_parts(spec, n_kept, trace.head_dim, trace.n_kv_heads, n_tokens, trace.context_len):
        parts["payload_bytes"] += b.payload
        parts["overhead_bytes"] += b.overhead
        parts["residual_bytes"] += b.residual
        parts["partial_bytes"] += b.partial
    return parts


def budget_ledger(trace: Trace, spec: Spec, step: int | None = None) -> Ledger:
    """The ledger at one evaluated query (View.step semantics: None = the last), every layer and KV head."""
    qi = check_view(trace, View(step=step))
    p = int(trace.query_positions[qi])
    n = p + 1
    D = trace.head_dim
    reads = spec.evicts and get_policy(spec.scorer).kind == "read"
    full = kv_bytes_per_token(1, 1, D) * n
    prefill = prefill_peak_bytes(1, 1, D, n, trace.context_len)
    rows = []
    for layer, window in enumerate(trace.layer_windows):
        kept = kept_at_query(trace, spec, layer, qi)  # (kv_heads, n)
        reason = reasons_for(kept, spec)
        declared = min(layer_spec(spec, layer, trace.n_layers, trace.context_len).budget, n) if spec.evicts else n
        full_l, prefill_l = full, prefill
        if window is not None:  # the model's window, at 16 bits: what the layer holds, compressed or not
            reason = np.full(kept.shape, RECENT, np.int8)
            declared = seen_tokens(window, n)
            full_l = kv_bytes_per_token(1, 1, D) * declared
            prefill_l = prefill_peak_bytes(1, 1, D, n, trace.context_len, (window,))
        for g in range(trace.n_kv_heads):
            r = np.where(kept[g], reason[g], EVICTED)
            k_tok = int(kept[g].sum())
            stored_tok = n if reads else k_tok
            parts = _bytes(spec, stored_tok, trace, n)
            meta = page_meta_bytes(spec, n, D) if reads else 0.0
            if window is not None:
                parts = dict.fromkeys(parts, 0.0) | {"payload_bytes": k_tok * kv_bytes_per_token(1, 1, D)}
                meta = 0.0
            stored = sum(parts.values()) + meta
            read = (sum(_bytes(spec, k_tok, trace, n).values()) + meta) if reads else stored
            if window is not None:
                read = stored
            rows.append(
                dict(
                    layer=layer,
                    kv_head=g,
                    declared_tokens=declared,
                    kept_tokens=k_tok,
                    sink=int((r == SINK).sum()),
                    recent=int((r == RECENT).sum()),
                    heavy=int(((r == HEAVY) | (r == ALL)).sum()),
                    **parts,
                    page_meta_bytes=meta,
                    stored_bytes=stored,
                    read_bytes=read,
                    full_bytes=full_l,
                    prefill_bytes=prefill_l,
                )
            )
    return Ledger(
        spec=spec,
        position=p,
        n_tokens=n,
        rows=tuple(rows),
        sliding=tuple((number, w) for number, w in zip(trace.layer_numbers, trace.layer_windows) if w is not None),
    )


def to_csv(ledger: Ledger) -> str:
    lines = [",".join(COLUMNS)]
    for r in ledger.rows:
        lines.append(",".join(f"{r[c]:g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS))
    return "\n".join(lines) + "\n"
