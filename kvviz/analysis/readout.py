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


def memory_peak_text(metrics: dict) -> str | None:
    """What the memory card adds under its number: the cache at its peak (the full 16-bit prefill, before
    compression) where that is more than what is stored, and the bytes one decode step reads where a method
    reads less than it stores (Quest)."""
    parts = []
    peak, stored, read = (metrics.get("kv_bytes_peak"), metrics["kv_bytes"], metrics.get("kv_bytes_read"))
    if peak is not None and peak > stored:
        parts.append(f"peak {fmt_bytes(peak)}")
    if read is not None and read < stored:
        parts.append(f"reads {fmt_bytes(read)} a step")
    return " · ".join(parts) or None


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


def no_eviction_note(spec: Spec) -> str | None:
    """Why every token is kept when the three budgets are 0 (while sink 1 alone keeps one token): a budget
    of 0 everywhere turns eviction off, it does not empty the cache."""
    if spec.evicts:
        return None
    rest = (
        ""
        if spec.quantizes
        else " With 16 bits as well, nothing is compressed: the two bars of every "
        "token are the same and the error is zero."
    )
    return (
        "Sink, recent window and heavy-hitter budget are all 0, which turns eviction off: every token is "
        "kept (0 everywhere means no limit, not an empty cache). Raise any of them to evict." + rest
    )


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
        return f"More concentrated than the handbook's band: {held}, so eviction loses even less here."
    return f"Within the handbook's band: {held}."


def fp8_clipping(trace, spec: Spec, step: int | None = None) -> dict | None:
    """What a static FP8 cast does to the cache at one evaluated query (View.step semantics): for keys and
    values, how many stored values saturate (|x / s| above the format's max, e.g. 448 in E4M3: stored as
    ±max) and how many non-zero values flush to zero, over every layer and KV head's quantized kept tokens,
    with the scales the engine uses (1.0, or calibrated on the context). None unless FP8 with static scales."""
    import numpy as np

    from kvviz.engine import check_view, kept_at_query
    from kvviz.quant import formats as qformats
    from kvviz.quant.fp8 import clipped
    from kvviz.spec import View

    fmts = {w: qformats.settings(spec, w)[0] for w in ("k", "v")}
    if (
        spec.quant_model != "kv"
        or spec.fp8_scale != "static"
        or trace.k is None
        or not {"e4m3", "e5m2"} & set(fmts.values())
    ):
        return None
    qi = check_view(trace, View(step=step))
    p = int(trace.query_positions[qi])
    out = {
        w: {"format": f, "saturated": 0, "flushed": 0, "values": 0, "scales": []}
        for w, f in fmts.items()
        if f in ("e4m3", "e5m2") and (w == "k" or trace.v is not None)
    }
    for layer in range(trace.n_layers):
        if trace.layer_windows[layer] is not None:  # a sliding layer is not quantized
            continue
        kept = kept_at_query(trace, spec, layer, qi)  # (kv_heads, p + 1)
        where = np.stack([np.flatnonzero(kept[g]) for g in range(trace.n_kv_heads)])
        n_quant = where.shape[1] - qformats.residual_at(spec, where, p, trace.context_len)
        rows = np.arange(trace.n_kv_heads)[:, None]
        for w, c in out.items():
            full = trace.k[layer] if w == "k" else trace.v[layer]
            x = full[rows, where[:, :n_quant]]
            rotated = qformats.settings(spec, w)[3]
            x = qformats.rotate(x) if rotated else x
            s = qformats.layer_static_scale(spec, w, full[:, : trace.context_len])
            sat, flushed = clipped(x, c["format"], "static", s)
            c["saturated"] += sat
            c["flushed"] += flushed
            c["values"] += int(x.size)
            c["scales"].append(1.0 if s is None else s)
    return {"k": out.get("k"), "v": out.get("v"), "position": p}


def fp8_clipping_note(counts: dict | None) -> str | None:
    """fp8_clipping's counts in one sentence."""
    if counts is None:
        return None
    parts = []
    for w, name in (("k", "keys"), ("v", "values")):
        c = counts.get(w)
        if not c or not c["values"]:
            continue
        top = {"e4m3": "448", "e5m2": "57,344"}[c["format"]]
        scales = c["scales"]
        scale = (
            "scale 1.0"
            if all(s == 1.0 for s in scales)
            else f"calibrated scale {scales[0]:.3g}"
            if min(scales) == max(scales)
            else f"calibrated scales {min(scales):.3g}–{max(scales):.3g} per layer"
        )
        parts.append(
            f"{c['saturated']:,} of the {c['values']:,} stored {name} saturated "
            f"(|x / s| above {top}, stored as ±{top} s) and "
            f"{c['flushed']:,} flushed to zero ({scale})"
        )
    if not parts:
        return None
    return "Static FP8: " + "; ".join(parts) + "."
