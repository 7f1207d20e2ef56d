"""DuoAttention (Xiao et al. 2024): retrieval heads keep the whole cache, streaming heads keep sinks + window.

Not a budget per head but a kind of budget per head. Every KV head of every layer gets a score; the
`Spec.duo_streaming` share of all heads with the lowest scores become streaming heads (sinks + the recent
window, as StreamingLLM), the rest retrieval heads (every token).

The head scores are kvpress's on-the-fly estimate (`DuoAttentionPress(on_the_fly_scoring=True)`, which
kvviz computes from the prompt it traced instead of 50 BookSum chapters): per layer, the mean query and the
mean key before RoPE; the mean key placed at positions 0..499 and the mean query at 499, rotated; the
query's attention over those 500 keys; the score is the area under its cumulative curve (mean of the
cumulative sum), averaged over the query group. A head whose attention lies on recent positions scores
low. A trace without RoPE has no positions to rotate: there the same area is measured on the context's
last query's own attention.

The paper's streaming heads keep sinks + window while decoding (their cache stays the same size); kvpress
0.5.5 compresses the prompt only. kvviz follows the paper after the prompt: a streaming head drops its
oldest token past sinks and window as each new one arrives.
"""

from __future__ import annotations

import numpy as np

from kvviz.attention import softmax
from kvviz.policies.base import Policy, ScoreContext, cached_on_trace
from kvviz.policies.select import keep_sinks_and_window
from kvviz.policies.expected_attention import rope_inv_freq, rotate
from kvviz.settings import LABELS, Setting, declare

DUO_POSITIONS = 500  # kvpress's q_len: the positions the mean key is spread over

declare(
    Setting(
        "duo_streaming",
        "float",
        0.5,
        0.0,
        1.0,
        url="duo",
        owner=("scorer", "duo_attention"),
        step=0.05,
        label="DuoAttention: share of streaming heads",
        help="DuoAttention: the share of all KV heads (every layer) that keep only the sinks and the recent "
        "window; the others keep every token (kvpress head_compression_ratio).",
    )
)
LABELS["duo_attention"] = lambda spec: f"duo_attention ({spec.duo_streaming:.0%} streaming heads)"


def _prerope_mean(stack, layer: int, rows: np.ndarray, positions: np.ndarray, inv_freq) -> np.ndarray:
    """(heads, d): the mean of a layer's queries or keys `rows` (at `positions`), back before RoPE."""
    on_device = getattr(stack, "moments", None)  # where the stack lives (kvviz.decode.devtrace)
    if on_device is not None:
        return on_device(layer, rows, positions, inv_freq)[0]
    x = rotate(np.asarray(stack[layer][:, rows], dtype=np.float64), -positions, inv_freq)
    return x.mean(axis=1)


def layer_head_scores(trace, layer: int) -> np.ndarray:
    """(kv_heads,): the area under each head's cumulative attention curve (module docstring)."""
    c, g, d = trace.context_len, trace.group_size, trace.head_dim
    inv_freq = rope_inv_freq(trace)
    if inv_freq is None:  # no RoPE: the last context query's own attention
        row = int(np.flatnonzero(trace.query_positions == c - 1)[0])
        q = np.asarray(trace.q[layer][:, row], dtype=np.float64)  # (Hq, d)
        keys = np.repeat(np.asarray(trace.k[layer][:, :c], dtype=np.float64), g, axis=0)  # (Hq, c, d)
    else:
        rows, context = trace.context_queries, np.arange(c)
        mean_q = _prerope_mean(trace.q, layer, rows, trace.query_positions[rows], inv_freq)  # (Hq, d)
        mean_k = _prerope_mean(trace.k, layer, context, context, inv_freq)  # (Hkv, d)
        spread = np.arange(DUO_POSITIONS)
        q = rotate(mean_q[:, None, :], spread[-1:], inv_freq)[:, 0]  # (Hq, d) at the last position
        keys = np.repeat(rotate(np.repeat(mean_k[:, None, :], DUO_POSITIONS, 1), spread, inv_freq), g, axis=0)
    attention = softmax(np.einsum("hd,hnd->hn", q, keys) / np.sqrt(d))  # (Hq, n)
    area = np.cumsum(attention, axis=1).mean(axis=1)  # (Hq,)
    return area.reshape(-1, g).mean(axis=1)


def head_scores(trace) -> np.ndarray:
    """(layers, kv_heads) DuoAttention's head scores, cached on the trace."""
    return cached_on_trace(
        trace,
        -1,
        "duo_attention/head-scores",
        (),
        lambda: np.stack([layer_head_scores(trace, layer) for layer in range(trace.n_layers)]),
    )


def streaming_heads(scores: np.ndarray, share: float) -> np.ndarray:
    """(layers, kv_heads) bool: the round(share * heads) lowest-scoring heads of all layers (kvpress's split)."""
    n = round(scores.size * share)
    mask = np.zeros(scores.size, dtype=bool)
    mask[np.argsort(scores, axis=None, kind="stable")[:n]] = True
    return mask.reshape(scores.shape)


class DuoAttention(Policy):
    name = "duo_attention"
    order = 120
    title = "DuoAttention"
    menu = "DuoAttention (retrieval heads keep all, streaming heads sinks + window)"
    colour = "#4A0149"
    symbol = "star-square"
    dash = "10px,2px,2px,2px"
    ragged = True
    description = (
        "a kind of budget per head: retrieval heads keep every token, streaming heads (the share with the "
        "most local attention) keep the sinks and the recent window"
    )
    paper = "Xiao et al. 2024, DuoAttention: efficient long-context LLM inference with retrieval and streaming heads"
    kvpress = "DuoAttentionPress(head_compression_ratio=..., on_the_fly_scoring=True)"

    def note(self, spec, trace=None) -> str | None:
        return (
            f"DuoAttention: {spec.duo_streaming:.0%} of the KV heads (over all layers, those whose attention "
            f"lies most on recent tokens) keep only the {spec.sink} sinks and the {spec.recent}-token window; the "
            "others keep every token. The heavy-hitter budget is not used."
        )

    def fit_budget(self, spec, budget: int, n: int):
        """The streaming share that keeps `budget` of `n` tokens on average: a retrieval head keeps n, a
        streaming head sinks + window, so n - share * (n - sinks - window) = budget."""
        protected = min(n, spec.sink + spec.recent)
        share = 1.0 if n <= protected else (n - budget) / (n - protected)
        return spec.with_(duo_streaming=float(np.clip(share, 0.0, 1.0)))

    def score(self, ctx: ScoreContext) -> np.ndarray:
        """(kv_heads, positions): +inf on every position for a retrieval head; the position for a
        streaming head (StreamingLLM's order: sinks, then the most recent)."""
        streaming = streaming_heads(head_scores(ctx.trace), ctx.spec.duo_streaming)[ctx.layer]
        recency = np.arange(ctx.n_positions, dtype=np.float64)
        return np.where(streaming[:, None], recency[None, :], np.inf)

    def arrival_score(self, key, layer, position, spec):
        return np.full(key.shape[0], float(position))

    def compression_kept(self, scores: np.ndarray, spec) -> np.ndarray:
        """(H, c): every token in a retrieval head, sinks and window in a streaming head."""
        return keep_sinks_and_window(np.isposinf(scores), spec)

    def head_caps(self, scores: np.ndarray, spec) -> np.ndarray:
        retrieval = np.isposinf(scores).all(axis=1)
        return np.where(retrieval, np.inf, spec.sink + spec.recent)
