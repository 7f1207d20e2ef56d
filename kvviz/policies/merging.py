"""Merging instead of dropping (kvpress's MergingPress, after Token Merging and D2O): an evicted token's value
is folded into the kept token whose key is most like its own instead of being thrown away.

At a compression point each KV head keeps what its scorer says; then each evicted token e
    finds the kept token t nearest in key direction      s_e = max_t cos(k_e, k_t)
    with the weight                                      w_e = max(s_e, 0) · |v_e| / (|v_e| + |v_t|)
    and every kept token t that received some becomes    v_t <- (v_t + sum_e w_e v_e) / (1 + sum_e w_e)
Keys stay as they are (their RoPE phase stays right), so the attention weights over the kept tokens are
exactly those of dropping the same tokens: only the outputs o = a . V differ, and the cache holds the same
bytes. These are kvpress's defaults (similarity_threshold 0, merge_fraction 1).

When: once, at the compression point (a query inside the prompt reads a compression at itself, as its kept
masks do). Tokens a one-shot cache lets go later, as new ones arrive while decoding, are dropped: kvpress's
prefill press merges once too. So merging takes scorers that decide at a compression point, not those that
decide at every step (H2O, TOVA) or from each query (the oracle, Quest), and not compression during decoding.
"""

from __future__ import annotations

import numpy as np

from kvviz.settings import LABELS, Setting, declare, rule
from kvviz.spec import SpecError

EPS = 1e-6  # kvpress's, in the key norms and the weights' denominator


def merges(scorer: str) -> bool:
    """A scorer whose evicted values can be merged: it decides at the compression point."""
    from kvviz.policies.registry import POLICIES

    policy = POLICIES.get(scorer)
    return policy is not None and not policy.streaming and not policy.needs_query


declare(
    Setting(
        "merge",
        "bool",
        False,
        url="merge",
        owner=("scorer", merges),
        label="Merge evicted values into kept tokens",
        help="kvpress MergingPress: at the compression point each evicted token's value is folded into the "
        "kept token whose key is most similar (cosine), weighted by the similarity and the two values' "
        "norms. Keys are unchanged, so attention weights are those of dropping; the outputs differ (see "
        "the output error). Same memory.",
    )
)

LABELS["+merge"] = lambda spec: ", evicted values merged" if spec.merge else ""


@rule
def _merge_needs_a_compression_point(spec) -> None:
    if not spec.merge or not spec.evicts:
        return
    from kvviz.policies.registry import get_policy

    policy = get_policy(spec.scorer)
    if policy.streaming or policy.needs_query:
        how = "at every decode step" if policy.streaming else "from each query"
        raise SpecError(
            f"{policy.title or spec.scorer} decides {how}; merging folds what is evicted at one compression "
            "point into what is kept. Choose a one-shot scorer (SnapKV, K-norm, Expected Attention, ...) or "
            "turn merging off"
        )
    if spec.compress_every:
        raise SpecError(
            "Merging folds the prompt's evicted values into the kept ones once, at the compression point; "
            "with compression during decoding set compress every to 0, or turn merging off"
        )


def merge_weight(similarity: np.ndarray, evicted_norm: np.ndarray, target_norm: np.ndarray) -> np.ndarray:
    """How much of an evicted value goes into its target: the keys' cosine similarity (nothing when
    negative) times the evicted value's share of the two values' norms."""
    return np.maximum(similarity, 0.0) * evicted_norm / (evicted_norm + target_norm + EPS)


def fold_evicted(keys: np.ndarray, values: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """One KV head: keys, values (n, D) of its cache at the compression point, kept (n,) bool ->
    values (n, D) with every evicted token folded into its nearest kept token (the evicted rows unchanged)."""
    kept_at, evicted_at = np.flatnonzero(kept), np.flatnonzero(~kept)
    out = np.array(values)
    if not len(kept_at) or not len(evicted_at):
        return out
    k = keys.astype(np.float32)  # kvpress compares keys in float32
    unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), EPS)
    similarity = unit[evicted_at] @ unit[kept_at].T  # (evicted, kept)
    target = similarity.argmax(axis=1)  # (evicted,) into kept_at
    best = similarity[np.arange(len(evicted_at)), target]
    v = values.astype(np.float32)
    v_norm = np.linalg.norm(v, axis=-1)  # (n,)
    v_evicted = v_norm[evicted_at]
    weight = merge_weight(best, v_evicted, v_norm[kept_at][target])  # (evicted,)
    received = np.zeros((len(kept_at), v.shape[1]), np.float32)  # sum_e w_e v_e per kept token
    np.add.at(received, target, weight[:, None] * v[evicted_at])
    total = np.bincount(target, weights=weight, minlength=len(kept_at)).astype(np.float32)
    got = total > 0
    at = kept_at[got]
    out[at] = ((v[at] + received[got]) / (1.0 + total[got])[:, None]).astype(values.dtype)
    return out


def merged_values(keys: np.ndarray, values: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """A layer: keys, values (kv_heads, positions, D), kept (kv_heads, n) the kept mask at a compression
    point after n tokens -> the values (kv_heads, positions, D) the cache holds from then on: the first n
    positions of every head merged, the later ones as they come."""
    n = kept.shape[1]
    out = np.array(values)
    for g in range(kept.shape[0]):
        out[g, :n] = fold_evicted(keys[g, :n], values[g, :n], kept[g])
    return out


def merge_note(trace, spec) -> str | None:
    """The Explorer's note where merging is on: what it changes and what it does not."""
    if not (spec.merge and spec.evicts):
        return None
    if trace.v is None:
        return "Merging folds evicted values into kept ones, and this source has no values: nothing to show."
    return (
        "Evicted values are merged into the kept tokens with the most similar keys. Keys are unchanged, so the "
        "attention charts are those of dropping the same tokens; what merging changes is the output a · V "
        "(the Output error card; pin A with merging off to see the difference)."
    )
