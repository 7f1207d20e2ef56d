"""The numbers in words: the metric cards' text, byte and percent formats, and the warnings for
budgets and groups that do not mean what the sliders suggest.

Pure text from the core's results (no Streamlit): the app's cards and notes show it, and the
exported lesson (kvviz.analysis.lesson) carries the same strings, so both say the same thing.
"""

from __future__ import annotations

from kvviz.spec import FULL_BITS, Spec


def fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def card_values(metrics: dict) -> dict[str, str]:
    """The text of each metric card, from Comparison.metrics."""
    return {
        "Attention mass retained": fmt_pct(metrics["mass_retained"]),
        "TV distance": f"{metrics['tv_distance']:.4f}",
        "TV from quantization": f"{metrics['tv_quantization']:.4f}",
        "KL divergence": f"{metrics['kl']:.4f}",
        "Output error": fmt_pct(metrics["output_rel_error"], 1),
        "KV memory": fmt_bytes(metrics["kv_bytes"]),
        "Memory vs 16-bit": fmt_pct(metrics["memory_ratio"]),
        "Tokens kept": f"{metrics['kept_tokens']} / {metrics['total_tokens']}",
    }


def budget_warnings(spec: Spec, n_seen: int) -> list[str]:
    """What to change when the budgets do not mean what the sliders suggest."""
    out = []
    left = n_seen - min(n_seen, spec.sink + spec.recent)
    # no heavy budget can help: the advice names the sliders that can
    if spec.evicts and left == 0:
        out.append(
            f"Sink {spec.sink} + recent {spec.recent} already cover all {n_seen} tokens this query sees, so "
            "nothing is evicted. Lower the Sink tokens or the Recent window to see eviction."
        )
    elif spec.evicts and spec.heavy > left:
        out.append(
            f"Heavy-hitter budget {spec.heavy} is larger than the {left} tokens left after the sinks and "
            f"the recent window, so every token is kept. Lower the Heavy-hitter budget below {left} "
            "(or the other sliders)."
        )
    elif spec.evicts and spec.budget >= n_seen:
        out.append(
            f"Sink + recent + heavy = {spec.budget} covers all {n_seen} tokens this query sees, so nothing "
            "is evicted. Lower the sliders (or pick a later query) to see eviction."
        )
    return out


def quant_warnings(spec: Spec, kept: int) -> list[str]:
    """Where the bits slider cannot change anything: the kept tokens do not fill one group."""
    if spec.quant_model != "kv" or spec.partial != "full":
        return []
    out = []
    for what, bits, axis, fmt in (
        ("keys", spec.key_bits, spec.key_axis, spec.key_format),
        ("values", spec.value_bits, spec.value_axis, spec.value_format),
    ):
        outside = max(0, kept - spec.residual)
        if (
            fmt == "int"
            and spec.residual_mode == "kivi"
            and bits < FULL_BITS
            and axis == "channel"
            and outside < spec.group_size
        ):
            out.append(
                f"The {what} are not quantized: the {outside} kept tokens outside the residual window do not "
                f"fill one per-channel group of {spec.group_size}, and KIVI keeps a partial group at 16 bits. "
                "Lower the group size under Advanced, or quantize partial groups too."
            )
    return out


def concentration_verdict(fractions, curves, band=((0.10, 0.20), (0.80, 0.90))) -> str:
    """How the source's mean concentration curve compares with the handbook's band (10-20% of the tokens
    take 80-90% of the mass): within it, below it (less concentrated) or above it (more)."""
    import numpy as np

    (x0, x1), (y0, y1) = band
    mean = np.asarray(curves, dtype=float).reshape(-1, len(fractions)).mean(axis=0)
    lo, hi = (float(np.interp(x, fractions, mean)) for x in (x0, x1))
    held = (
        f"the top {x0:.0%} of tokens hold {fmt_pct(lo)} of the mass and the top {x1:.0%} hold {fmt_pct(hi)} "
        f"(the handbook's band: {x0:.0%}–{x1:.0%} of tokens take {y0:.0%}–{y1:.0%})"
    )
    if hi < y0:
        return f"Less concentrated than the handbook's band: {held}, so eviction keeps less of the attention here."
    if lo > y1:
        return (
            f"More concentrated than the handbook's band: {held}, so eviction loses even less here."
        )
    return f"Within the handbook's band: {held}."
