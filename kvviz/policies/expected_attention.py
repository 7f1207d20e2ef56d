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

RoPE comes from the trace: `meta["rope_inv_freq"]` (captured and decoded traces carry the model's
own), or its config: an unscaled `rope_theta` (Llama-style rotate-half RoPE), or a scaled RoPE
(Llama 3, YaRN, linear, ...) whose frequencies transformers' own ROPE_INIT_FUNCTIONS compute
(`models.config.inv_freq_from_config`; without transformers such a trace is refused, never
scored as if unrotated). A trace without RoPE (synthetic, handbook) has queries that do not
rotate: the statistics are used as they are and the horizon has no effect.
"""

import numpy as np

from kvviz.attention import row_norms
from kvviz.policies.base import Policy, ScoreContext, cached_on_trace
from kvviz.settings import Setting, declare

declare(
    Setting(
        "ea_horizon",
        "int",
        512,
        1,
        1_000_000,
        owner=("scorer", "expected_attention"),
        step=64,
        label="Expected Attention horizon (future positions)",
        help="The query statistics are rotated by the RoPE rotation averaged over this many positions after "
        "the context (kvpress n_future_positions 512). No effect on traces without RoPE.",
    ),
    Setting(
        "ea_covariance",
        "bool",
        True,
        url="ea_cov",
        cli="--ea-no-covariance",
        owner=("scorer", "expected_attention"),
        label="Use the queries' covariance (not only their mean)",
        help="Off (--ea-no-covariance): the queries' mean only, no covariance.",
    ),
)

EA_SINK = 4  # kvpress ExpectedAttentionPress n_sink


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
    scaled = config.get("rope_scaling") or (
        isinstance(params, dict) and params.get("rope_type", "default") != "default"
    )
    # scaled RoPE (Llama 3, YaRN, ...): transformers' own init functions
    if scaled:
        from kvviz.models.config import inv_freq_from_config

        inv_freq = inv_freq_from_config(config, trace.head_dim)
        if inv_freq is None:
            from kvviz.spec import SpecError

            raise SpecError(
                "this trace's model uses a scaled RoPE and carries no RoPE frequencies; Expected "
                "Attention needs transformers installed to compute them from its config"
            )
        return inv_freq
    if theta is None:
        return None
    d = trace.head_dim
    return 1.0 / (float(theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (..., n, d) at positions (n,): x cos + rotate_half(x) sin."""
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (n, d/2)
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
    P[d // 2 :, : d // 2] = np.eye(d // 2)
    P[: d // 2, d // 2 :] = -np.eye(d // 2)
    return np.diag(c) + s[:, None] * P


class ExpectedAttention(Policy):
    name = "expected_attention"
    head_separable = True
    order = 80
    allocated_in_sweeps = True
    title = "Expected Attention"
    menu = "Expected Attention (future queries' expected attention × ‖v‖)"
    colour = "#33BBEE"
    symbol = "hexagram"
    dash = "8px,2px"
    chunkable = True
    description = (
        "the attention future queries are expected to pay: mean and covariance of the context's "
        "(pre-RoPE) queries rotated over the next `horizon` positions, times the value norm"
    )
    paper = "Devoto et al. 2025, Expected Attention: KV-cache compression by estimating attention from future queries"
    kvpress = "ExpectedAttentionPress"

    def note(self, spec, trace=None) -> str | None:
        return (
            f"Expected Attention: the context queries' mean and covariance (before RoPE) rotated over the next "
            f"{spec.ea_horizon} positions give each key its expected attention, times its value norm; the "
            "first 4 tokens always rank first (kvpress)."
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        trace, layer, c, spec = ctx.trace, ctx.layer, ctx.n_context, ctx.spec
        d, g, Hkv = trace.head_dim, trace.group_size, trace.n_kv_heads
        # pre-RoPE, (Hq, d), (Hq, d, d)
        mu, cov = query_statistics(trace, layer, ctx.history_rows)
        inv_freq = rope_inv_freq(trace)
        if inv_freq is not None:
            R = mean_rotation(c, spec.ea_horizon, inv_freq)
            mu = mu @ R.T
            cov = R @ cov @ R.T
        first = EA_SINK if c > EA_SINK else 0
        expected = np.zeros((Hkv, c))
        args = (mu.reshape(Hkv, g, d), cov.reshape(Hkv, g, d, d) if spec.ea_covariance else None)
        # computed where the keys live (kvviz.decode.devtrace); only (Hkv, c) crosses
        on_device = getattr(trace.k, "expected_attention", None)
        expected[:, first:] = (
            on_device(layer, first, c, *args)
            if on_device is not None
            else expected_attention(trace.k[layer][:, first:c], *args)
        )
        scores_c = expected
        if trace.v is not None:
            # ||v_i||, in float64
            scores_c *= row_norms(trace.v, layer, c, float64=True)
        if first:
            scores_c[:, :first] = scores_c[:, first:].max() + 1.0
        scores = np.full((Hkv, ctx.n_positions), -np.inf)
        scores[:, :c] = scores_c
        return scores


def query_statistics(trace, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (Hq, d) and covariance / N (Hq, d, d) of the context queries `rows` before RoPE, leaving
    out the first EA_SINK; float64. They depend on the trace and layer alone (the horizon only
    rotates them), so they are cached there: a second horizon, or the other switch, reuses them."""

    def compute():
        r = rows[EA_SINK:] if len(rows) > EA_SINK + 1 else rows
        on_device = getattr(trace.q, "moments", None)  # where the queries live (kvviz.decode.devtrace)
        if on_device is not None:
            return on_device(layer, r, trace.query_positions[r], rope_inv_freq(trace))
        q = trace.q[layer]
        if len(r) and np.array_equal(r, np.arange(r[0], r[0] + len(r))):
            q = q[:, r[0] : r[0] + len(r)]  # a view: no gather
        else:
            q = q[:, r]
        inv_freq = rope_inv_freq(trace)
        if inv_freq is not None:  # back to pre-RoPE
            q = rotate(q.astype(np.float64), -trace.query_positions[r], inv_freq)
        # Centre on a float32 estimate of the mean (a BLAS sum), then correct by the mean of what is
        # left, which is small: the covariance of centred data is safe in float32 (one syrk per head).
        q = q.astype(np.float32, copy=False)
        H, N, d = q.shape
        ones = np.ones(N, dtype=np.float32)
        mu = np.empty((H, d))
        cov = np.empty((H, d, d))
        for h in range(H):
            rough = (ones @ q[h]) / np.float32(N)  # (d,) float32
            centred = q[h] - rough
            # the mean left over, small
            rest = (ones @ centred).astype(np.float64) / N
            mu[h] = rough + rest
            cov[h] = (centred.T @ centred).astype(np.float64) / N - np.outer(rest, rest)
        return mu, cov

    return cached_on_trace(trace, layer, "expected_attention/query-statistics", (), compute)


def expected_attention(keys: np.ndarray, mu: np.ndarray, cov: np.ndarray | None, chunk: int = 1024) -> np.ndarray:
    """softmax_i(mu . k_i / sqrt(d) + k_i^T S k_i / (2 d)) averaged over each KV group's query heads.

    keys (Hkv, n, d), mu (Hkv, g, d), cov (Hkv, g, d, d) or None (mean term only) -> (Hkv, n), float64.

    The logits are computed relative to the mean key kbar (a constant per head, which the softmax
    does not see): with delta_i = k_i - kbar,
        z_i - z(kbar) = w . delta_i + delta_i^T S delta_i / (2 d),   w = mu / sqrt(d) + S kbar / d.
    The linear term is float64; the quadratic one - the d x d product per key and head that costs
    the time - runs as one float32 BLAS product per KV group, K @ [S_1 .. S_g], on the centred keys:
    keys with large, nearly constant outlier channels then lose nothing to float32.
    """
    Hkv, n, d = keys.shape
    g = mu.shape[1]
    kbar = keys.mean(axis=1, keepdims=True, dtype=np.float64)  # (Hkv, 1, d)
    delta = keys - kbar  # (Hkv, n, d) float64
    w = mu / np.sqrt(d)  # (Hkv, g, d)
    if cov is not None:
        w = w + np.matmul(cov, kbar[:, None, 0, :, None])[..., 0] / d  # + S kbar / d
    z = np.matmul(delta, np.swapaxes(w, 1, 2))  # (Hkv, n, g) float64
    if cov is not None:
        delta32 = delta.astype(np.float32)
        stacked = np.swapaxes(cov, 1, 2).reshape(Hkv, d, g * d).astype(np.float32)  # [S_1 .. S_g]
        for start in range(0, n, chunk):
            part = delta32[:, start : start + chunk]  # (Hkv, m, d)
            y = np.matmul(part, stacked).reshape(Hkv, -1, g, d)  # (Hkv, m, g, d)
            # (Hkv, m, g): delta^T S delta
            quad = np.matmul(y, part[..., None])[..., 0]
            z[:, start : start + chunk] += quad * np.float32(0.5 / d)
    z -= z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z.mean(axis=2)
