"""Metrics of a compressed attention row against the original, and ensemble statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

LN2 = float(np.log(2.0))
T_LEVEL = 0.95  # the t-interval's confidence


@dataclass(frozen=True, slots=True)
class RowMetrics:
    """How far one compressed attention row q is from the original p (both over tokens 0..pos).

    kl          KL(compressed || original) = sum over kept tokens of q (log q - log p), nats.
                Always finite; exactly -log(mass retained) for pure eviction (q = p / mass on
                the kept tokens), the usual KL for pure quantization.
    kl_forward  KL(original || compressed) = sum p (log p - log q): infinite (inf; JSON null)
                as soon as a token with p > 0 is evicted, so it is finite only without eviction.
    js          Jensen-Shannon divergence, 1/2 KL(p || m) + 1/2 KL(q || m) with m = (p + q) / 2;
                symmetric, finite, at most ln 2.
    """

    mass_retained: float  # original attention mass on the kept tokens
    tv_distance: float  # 0.5 * sum |a - a_hat|
    # 0.5 * sum |a_hat - a_evict|: what quantization adds to eviction alone
    tv_quantization: float
    kl: float  # KL(compressed || original), nats
    kl_forward: float  # KL(original || compressed), nats; inf once anything is evicted
    js: float  # Jensen-Shannon divergence, nats, <= ln 2
    max_abs_error: float
    output_rel_error: float | None  # ||o - o_hat|| / ||o||, o = a . V
    output_cosine: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def divergences(
    p_kept: np.ndarray,
    log_p_kept: np.ndarray,
    q_kept: np.ndarray,
    log_q_kept: np.ndarray,
    mass: np.ndarray,
    evicted: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kl, kl_forward, js) per row, from the rows over the kept tokens only (H, m).

    p is the original attention (its log from the full log-softmax), q the compressed one
    (zero on evicted tokens, so those enter only through the mass they lose: each evicted
    token adds 1/2 p ln 2 to js and makes kl_forward infinite).
    """
    kl = np.einsum("ij,ij->i", q_kept, log_q_kept - log_p_kept)
    if evicted:
        kl_forward = np.full(len(p_kept), np.inf)
    else:
        kl_forward = np.einsum("ij,ij->i", p_kept, log_p_kept - log_q_kept)
    # 2m on the kept tokens
    mid = p_kept + q_kept
    # p = q = 0 (underflow): weight 0 either way, keep the log finite
    np.maximum(mid, 1e-300, out=mid)
    log_mid = np.log(mid, out=mid)
    log_mid -= LN2  # log (p + q) / 2
    # evicted: p log(p / (p/2))
    lost = np.maximum(1.0 - mass, 0.0) * LN2
    js = 0.5 * (
        np.einsum("ij,ij->i", p_kept, log_p_kept - log_mid) + np.einsum("ij,ij->i", q_kept, log_q_kept - log_mid) + lost
    )
    return np.maximum(kl, 0.0), np.maximum(kl_forward, 0.0), np.minimum(np.maximum(js, 0.0), LN2)


