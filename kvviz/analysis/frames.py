"""Tables behind the app's charts: per-token and binned frames, concentration statistics.

Pure numerics on top of the core (no Streamlit): the app turns a `Comparison` into the
rows its charts and CSV download show, and long sequences into bins so a 32k-token trace
never becomes 32k bars in the browser.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvviz.attention import logit_rows, softmax
from kvviz.limits import checkpoint
from kvviz.engine import REASONS, Comparison
from kvviz.metrics import Spread, concentration_curve, entropy, error_split, spread
from kvviz.trace import Trace

BIN_THRESHOLD = 256  # above this many tokens the charts show bins instead of one bar per token
MAX_BINS = 128


def ranges_text(indices) -> str:
    """Compact runs of integers: [0,1,2,3,15,28,56,...,63] -> '0-3, 15, 28, 56-63'."""
    idx = sorted(int(i) for i in indices)
    if not idx:
        return "none"
    runs, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(runs)


def error_band(comp: Comparison, bars: str = "std") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, lo, hi) of the per-token error over the ensemble; bars one of BANDS."""
    s = comp.spread
    return (s.mean, *s.band(bars))


def band_columns(s: Spread) -> dict[str, np.ndarray]:
    """Every error band under a name that says what it holds (the CSV has them all)."""
    return {
        "error_mean": s.mean,
        "error_std_sample": s.std,
        "error_ci95_lo": s.ci_lo,
        "error_ci95_hi": s.ci_hi,
        "error_min": s.member_min,
        "error_max": s.member_max,
        "members": s.n,
    }


def band_bounds(columns, bars: str) -> tuple:
    """(band_lo, band_hi): the band the chart draws (one of BANDS), from a frame or a dict of its columns."""
    if bars == "std":
        return columns["error_mean"] - columns["error_std_sample"], columns["error_mean"] + columns["error_std_sample"]
    return {
        "ci95": (columns["error_ci95_lo"], columns["error_ci95_hi"]),
        "range": (columns["error_min"], columns["error_max"]),
    }[bars]


def with_band(frame: pd.DataFrame, bars: str) -> pd.DataFrame:
    """The frame plus `band_lo` / `band_hi`: the band the chart draws (one of BANDS)."""
    lo, hi = band_bounds(frame, bars)
    return frame.assign(band_lo=lo, band_hi=hi)


def row_text(comp: Comparison) -> str:
    """The primary row in words: 'layer 1, query head 2 (KV head 1), query at position 543' (the layer as the
    model numbers it)."""
    p = comp.primary
    return f"layer {comp.model_layer}, query head {p.head} (KV head {p.kv_head}), query at position {p.position}"


def ensemble_text(comp: Comparison) -> str:
    """What the ensemble members are, in words ('query heads 0-3 of layer 1, query at 543')."""
    rows = comp.members
    if len(rows) == 1:
        return row_text(comp)
    kind = comp.ensemble
    if kind == "heads":
        return f"query heads {ranges_text(r.head for r in rows)} of layer {comp.model_layer}"
    if kind == "layers":
        return f"query head {rows[0].head} in layers {ranges_text(comp.layer_name(r.layer) for r in rows)}"
    if kind == "steps":
        positions = ranges_text(r.position for r in rows)
        return f"layer {comp.model_layer}, head {rows[0].head}, queries at positions {positions}"
    return f"{len(rows)} random seeds"


def member_parts(comp: Comparison) -> tuple[np.ndarray, np.ndarray]:
    """(eviction part, quantization part) of each member's error, (members, n); NaN where a
    member does not see a token (an earlier decode step)."""
    n = len(comp.primary.original)
    parts = np.full((2, len(comp.members), n), np.nan)
    for i, m in enumerate(comp.members):
        k = min(n, len(m.error))
        evict, quant = _split(comp, m)
        parts[0, i, :k], parts[1, i, :k] = evict[:k], quant[:k]
    return parts[0], parts[1]


def _split(comp: Comparison, row) -> tuple[np.ndarray, np.ndarray]:
    """error_split of one row; without quantization the quantization part is exactly zero
    (not the rounding noise of two softmaxes) and the eviction part is the whole error."""
    if not comp.spec.quantizes:
        return row.error, np.zeros_like(row.error)
    return error_split(row.original, row.compressed, row.kept)


