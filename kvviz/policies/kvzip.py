"""KVzip (Kim et al. 2025): keep the tokens the model needs to repeat its context, query-agnostic.

Each token's score is the most attention the model pays it while repeating the context after "Repeat the
previous context exactly." (kvviz.decode.reconstruct: a forward pass of its own, which the real-model runs
make before the compression point and hand over in the prompt's trace as `meta["kvzip_scores"]`). One budget
for the whole cache, as kvpress's
KVzipPress spends it: the lowest-scored tokens of every layer and KV head together are dropped until the
cache holds `budget` tokens a head on average, so each head of each layer keeps its own number. The first
`sink` tokens (kvpress's n_sink 4) always stay, and the last `recent` tokens of the prompt with them;
the heavy split of the budget does not matter, only its total. Tokens generated after the prompt all stay
(kvpress compresses the prompt only).

A source without the model (the handbook example, a synthetic pattern, a trace captured without the pass)
cannot give KVzip's scores: choosing KVzip there says so. A capture with KVzip's pass (`kvviz capture
--kvzip`, the Real model source's box) keeps the scores of every layer in the trace's meta.
"""

from __future__ import annotations

import numpy as np

from kvviz.policies.allocation import kvpress_kept
from kvviz.policies.base import Policy, ScoreContext, cached_on_trace
from kvviz.spec import SpecError

META = "kvzip_scores"


def reconstruction_scores(trace) -> np.ndarray:
    """(layers, kv_heads, context) the KVzip scores of every layer of the model, or a SpecError saying how to
    get them. A trace of some of the model's layers carries the scores of all of them (the global cut is over
    the whole cache); `layer_rows` says which row is which of the trace's layers."""
    scores = trace.meta.get(META) if trace.meta else None
    if scores is None:
        raise SpecError(
            "KVzip scores each token by the attention the model pays it while repeating the context, a forward "
            "pass of the model itself, which this source has not run. The real-model runs make it: the Model "
            "lab, kvviz eval, the needle test, the leaderboard, and a capture with KVzip's pass (the Real model "
            "source's 'KVzip's pass' box, kvviz capture --kvzip)"
        )
    scores = np.asarray(scores, dtype=np.float64)
    rows = layer_rows(trace, scores)
    if scores.ndim != 3 or rows is None or scores.shape[1:] != (trace.n_kv_heads, trace.context_len):
        raise SpecError(
            f"the trace's KVzip scores have shape {scores.shape}, not (layers, {trace.n_kv_heads}, {trace.context_len})"
        )
    return scores


def layer_rows(trace, scores: np.ndarray) -> list[int] | None:
    """The row of `scores` each of the trace's layers reads: the same index where there is a row per layer,
    the layer's number in the model where the scores are the whole model's; None where neither fits."""
    if scores.shape[0] == trace.n_layers:
        return list(range(trace.n_layers))
    numbers = list(trace.layer_numbers)
    return numbers if max(numbers) < scores.shape[0] else None


def kept_everywhere(scores: np.ndarray, spec) -> np.ndarray:
    """(layers, kv_heads, c) bool: kvpress's global cut. Sinks score max + 1; the lowest
    int(layers * heads * (c - A)) scores of all layers and heads go, A = kvpress's n(1 - ratio) for the budget."""
    L, H, c = scores.shape
    s = scores.copy()
    s[..., : min(spec.sink, c)] = s.max() + 1.0
    s[..., max(0, c - spec.recent) :] = np.inf  # the prompt's last tokens stay (a window of at least one)
    pruned = min(max(int(L * H * (c - kvpress_kept(spec.budget))), 0), s.size)
    keep = np.ones(s.size, dtype=bool)
    keep[np.argsort(s, axis=None, kind="stable")[:pruned]] = False
    return keep.reshape(L, H, c)


class KVzip(Policy):
    name = "kvzip"
    order = 130
    title = "KVzip"
    menu = "KVzip (what the model needs to repeat the context)"
    colour = "#982FC8"
    symbol = "octagon"
    dash = "3px,1px,1px,1px"
    ragged = True
    reconstructs = True
    description = (
        "scores each token by the attention the model pays it while repeating the context (its own forward "
        "pass); one budget for the whole cache, spent on the best-scored tokens of any layer and head"
    )
    paper = "Kim et al. 2025, KVzip: query-agnostic KV cache compression with context reconstruction"
    kvpress = "KVzipPress(compression_ratio=..., n_sink=4)"

    def note(self, spec, trace=None) -> str | None:
        return (
            f"KVzip: the model repeated the context once more; each token scores the most attention the repeat "
            f"paid it. The {spec.budget}-token budget is spent over all layers and heads at once (each head keeps "
            f"its own count), the {spec.sink} sinks and the last {spec.recent} prompt tokens always kept."
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        """(kv_heads, positions): +inf where the global cut keeps a prompt token (and for every later token),
        the reconstruction score where it drops one."""
        trace, c = ctx.trace, ctx.n_context
        scores = reconstruction_scores(trace)
        row = layer_rows(trace, scores)[ctx.layer]
        keep = cached_on_trace(
            trace,
            -1,
            "kvzip/kept",
            (ctx.spec.sink, ctx.spec.recent, ctx.spec.budget),
            lambda: kept_everywhere(scores, ctx.spec),
        )[row]
        out = np.full((trace.n_kv_heads, ctx.n_positions), np.inf)
        out[:, :c] = np.where(keep, np.inf, scores[row])
        return out

    def arrival_score(self, key, layer, position, spec):
        return np.full(key.shape[0], np.inf)

    def compression_kept(self, scores: np.ndarray, spec) -> np.ndarray:
        return np.isposinf(scores)

    def head_caps(self, scores: np.ndarray, spec) -> np.ndarray:
        return np.full(scores.shape[0], np.inf)
