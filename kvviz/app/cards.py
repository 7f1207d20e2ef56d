"""The metric cards and the 'All numbers' table, with their number formats."""

from __future__ import annotations

import math

import streamlit as st

from kvviz.analysis.readout import card_values, fmt_pct, memory_peak_text
from kvviz.analysis.readout import concentration_verdict, fmt_bytes  # noqa: F401 (pages read these here)
from kvviz.engine import Comparison


CARD_HELP = {
    "Attention mass retained": "Share of the original attention that falls on tokens the compressed cache keeps.",
    "TV distance": (
        "Total variation distance ½·Σ|a − â| between original and compressed attention (0 = identical, "
        "1 = disjoint). With eviction on it is at least the evicted mass, whatever the bits."
    ),
    "TV from quantization": (
        "What quantization adds on top of eviction: ½·Σ|â − a_evict|, where a_evict is the "
        "attention with the same tokens evicted but nothing quantized (a / mass on the kept "
        "tokens). The error chart splits every token's error the same way."
    ),
    "KL divergence": (
        "In nats: KL(compressed ‖ original) = Σ over kept tokens of â·log(â / a). Always finite; for "
        "eviction alone it equals −log(mass retained). The other direction, KL(original ‖ compressed), "
        "is infinite as soon as any attended token is evicted. Not the same quantity as the Model "
        "lab's KL between next-token distributions."
    ),
    "Output error": (
        "How far the attention output o = a·V moved: ‖ô − o‖ / ‖o‖, as a share of the output's own "
        "length. Above 100% the compressed output is further from the original than the original is "
        "from zero (kept values that point elsewhere); the cosine under it, between −1 and 1, says "
        "whether ô still points the same way (1 = same direction; it shows the difference from A "
        "instead when a setting is pinned)."
    ),
    "KV memory": (
        "Bytes of the compressed K and V cache, all layers and KV heads, incl. scales and zero points. "
        "Under it, the cache at its peak: every method here compresses after the whole context is "
        "prefilled, so the full 16-bit cache of the context exists first (kvpress compresses after the "
        "prefill too); and, for Quest, the bytes one decode step reads. A model's sliding-window layers "
        "count as the model keeps them: their last W tokens at 16 bits, never compressed."
    ),
    "Memory vs 16-bit": (
        "Compressed bytes as a share of a full 16-bit cache of the same tokens (for a model with "
        "sliding-window layers, the model's own cache: those layers hold their window)."
    ),
    "Tokens kept": "Tokens in the compressed cache of the tokens this query sees.",
}
# For comparing against a pinned setting: is a rise good (normal), bad (inverse) or neither (off)?
CARD_DIRECTION = {
    "Attention mass retained": ("mass_retained", "normal"),
    "TV distance": ("tv_distance", "inverse"),
    "TV from quantization": ("tv_quantization", "inverse"),
    "KL divergence": ("kl", "inverse"),
    "Output error": ("output_rel_error", "inverse"),
    "KV memory": ("kv_bytes", "inverse"),
    "Memory vs 16-bit": ("memory_ratio", "inverse"),
    "Tokens kept": ("kept_tokens", "off"),
}


def card_delta(label: str, now: dict, pinned: dict) -> str | None:
    """'+0.0123' style difference of a card's number against the pinned setting A."""
    key = CARD_DIRECTION[label][0]
    a, b = pinned.get(key), now.get(key)
    if a is None or b is None:
        return None
    d = b - a
    if key in ("mass_retained", "output_rel_error", "memory_ratio"):
        return f"{100 * d:+.1f} pts"
    if key == "kv_bytes":
        return ("+" if d >= 0 else "−") + fmt_bytes(abs(d))
    if key == "kept_tokens":
        return f"{int(d):+d}"
    return f"{d:+.4f}"


def metric_cards(comp: Comparison, pinned: Comparison | None = None) -> None:
    """Eight cards in two rows; with a pinned setting A each shows its difference from A."""
    values = card_values(comp.metrics)
    ratio = comp.metrics["compression_ratio"]
    cols = st.columns(4) + st.columns(4)
    for col, (label, value) in zip(cols, values.items()):
        extra = f" ({ratio:.1f}× smaller)" if label == "Memory vs 16-bit" and math.isfinite(ratio) else ""
        kwargs = {}
        cosine = comp.metrics["output_cosine"]
        if label == "Output error" and cosine is not None:  # the bounded measure beside it
            kwargs = dict(delta=f"cos {cosine:.2f}", delta_color="off", delta_arrow="off")
        peak = memory_peak_text(comp.metrics) if label == "KV memory" else None
        if peak:  # the peak and Quest's reads beside the stored bytes
            kwargs = dict(delta=peak, delta_color="off", delta_arrow="off")
        if pinned is not None:
            kwargs = dict(
                delta=card_delta(label, comp.metrics, pinned.metrics),
                delta_color=CARD_DIRECTION[label][1],
                delta_description="vs pinned A",
            )
        col.metric(label, value, help=CARD_HELP[label] + extra, border=True, **kwargs)


PLAIN_HELP = {
    "Attention kept": CARD_HELP["Attention mass retained"],
    "Memory saved": "How much smaller the compressed K and V cache is than a full 16-bit cache of the same tokens.",
    "Tokens kept": CARD_HELP["Tokens kept"],
}


def plain_cards(comp: Comparison) -> None:
    """Presentation mode's three cards, in plain words: attention kept, memory saved, tokens kept."""
    m = comp.metrics
    values = {
        "Attention kept": fmt_pct(m["mass_retained"]),
        "Memory saved": fmt_pct(1.0 - m["memory_ratio"]),
        "Tokens kept": f"{m['kept_tokens']} / {m['total_tokens']}",
    }
    for col, (label, value) in zip(st.columns(3), values.items()):
        col.metric(label, value, help=PLAIN_HELP[label], border=True)


def metrics_table(comp: Comparison):
    """Every metric of the primary row next to its ensemble mean (the 'All numbers' table)."""
    import pandas as pd
    from kvviz.metrics import DEFINITIONS

    mean = comp.metrics_mean
    rows = [
        {
            "metric": k,
            "value": fmt_exact(v),
            "ensemble mean": fmt_exact(mean.get(k)),
            "definition": DEFINITIONS.get(k, ""),
        }
        for k, v in comp.metrics.items()
    ]
    return pd.DataFrame(rows)


def fmt_exact(x) -> str:
    """A number in full (repr) precision for the 'All numbers' table; ∞ for infinity, blank for none."""
    if x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "−∞"
    return repr(float(x)) if isinstance(x, float) else str(x)
