"""A study's frontier: each point the mean over the study's replicates (seeds for a synthetic study,
texts for a model study, the (length, depth) prompts of a needle study) with a 95% t-interval for
that mean, N shown; and the Pareto frontier of the real policies (the oracle is the bound, left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from kvviz.analysis.sweep import pareto_front
from kvviz.policies.registry import is_bound

# per kind: the replicate columns (the error bars are over them), the series a line joins over
# budgets, the x column, and the metrics (column -> (label, higher is better))
REPLICATES = {"synthetic": ("seed",), "model": ("text",), "needle": ("length", "depth")}
SERIES = {
    "synthetic": ("scorer", "bits", "format"),
    "model": ("model", "method", "bits"),
    "needle": ("model", "scorer", "bits"),
}
X_COLUMN = {"synthetic": "memory_ratio", "model": "memory_ratio", "needle": "budget"}
METRICS = {
    "synthetic": {
        "tv": ("TV distance (0-1)", False),
        "kl_compressed_vs_original": ("KL(compressed ‖ original), nats", False),
        "js": ("Jensen–Shannon (≤ ln 2)", False),
        "mass_retained": ("attention mass retained (0-1)", True),
        "output_error": ("output error (relative)", False),
    },
    "model": {
        "perplexity_ratio": ("perplexity / full-cache perplexity", False),
        "kl_mean": ("next-token KL(full ‖ compressed), nats/token", False),
        "top1_agreement": ("top-1 agreement with the full cache (0-1)", True),
        "perplexity": ("perplexity", False),
    },
    "needle": {
        "correct": ("share of pass keys found (0-1)", True),
        "needle_kept": ("share of the needle's tokens kept (0-1)", True),
        "kept_mass": ("needle attention the cache still holds (0-1)", True),
    },
}
METHOD_COLUMN = {"synthetic": "scorer", "model": "method", "needle": "scorer"}


@dataclass(frozen=True)
class Frontier:
    """The points to draw: one row per (series, budget) with mean, half-width and N of the metric."""

    kind: str
    metric: str
    label: str
    higher_is_better: bool
    replicates: str  # what the error bars are over ("seeds", "texts", "prompts")
    # series columns, budget, x, mean, half, n, lo, hi, plus the first replicate
    points: pd.DataFrame
    front: list[int]  # indices into points of the Pareto-optimal real policies, by x


def t_half_width(values: pd.Series) -> float:
    """Half-width of the 95% t-interval for the mean (0 with one value)."""
    n = int(values.count())
    if n < 2:
        return 0.0
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1) * values.std(ddof=1) / math.sqrt(n))


def frontier(rows: pd.DataFrame, kind: str, metric: str | None = None) -> Frontier:
    """Means over replicates with 95% t-intervals, one point per (series, budget), and the frontier."""
    metrics = METRICS[kind]
    metric = metric or next(iter(metrics))
    if metric not in metrics:
        raise KeyError(f"unknown metric {metric!r} for a {kind} study; choose from {', '.join(metrics)}")
    label, higher = metrics[metric]
    reps = {"synthetic": "seeds", "model": "texts", "needle": "prompts (length × depth)"}[kind]
    series, x = list(SERIES[kind]), X_COLUMN[kind]
    keys = series + ["budget"]
    if rows.empty:
        return Frontier(kind, metric, label, higher, reps, pd.DataFrame(), [])
    data = rows.assign(_y=rows[metric].astype(float))
    groups = []
    for key, g in data.groupby(keys, sort=True, dropna=False):
        first = g.iloc[0]
        groups.append(
            {
                **dict(zip(keys, key)),
                "x": float(g[x].astype(float).mean()),
                "mean": float(g["_y"].mean()),
                "half": t_half_width(g["_y"]),
                "n": int(g["_y"].count()),
                **{c: first[c] for c in REPLICATES[kind]},
                "cell": first["cell"],
            }
        )
    points = pd.DataFrame(groups)
    points["lo"], points["hi"] = points["mean"] - points["half"], points["mean"] + points["half"]
    sign = -1.0 if higher else 1.0
    real = [i for i in range(len(points)) if not is_bound(points.loc[i, METHOD_COLUMN[kind]])]
    front = [real[j] for j in pareto_front([(points.loc[i, "x"], sign * points.loc[i, "mean"]) for i in real])]
    return Frontier(kind, metric, label, higher, reps, points, front)
