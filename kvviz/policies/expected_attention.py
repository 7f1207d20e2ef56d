"""Expected Attention (kvpress's own method; Devoto et al. 2025): the attention future queries are
expected to pay each cached token, times the norm of its value.

Statistics: the mean mu and covariance S (divided by N) of the context's queries *before
RoPE*, leaving out the first 4 (kvpress n_sink: they hold outliers). Future queries sit at
positions c .. c + horizon - 1 (`Spec.ea_horizon`, kvpress n_future_positions = 512): the
statistics are rotated by the RoPE rotation averaged over those positions, R = mean_j R(j),
    mu' = R mu,  S' = R S R^T.
For a Gaussian query, E[exp(q . k / sqrt(d))] = exp(mu' . k / sqrt(d) + k^T S' k / (2 d)), so
each context key gets
    score_i = softmax_i(mu' . k_i / sqrt(d) + k_i^T S' k_i / (2 d))   (over keys 4 .. c-1)
averaged over the query heads of the KV group, times ||v_i|| (kvpress use_vnorm, epsilon 0).
The first 4 tokens rank above every other (kvpress pads them with max + 1). Without the
covariance (`Spec.ea_covariance = False`) only the mean term is used.

RoPE comes from the trace: `meta["rope_inv_freq"]` (captured and decoded traces carry the model's own), or an unscaled config `rope_theta`
(Llama-style rotate-half RoPE). A trace without RoPE (synthetic, handbook) has queries that
do not rotate: the statistics are used as they are and the horizon has no effect.
"""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext

EA_SINK = 4   # kvpress ExpectedAttentionPress n_sink


def rope_inv_freq(trace) -> np.ndarray | None:
    """The trace's RoPE inverse frequencies (head_dim / 2,), or None if it has no RoPE kvviz knows."""
    meta = trace.meta or {}
    if meta.get("rope_inv_freq") is not None:
        return np.asarray(meta["rope_inv_freq"], dtype=np.float64)
    config = meta.get("config") or {}
    theta = config.get("rope_theta")
    params = config.get("rope_parameters")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    scaled = config.get("rope_scaling") or (isinstance(params, dict) and params.get("rope_type", "default") != "default")
    if theta is None or scaled:     # scaled RoPE: only the model's own inv_freq (captured traces carry it) is exact
        return None
    d = trace.head_dim
    return 1.0 / (float(theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (..., n, d) at positions (n,): x cos + rotate_half(x) sin."""
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]      # (n, d/2)
    cos, sin = np.cos(angle), np.sin(angle)
    cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def mean_rotation(start: int, horizon: int, inv_freq: np.ndarray) -> np.ndarray:
    """(d, d): the RoPE rotation matrix averaged over positions start .. start + horizon - 1."""
    angle = np.arange(start, start + horizon, dtype=np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(angle).mean(0), np.sin(angle).mean(0)
    c, s = np.concatenate([c, c]), np.concatenate([s, s])
    d = len(c)
    P = np.zeros((d, d))
    P[d // 2:, : d // 2] = np.eye(d // 2)
    P[: d // 2, d // 2:] = -np.eye(d // 2)
    return np.diag(c) + s[:, None] * P


class ExpectedAttention(Policy):
    name = "expected_attention"
    description = ("the attention future queries are expected to pay: mean and covariance of the context's "
                   "(pre-RoPE) queries rotated over the next `horizon` positions, times the value norm")
    paper = "Devoto et al. 2025, Expected Attention: KV-cache compression by estimating attention from future queries"
    kvpress = "ExpectedAttentionPress"

    def score_key(self, spec):
        return (spec.ea_horizon, spec.ea_covariance)

    def score(self, ctx: ScoreContext) -> np.ndarray:
        trace, layer, c = ctx.trace, ctx.layer, ctx.n_context
        rows = ctx.history_rows
        if len(rows) > EA_SINK + 1:
            rows = rows[EA_SINK:]
        q = trace.q[layer][:, rows].astype(np.float64)                     # (Hq, N, d), post-RoPE
        inv_freq = rope_inv_freq(trace)
        if inv_freq is not None:                                           # back to pre-RoPE
            q = rotate(q, -trace.query_positions[rows], inv_freq)
        mu = q.mean(axis=1)                                                 # (Hq, d)
        centred = q - mu[:, None]
        cov = np.einsum("hni,hnj->hij", centred, centred) / q.shape[1]      # (Hq, d, d)
        if inv_freq is not None:
            R = mean_rotation(c, ctx.spec.ea_horizon, inv_freq)
            mu = mu @ R.T
            cov = R @ cov @ R.T
        d = trace.head_dim
        g = trace.group_size
        keys = np.repeat(trace.k[layer][:, :c].astype(np.float64), g, axis=0)   # (Hq, c, d)
        logits = np.einsum("hnd,hd->hn", keys, mu) / np.sqrt(d)
        if ctx.spec.ea_covariance:
            logits += np.einsum("hni,hij,hnj->hn", keys, cov, keys) / d / 2
        first = EA_SINK if c > EA_SINK else 0
        z = logits[:, first:]
        z = np.exp(z - z.max(axis=1, keepdims=True))
        expected = np.zeros_like(logits)
        expected[:, first:] = z / z.sum(axis=1, keepdims=True)
        scores_c = ctx.per_kv_head(expected) / g                            # mean over the group
        if trace.v is not None:
            scores_c *= np.linalg.norm(trace.v[layer][:, :c].astype(np.float64), axis=-1)
        if first:
            scores_c[:, :first] = scores_c[:, first:].max() + 1.0
        scores = np.full((trace.n_kv_heads, ctx.n_positions), -np.inf)
        scores[:, :c] = scores_c
        return scores