def error_split(original: np.ndarray, compressed: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The per-token error split into its two causes (..., n): (eviction part, quantization part).

    Eviction alone gives a_evict = a / mass on the kept tokens and 0 on the evicted ones;
        eviction part     = a_evict - a      (whole tokens lost, their mass spread on the kept)
        quantization part = a_hat - a_evict  (small errors on every kept token)
    The two add up to the error a_hat - a exactly.
    """
    kept = np.asarray(kept, dtype=bool)
    mass = np.where(kept, original, 0.0).sum(axis=-1, keepdims=True)
    evict_only = np.where(kept, original / np.where(mass > 0, mass, 1.0), 0.0)
    return evict_only - original, compressed - evict_only


def row_metrics_batch(
    error: np.ndarray,
    mass: np.ndarray,
    kl: np.ndarray,
    kl_forward: np.ndarray,
    js: np.ndarray,
    out_original: np.ndarray | None = None,
    out_compressed: np.ndarray | None = None,
    tv_quantization: np.ndarray | None = None,
) -> list[RowMetrics]:
    """Metrics of rows stacked along axis 0 (H, n), vectorised.

    error = compressed - original; mass (H,) = original attention on the kept tokens;
    kl, kl_forward, js (H,) from `divergences`; tv_quantization (H,) (zeros if None).
    """
    abs_err = np.abs(error)
    tv = 0.5 * abs_err.sum(axis=1)
    mx = abs_err.max(axis=1)
    rel = cos = [None] * len(error)
    if out_original is not None and out_compressed is not None:
        o, o_hat = out_original, out_compressed
        diff = o_hat - o
        # a few rows: finish in Python
        norm = np.sqrt(np.einsum("ij,ij->i", o, o)).tolist()
        norm_hat = np.sqrt(np.einsum("ij,ij->i", o_hat, o_hat)).tolist()
        norm_diff = np.sqrt(np.einsum("ij,ij->i", diff, diff)).tolist()
        dot = np.einsum("ij,ij->i", o, o_hat).tolist()
        rel = [d / a if a > 0 else 0.0 for d, a in zip(norm_diff, norm)]
        cos = [x / (a * b) if a * b > 0 else 1.0 for x, a, b in zip(dot, norm, norm_hat)]
    tvq = [0.0] * len(error) if tv_quantization is None else tv_quantization.tolist()
    return [
        RowMetrics(
            mass_retained=m,
            tv_distance=t,
            tv_quantization=tq,
            kl=k,
            kl_forward=f,
            js=j,
            max_abs_error=x,
            output_rel_error=r,
            output_cosine=c,
        )
        for m, t, tq, k, f, j, x, r, c in zip(
            mass.tolist(), tv.tolist(), tvq, kl.tolist(), kl_forward.tolist(), js.tolist(), mx.tolist(), rel, cos
        )
    ]


DEFINITIONS = {
    "mass_retained": "original attention mass on the tokens the compressed cache keeps",
    "tv_distance": "0.5 * sum |compressed - original| (0 = identical, 1 = disjoint)",
    "tv_quantization": "0.5 * sum |compressed - eviction only|: what quantization adds to the eviction's error",
    "kl": "KL(compressed || original) = sum over kept tokens of q (log q - log p), nats; finite; "
    "-log(mass_retained) for pure eviction",
    "kl_forward": "KL(original || compressed), nats; infinite (JSON null) once an attended token is evicted",
    "js": "Jensen-Shannon divergence of original and compressed attention, nats, at most ln 2",
    "max_abs_error": "largest |compressed - original| over the tokens",
    "output_rel_error": "||o_hat - o|| / ||o||, o = a . V the attention output",
    "output_cosine": "cosine similarity of o_hat and o",
    "error_std_sample": "sample standard deviation over the ensemble members (n - 1)",
    "error_ci95_lo": "mean - t(0.975, n-1) * std / sqrt(n): 95% confidence interval for the mean error (_hi: +)",
    "error_min": "smallest error among the ensemble members (error_max: largest)",
}

BANDS = {"std": "mean ± 1 sample std", "ci95": "95% t-interval for the mean", "range": "range (min–max) of the members"}


@dataclass(frozen=True, eq=False)
class Spread:
    """Per-token statistics of an ensemble of error rows (members x tokens).

    NaN in `errors` marks a token a member cannot see (an earlier step, say).
        mean    the members' mean error per token
        std     the *sample* standard deviation (n - 1 in the denominator); 0 for one member
        n       members that see each token
        ci95    mean -+ t(0.975, n - 1) * std / sqrt(n): a 95% confidence interval for the mean
                error, assuming the members are independent draws (NaN for one member)
        min/max the range of the members themselves
    """

    errors: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    n: np.ndarray  # members that see each token

    @cached_property
    def member_min(self) -> np.ndarray:
        return np.nanmin(self.errors, axis=0)

    @cached_property
    def member_max(self) -> np.ndarray:
        return np.nanmax(self.errors, axis=0)

    @cached_property
    def half_width(self) -> np.ndarray:
        """t(0.975, n - 1) * std / sqrt(n) per token; NaN where n = 1."""
        n = self.n.astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 1, t_quantile(0.5 + T_LEVEL / 2, n - 1) * self.std / np.sqrt(n), np.nan)

    @property
    def ci_lo(self) -> np.ndarray:
        return self.mean - self.half_width

    @property
    def ci_hi(self) -> np.ndarray:
        return self.mean + self.half_width

    def band(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) of one of BANDS."""
        if kind == "std":
            return self.mean - self.std, self.mean + self.std
        if kind == "ci95":
            return self.ci_lo, self.ci_hi
        if kind == "range":
            return self.member_min, self.member_max
        raise ValueError(f"error band must be one of {', '.join(BANDS)}, got {kind!r}")


def t_quantile(prob: float, df: np.ndarray) -> np.ndarray:
    """Student t quantile (scipy.special.stdtrit), NaN where df < 1."""
    from scipy.special import stdtrit

    df = np.asarray(df, dtype=np.float64)
    return np.where(df >= 1, stdtrit(np.maximum(df, 1.0), prob), np.nan)


def spread(errors: np.ndarray, complete: bool = False) -> Spread:
    """Mean, sample std and member count per token over the ensemble members (rows).

    A single member (or identical members) gives zero std, never missing values.
    `complete` says every member sees every token (no NaN), which skips the NaN count.
    """
    errors = np.atleast_2d(errors)
    members = len(errors)
    if not complete:
        n = (~np.isnan(errors)).sum(axis=0)
        if not n.all():
            raise ValueError("every token needs at least one ensemble member that sees it")
        if n.min() < members:
            mean = np.nanmean(errors, axis=0)
            std = np.sqrt(np.nansum((errors - mean) ** 2, axis=0) / np.maximum(n - 1, 1))
            return Spread(errors=errors, mean=mean, std=std, n=n)
    mean = errors.sum(axis=0) / members  # every member sees every token: plain reductions
    deviation = errors - mean
    deviation *= deviation
    std = np.sqrt(deviation.sum(axis=0) / max(members - 1, 1))
    return Spread(errors=errors, mean=mean, std=std, n=np.full(errors.shape[1], members))


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
