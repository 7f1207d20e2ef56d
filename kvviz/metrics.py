"""Metrics of a compressed attention row against the original, and ensemble statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

KL_EPS = 1e-10  # keeps KL finite when a token the original attends to was evicted
LOG_KL_EPS = float(np.log(KL_EPS))


@dataclass(frozen=True, slots=True)
class RowMetrics:
    mass_retained: float      # original attention mass on the kept tokens
    tv_distance: float        # 0.5 * sum |a - a_hat|
    kl: float                 # KL(original || compressed), epsilon-smoothed, nats
    max_abs_error: float
    output_rel_error: float | None  # ||o - o_hat|| / ||o||, o = a . V
    output_cosine: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def row_metrics_batch(original: np.ndarray, error: np.ndarray, log_ratio: np.ndarray, mass: np.ndarray,
                      out_original: np.ndarray | None = None,
                      out_compressed: np.ndarray | None = None) -> list[RowMetrics]:
    """Metrics of rows stacked along axis 0 (H, n), vectorised.

    error = compressed - original; mass (H,) = original attention on the kept tokens;
    log_ratio = log p - log q, from log-softmaxes, where an evicted token (q = 0) counts
    as q = KL_EPS: KL(original || compressed) = sum p log_ratio stays finite, and is
    exactly 0 with nothing compressed.
    """
    kl = np.einsum("ij,ij->i", original, log_ratio)
    abs_err = np.abs(error)
    tv = 0.5 * abs_err.sum(axis=1)
    mx = abs_err.max(axis=1)
    rel = cos = [None] * len(original)
    if out_original is not None and out_compressed is not None:
        o, o_hat = out_original, out_compressed
        diff = o_hat - o
        norm = np.sqrt(np.einsum("ij,ij->i", o, o)).tolist()                # a few rows: finish in Python
        norm_hat = np.sqrt(np.einsum("ij,ij->i", o_hat, o_hat)).tolist()
        norm_diff = np.sqrt(np.einsum("ij,ij->i", diff, diff)).tolist()
        dot = np.einsum("ij,ij->i", o, o_hat).tolist()
        rel = [d / a if a > 0 else 0.0 for d, a in zip(norm_diff, norm)]
        cos = [x / (a * b) if a * b > 0 else 1.0 for x, a, b in zip(dot, norm, norm_hat)]
    return [RowMetrics(mass_retained=m, tv_distance=t, kl=k, max_abs_error=x, output_rel_error=r, output_cosine=c)
            for m, t, k, x, r, c in zip(mass.tolist(), tv.tolist(), kl.tolist(), mx.tolist(), rel, cos)]


@dataclass(frozen=True, eq=False)
class Spread:
    """Per-token statistics of an ensemble of error rows (members x tokens).

    NaN in `errors` marks a token a member cannot see (an earlier step, say).
    """

    errors: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    n: np.ndarray    # members that see each token

    @cached_property
    def lo(self) -> np.ndarray:
        """2.5th percentile per token (computed on first use: it needs a sort)."""
        return _column_percentile(self.errors, self.n, 2.5)

    @cached_property
    def hi(self) -> np.ndarray:
        """97.5th percentile per token."""
        return _column_percentile(self.errors, self.n, 97.5)


def spread(errors: np.ndarray, complete: bool = False) -> Spread:
    """Mean, std and 95% interval per token over the ensemble members (rows).

    A single member (or identical members) gives zero spread, never missing values.
    `complete` says every member sees every token (no NaN), which skips the NaN count.
    """
    errors = np.atleast_2d(errors)
    members = len(errors)
    if not complete:
        n = (~np.isnan(errors)).sum(axis=0)
        if not n.all():
            raise ValueError("every token needs at least one ensemble member that sees it")
        if n.min() < members:
            return Spread(errors=errors, mean=np.nanmean(errors, axis=0), std=np.nanstd(errors, axis=0), n=n)
    mean = errors.sum(axis=0) / members          # every member sees every token: plain reductions
    deviation = errors - mean
    deviation *= deviation
    std = np.sqrt(deviation.sum(axis=0) / members)
    return Spread(errors=errors, mean=mean, std=std, n=np.full(errors.shape[1], members))


def _column_percentile(a: np.ndarray, n: np.ndarray, q: float) -> np.ndarray:
    """np.nanpercentile(a, q, axis=0) (linear interpolation), vectorised over columns."""
    s = np.sort(a, axis=0)                      # NaN sorts last, so valid values lead
    pos = (n - 1) * (q / 100.0)
    below = np.floor(pos).astype(int)
    above = np.minimum(below + 1, n - 1)
    frac = pos - below
    lo = np.take_along_axis(s, below[None], axis=0)[0]
    hi = np.take_along_axis(s, above[None], axis=0)[0]
    return lo + (hi - lo) * frac


def concentration_curve(attention: np.ndarray, fractions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Share of attention mass held by the top x of tokens, for x in `fractions` (0..1].

    Fractions are of the tokens the row covers; the share uses ceil(x * n) tokens.
    """
    if fractions is None:
        fractions = np.linspace(0.01, 1.0, 100)
    a = np.sort(np.asarray(attention, dtype=np.float64))[::-1]
    cum = np.concatenate([[0.0], np.cumsum(a)]) / max(a.sum(), 1e-300)
    counts = np.clip(np.ceil(fractions * len(a) - 1e-9).astype(int), 0, len(a))
    return np.asarray(fractions), cum[counts]


def top_share(attention: np.ndarray, fraction: float) -> float:
    """Mass held by the top `fraction` of tokens (at least one token)."""
    return float(concentration_curve(attention, np.array([fraction]))[1][0])


def entropy(attention: np.ndarray) -> float:
    a = attention[attention > 0]
    return float(-(a * np.log(a)).sum())