def error_extent(frame: pd.DataFrame) -> float:
    """The largest |error| any band of the frame reaches (what a locked y-axis must hold)."""
    cols = [
        frame["error_min"],
        frame["error_max"],
        frame["error_ci95_lo"],
        frame["error_ci95_hi"],
        frame["error_mean"] - frame["error_std_sample"],
        frame["error_mean"] + frame["error_std_sample"],
    ]
    return float(np.nanmax(np.abs(np.concatenate([c.to_numpy(dtype=float) for c in cols]))))


def attention_extent(frame: pd.DataFrame) -> float:
    """The largest attention bar of the frame, original or compressed (what a locked attention axis must hold)."""
    return float(
        np.nanmax(np.concatenate([frame["original"].to_numpy(dtype=float), frame["compressed"].to_numpy(dtype=float)]))
    )


def token_frame(comp: Comparison) -> pd.DataFrame:
    """One row per token the evaluated query sees: attention before/after, why kept, error.

    `error` is the primary row's; the error_* columns are the ensemble's statistics;
    error_eviction / error_quantization split the error by cause (metrics.error_split),
    for the primary row and (…_mean) averaged over the ensemble.
    """
    return pd.DataFrame(token_columns(comp))


def token_columns(comp: Comparison) -> dict:
    """token_frame's columns as arrays (what a lesson stores at each of thousands of settings)."""
    p = comp.primary
    evict, quant = _split(comp, p)
    evict_members, quant_members = member_parts(comp)
    return {
        "position": np.arange(len(p.original)),
        "token": list(comp.tokens),
        "original": p.original,
        "compressed": p.compressed,
        "kept": p.kept.astype(bool),
        "reason": [REASONS[int(r)] for r in p.reason],
        "error": p.error,
        "error_eviction": evict,
        "error_quantization": quant,
        "error_eviction_mean": np.nanmean(evict_members, axis=0),
        "error_quantization_mean": np.nanmean(quant_members, axis=0),
        **band_columns(comp.spread),
    }


