"""Tables behind the app's charts: per-token and binned frames, concentration statistics.

Pure numerics on top of the core (no Streamlit): the app turns a `Comparison` into the
rows its charts and CSV download show, and long sequences into bins so a 32k-token trace
never becomes 32k bars in the browser.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .attention import logit_rows, softmax
from .engine import REASONS, Comparison
from .metrics import concentration_curve, entropy, spread
from .trace import Trace

BIN_THRESHOLD = 256   # above this many tokens the charts show bins instead of one bar per token
MAX_BINS = 128
BARS = ("std", "95%")  # error bars: mean +- one standard deviation, or the 2.5-97.5 percentile interval


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
    """(mean, lo, hi) of the per-token error over the ensemble; bars 'std' or '95%'."""
    s = comp.spread
    if bars == "95%":
        return s.mean, s.lo, s.hi
    if bars != "std":
        raise ValueError(f"error bars must be one of {BARS}, got {bars!r}")
    return s.mean, s.mean - s.std, s.mean + s.std


def token_frame(comp: Comparison, bars: str = "std") -> pd.DataFrame:
    """One row per token the evaluated query sees: attention before/after, why kept, error."""
    p = comp.primary
    mean, lo, hi = error_band(comp, bars)
    return pd.DataFrame({
        "position": np.arange(len(p.original)),
        "token": list(comp.tokens),
        "original": p.original,
        "compressed": p.compressed,
        "kept": p.kept.astype(bool),
        "reason": [REASONS[int(r)] for r in p.reason],
        "error": p.error,
        "error_mean": mean,
        "error_lo": lo,
        "error_hi": hi,
        "members": comp.spread.n,
    })


def bin_edges(n: int, max_bins: int = MAX_BINS) -> np.ndarray:
    """Start positions of equal-width bins covering 0..n-1 (the last bin may be shorter)."""
    width = max(1, -(-n // max_bins))
    return np.arange(0, n, width)


def bin_sums(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Sum of values (..., n) within each bin starting at `edges`."""
    return np.add.reduceat(values, edges, axis=-1)


def binned_frame(comp: Comparison, bars: str = "std", max_bins: int = MAX_BINS) -> pd.DataFrame:
    """Bins of consecutive tokens: attention mass per bin and the error bars of each bin's mass shift.

    Each ensemble member's error row is summed per bin first, so the bars are the spread
    of the bin's total error over the members, not a sum of per-token spreads.
    """
    p = comp.primary
    n = len(p.original)
    edges = bin_edges(n, max_bins)
    ends = np.append(edges[1:], n) - 1
    errors = np.full((len(comp.members), n), np.nan)
    for i, m in enumerate(comp.members):
        k = min(n, len(m.error))
        errors[i, :k] = m.error[:k]
    # a member that cannot see a token contributes nothing to that bin
    member_sums = np.where(np.isnan(errors), 0.0, errors)
    seen = ~np.isnan(errors)
    sums = bin_sums(member_sums, edges)
    sums[bin_sums(seen.astype(int), edges) == 0] = np.nan
    s = spread(sums)
    if bars == "95%":
        lo, hi = s.lo, s.hi
    else:
        lo, hi = s.mean - s.std, s.mean + s.std
    kept = p.kept.astype(bool)
    tokens = comp.tokens
    return pd.DataFrame({
        "start": edges,
        "end": ends,
        "first_token": [tokens[i] for i in edges],
        "last_token": [tokens[i] for i in ends],
        "tokens": ends - edges + 1,
        "kept_tokens": bin_sums(kept.astype(int), edges),
        "original": bin_sums(p.original, edges),
        "compressed": bin_sums(p.compressed, edges),
        "evicted_mass": bin_sums(np.where(kept, 0.0, p.original), edges),
        "error": bin_sums(p.error, edges),
        "error_mean": s.mean,
        "error_lo": lo,
        "error_hi": hi,
    })


# --- concentration ---------------------------------------------------------------------

@dataclass(frozen=True)
class Concentration:
    """Per (layer, query head) statistics of one evaluated query's attention row."""

    fractions: np.ndarray     # (F,) share of tokens, 0..1
    curves: np.ndarray        # (layers, heads, F) mass held by the top fraction of tokens
    sink_share: np.ndarray    # (layers, heads) mass on the first `sink` tokens
    locality: np.ndarray      # (layers, heads) mass on the last `window` tokens
    entropy: np.ndarray       # (layers, heads) nats
    max_entropy: float        # log(tokens seen): the entropy of uniform attention
    top10: np.ndarray         # (layers, heads) mass on the top 10% of tokens
    position: int             # the query's position; the row covers tokens 0..position


def concentration(trace: Trace, step: int | None = None, sink: int = 1, window: int = 16,
                  fractions: np.ndarray | None = None) -> Concentration:
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
        rows = softmax(logit_rows(trace, layer, heads, qi))             # (q_heads, n), one pass
        for head, a in enumerate(rows):
            curves[layer, head] = concentration_curve(a, fractions)[1]
            sink_share[layer, head] = a[: max(0, sink)].sum()
            locality[layer, head] = a[max(0, n - window):].sum()
            ent[layer, head] = entropy(a)
            top10[layer, head] = concentration_curve(a, np.array([0.1]))[1][0]
    return Concentration(fractions=np.asarray(fractions), curves=curves, sink_share=sink_share,
                         locality=locality, entropy=ent, max_entropy=float(np.log(n)), top10=top10,
                         position=position)
