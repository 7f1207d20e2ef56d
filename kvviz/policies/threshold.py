"""Threshold eviction (kvpress's DMSPress, the rule of DMS and KVzap): keep each token whose score passes a
threshold, so that the budget is whatever the scores leave.

An inner token scorer (`Spec.threshold_scorer`: SnapKV's votes by default, any one-shot token scorer) scores
the context. At the compression point each KV head keeps
    the tokens scoring at least `Spec.threshold` (in the inner scorer's own units: SnapKV's are the
    attention the observation window pays a token, averaged over the window and the query group),
    the recent window (kvpress's `sliding_window_size`, protected from eviction) and the sinks.
Nothing caps the count: each head of each layer keeps its own number of tokens, and the memory card counts
what the heads hold. The heavy-hitter budget is not used.

After the compression point every arriving token joins the cache, as kvpress's DMSPress(decoding=False)
compresses the prompt only.
"""

from __future__ import annotations

import numpy as np

from kvviz.policies.base import Policy, ScoreContext
from kvviz.policies.select import keep_sinks_and_window
from kvviz.policies.chunkkv import inner_scorers  # the one-shot token scorers (`chunkable`)
from kvviz.settings import LABELS, Setting, declare, rule
from kvviz.spec import SpecError


declare(
    Setting(
        "threshold",
        "float",
        0.01,
        -1000.0,
        1000.0,
        url="thr",
        owner=("scorer", "threshold"),
        step=0.001,
        label="Threshold (keep scores at least this)",
        help="Threshold eviction: a token outside the sinks and the recent window stays if its inner score is "
        "at least this (in the inner scorer's units; SnapKV's: the attention the observation window pays "
        "it, 0.01 = one percent).",
    ),
    Setting(
        "threshold_scorer",
        "choice",
        "snapkv",
        choices=inner_scorers,
        url="thr_scorer",
        owner=("scorer", "threshold"),
        label="Threshold: token scorer",
        help="Threshold eviction: the token scorer whose scores the threshold cuts.",
    ),
)
# (kept share, threshold x n): SnapKV-vote thresholds measured on the bundled model's 256-token needle prompts
# (4 sinks, the sweep's window of half the budget) to keep about that share of the prompt; a run reports the
# share it reached
LEVELS = ((0.125, 1.0), (0.25, 0.75), (0.5, 0.5), (0.75, 0.25))
LABELS["threshold"] = lambda spec: f"threshold ({spec.threshold_scorer} ≥ {spec.threshold:g})"


@rule
def _snapkv_votes_need_a_window(spec) -> None:
    if spec.scorer == "threshold" and spec.threshold_scorer == "snapkv" and spec.evicts and spec.recent < 1:
        raise SpecError(
            "Threshold eviction over SnapKV's votes needs a recent window of at least 1 token: the observation "
            "window (the last context queries, which vote) is kept as part of it"
        )


class Threshold(Policy):
    name = "threshold"
    order = 110
    title = "Threshold (DMS)"
    short = "Threshold"
    menu = "Threshold (keep what scores above a threshold)"
    colour = "#1C2FFD"
    symbol = "star-triangle-up"
    dash = "2px,2px"
    ragged = True
    description = (
        "keeps every token whose score (an inner scorer, SnapKV's votes by default) passes a threshold, beside "
        "the sinks and the recent window: the budget varies by head, layer and prompt"
    )
    paper = "Łańcucki et al. 2025, Inference-time hyper-scaling with KV cache compression (DMS)"
    kvpress = "DMSPress(press=SnapKVPress(), threshold=..., sliding_window_size=...)"

    def note(self, spec, trace=None) -> str | None:
        return (
            f"Threshold: each KV head keeps the tokens whose {spec.threshold_scorer} score is at least "
            f"{spec.threshold:g}, beside the sinks and the recent window; the heavy-hitter budget is not used, "
            "and every head ends up with its own count (the memory card counts what they hold)."
        )

    def fit_budget(self, spec, budget: int, n: int):
        """For SnapKV's votes: the threshold LEVELS / n (n = the prompt's tokens; 1 / n is what a token gets
        under even attention) at the kept share budget / n, interpolated. Other inner scorers: as set."""
        if spec.threshold_scorer != "snapkv" or n <= 0:
            return spec
        kept, level = zip(*LEVELS)
        return spec.with_(threshold=float(np.interp(budget / n, kept, level)) / n)

    def score(self, ctx: ScoreContext) -> np.ndarray:
        from kvviz.policies.registry import get_policy

        inner = get_policy(ctx.spec.threshold_scorer)
        token = np.broadcast_to(inner.scores_at_compression(ctx), (ctx.trace.n_kv_heads, ctx.n_positions))
        scores = np.full((ctx.trace.n_kv_heads, ctx.n_positions), np.inf)  # arrivals: kept
        scores[:, : ctx.n_context] = token[:, : ctx.n_context]
        return scores

    def arrival_score(self, key, layer, position, spec):
        return np.full(key.shape[0], np.inf)

    def compression_kept(self, scores: np.ndarray, spec) -> np.ndarray:
        """(H, c): the tokens that pass, the sinks and the recent window."""
        return keep_sinks_and_window(scores >= spec.threshold, spec)

    def head_caps(self, scores: np.ndarray, spec) -> np.ndarray:
        return np.full(scores.shape[0], np.inf)  # every arrival stays