def bin_edges(n: int, max_bins: int = MAX_BINS) -> np.ndarray:
    """Start positions of equal-width bins covering 0..n-1 (the last bin may be shorter)."""
    width = max(1, -(-n // max_bins))
    return np.arange(0, n, width)


def bin_sums(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Sum of values (..., n) within each bin starting at `edges`."""
    return np.add.reduceat(values, edges, axis=-1)


def token_range(n: int, first: int = 0, last: int = -1) -> tuple[int, int]:
    """The tokens [first, last] of a row of n, clamped into 0..n-1 (last -1: the row's last token; a
    range given backwards is turned round)."""
    last = n - 1 if last < 0 else last
    first, last = sorted((min(max(int(first), 0), n - 1), min(max(int(last), 0), n - 1)))
    return first, last


def zoom_frame(comp: Comparison, first: int = 0, last: int = -1, max_bins: int = MAX_BINS) -> tuple[pd.DataFrame, bool]:
    """(frame, binned) of the tokens first..last of the row: one row per token where the range holds
    at most BIN_THRESHOLD tokens (token_frame's rows), else at most `max_bins` bins of it (binned_frame).
    What the charts draw, so they never carry more than a few hundred bars whatever the row's length."""
    first, last = token_range(len(comp.primary.original), first, last)
    if last - first + 1 <= BIN_THRESHOLD:
        return token_frame(comp).iloc[first : last + 1], False
    return binned_frame(comp, max_bins, first, last), True


def binned_frame(comp: Comparison, max_bins: int = MAX_BINS, first: int = 0, last: int = -1) -> pd.DataFrame:
    """Bins of consecutive tokens of first..last (the whole row by default): attention mass per bin (the
    sum over its tokens), the largest single token's attention and error in it, and the error bars of
    each bin's mass shift.

    Each ensemble member's error row is summed per bin first, so the bars are the spread
    of the bin's total error over the members, not a sum of per-token spreads.
    """
    return pd.DataFrame(binned_columns(comp, max_bins, first, last))


def _extreme(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per bin, the value of largest magnitude (its sign kept): the single token that moves most."""
    top, bottom = np.maximum.reduceat(values, edges), np.minimum.reduceat(values, edges)
    return np.where(top >= -bottom, top, bottom)


def binned_columns(comp: Comparison, max_bins: int = MAX_BINS, first: int = 0, last: int = -1) -> dict:
    """binned_frame's columns as arrays (start / end are positions in the row)."""
    p = comp.primary
    first, last = token_range(len(p.original), first, last)
    full = slice(first, last + 1)
    n = last - first + 1
    edges = bin_edges(n, max_bins)  # relative to `first`
    ends = np.append(edges[1:], n) - 1
    errors = np.full((len(comp.members), n), np.nan)
    for i, m in enumerate(comp.members):
        row = m.error[full]
        errors[i, : len(row)] = row
    # a member that cannot see a token contributes nothing to that bin
    member_sums = np.where(np.isnan(errors), 0.0, errors)
    seen = ~np.isnan(errors)
    sums = bin_sums(member_sums, edges)
    sums[bin_sums(seen.astype(int), edges) == 0] = np.nan
    s = spread(sums)
    kept = p.kept.astype(bool)[full]
    original, compressed, error = p.original[full], p.compressed[full], p.error[full]
    evict_members, quant_members = member_parts(comp)
    part_means = [
        np.nanmean(bin_sums(np.nan_to_num(part[:, full]), edges), axis=0) for part in (evict_members, quant_members)
    ]
    tokens = comp.tokens
    return {
        "start": edges + first,
        "end": ends + first,
        "first_token": [tokens[i + first] for i in edges],
        "last_token": [tokens[i + first] for i in ends],
        "tokens": ends - edges + 1,
        "kept_tokens": bin_sums(kept.astype(int), edges),
        "original": bin_sums(original, edges),
        "compressed": bin_sums(compressed, edges),
        "evicted_mass": bin_sums(np.where(kept, 0.0, original), edges),
        "original_max": np.maximum.reduceat(original, edges),
        "error": bin_sums(error, edges),
        "error_extreme": _extreme(error, edges),
        "error_eviction_mean": part_means[0],
        "error_quantization_mean": part_means[1],
        **band_columns(s),
    }


# --- concentration ---------------------------------------------------------------------


@dataclass(frozen=True)
class Concentration:
    """Per (layer, query head) statistics of one evaluated query's attention row."""

    fractions: np.ndarray  # (F,) share of tokens, 0..1
    curves: np.ndarray  # (layers, heads, F) mass held by the top fraction of tokens
    sink_share: np.ndarray  # (layers, heads) mass on the first `sink` tokens
    locality: np.ndarray  # (layers, heads) mass on the last `window` tokens
    entropy: np.ndarray  # (layers, heads) nats
    max_entropy: float  # log(tokens seen): the entropy of uniform attention
    top10: np.ndarray  # (layers, heads) mass on the top 10% of tokens
    position: int  # the query's position; the row covers tokens 0..position


def concentration(
    trace: Trace, step: int | None = None, sink: int = 1, window: int = 16, fractions: np.ndarray | None = None
) -> Concentration:
    """How concentrated the attention of the evaluated query at `step` is, for every layer and head."""
    if fractions is None:
        fractions = np.linspace(0.01, 1.0, 100)
    evaluated = trace.evaluated_queries
    qi = int(evaluated[-1 if step is None else step])
    position = int(trace.query_positions[qi])
    n = position + 1
    shape = (trace.n_layers, trace.n_q_heads)
    curves = np.zeros(shape + (len(fractions),))
    sink_share, locality, ent, top10 = (np.zeros(shape) for _ in range(4))
    heads = np.arange(trace.n_q_heads)
    for layer in range(trace.n_layers):
        checkpoint()
        rows = softmax(logit_rows(trace, layer, heads, qi))  # (q_heads, n), one pass
        for head, a in enumerate(rows):
            curves[layer, head] = concentration_curve(a, fractions)[1]
            sink_share[layer, head] = a[: max(0, sink)].sum()
            locality[layer, head] = a[max(0, n - window) :].sum()
            ent[layer, head] = entropy(a)
            top10[layer, head] = concentration_curve(a, np.array([0.1]))[1][0]
    return Concentration(
        fractions=np.asarray(fractions),
        curves=curves,
        sink_share=sink_share,
        locality=locality,
        entropy=ent,
        max_entropy=float(np.log(n)),
        top10=top10,
        position=position,
    )
