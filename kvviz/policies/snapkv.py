"""SnapKV (Li et al. 2024): the last context queries vote for the tokens before them.

The observation window is the last `w` context queries (`observation_window(spec)`: the
recent window, capped at 64, unless set). Each query of the window votes with its
attention over the tokens before the window; the votes are averaged over the window,
smoothed by 1-D average pooling (kernel 5, stride 1, zero padding counted in the mean)
and averaged over the query heads of each KV group. The heavy budget goes to the
top-voted tokens before the window; the window itself is kept because it lies inside the
recent window (the spec refuses a window larger than the recent window). Tokens inside
the window have no vote, so they can never take a heavy slot. (kvpress: SnapKVPress,
window_size=64, kernel_size=5.)
"""

import numpy as np

from kvviz.attention import attention_sums
from kvviz.policies.base import Policy, ScoreContext
from kvviz.settings import Setting, declare, rule
from kvviz.spec import SpecError

MAX_WINDOW = 64  # the automatic window's cap (SnapKV's and kvpress's window_size)


def _odd(k: int) -> str | None:
    return None if k % 2 == 1 else f"the SnapKV pooling kernel must be an odd number >= 1, got {k}"


declare(
    Setting(
        "snapkv_window",
        "int",
        None,
        1,
        4096,
        url="snap_window",
        none_as=0,
        owner=("scorer", "snapkv"),
        label="SnapKV observation window (queries; 0 = auto)",
        help=f"The last context queries that vote. 0 = the recent window, capped at {MAX_WINDOW} (SnapKV's "
        "default). The window is kept, so it must fit inside the recent window.",
    ),
    Setting(
        "snapkv_kernel",
        "int",
        5,
        1,
        63,
        owner=("scorer", "snapkv"),
        valid=_odd,
        label="SnapKV pooling kernel (odd)",
        help="The votes are average-pooled over this many tokens (kvpress kernel_size 5).",
    ),
)


def observation_window(spec) -> int:
    """SnapKV's voters: the last this-many context queries. Always inside the recent window,
    so the window is kept and every heavy slot goes to a voted token before it."""
    if spec.snapkv_window is not None:
        return spec.snapkv_window
    return min(spec.recent, MAX_WINDOW)


@rule
def _window_inside_recent(spec) -> None:
    uses = spec.scorer == "snapkv" or (spec.scorer == "chunkkv" and spec.chunk_scorer == "snapkv")
    if not (uses and spec.evicts):
        return
    if spec.recent < 1:
        raise SpecError(
            "SnapKV needs a recent window of at least 1 token: its observation window (the last "
            "context queries, which vote) is always kept, as part of the recent window"
        )
    w = observation_window(spec)
    if w > spec.recent:
        raise SpecError(
            f"the SnapKV observation window ({w}) must fit inside the recent window ({spec.recent}): "
            f"the window is always kept. Raise the recent window to {w} or shrink the observation "
            "window"
        )


class SnapKV(Policy):
    name = "snapkv"
    head_separable = True
    order = 30
    featured = 4
    allocated_in_sweeps = True
    title = "SnapKV"
    menu = "SnapKV (observation window vote)"
    colour = "#117733"
    symbol = "diamond"
    dash = "dashdot"
    chunkable = True
    description = (
        "votes of the last context queries (the observation window, kept as part of the recent "
        "window), average-pooled; heavy slots go to the top-voted tokens before the window"
    )

    def note(self, spec, trace=None) -> str | None:
        if trace is None:
            return None
        c, w = trace.context_len, min(observation_window(spec), trace.context_len)
        return (
            f"SnapKV: the last {w} context queries (positions {c - w}–{c - 1}) are the observation window; "
            f"they vote with their attention, averaged and smoothed (pooling kernel {spec.snapkv_kernel}). "
            f"The window is kept as part of the recent window ({spec.recent} tokens); the {spec.heavy} heavy "
            f"hitters are the top-voted tokens before position {c - w}."
        )

    def score(self, ctx: ScoreContext) -> np.ndarray:
        c, spec = ctx.n_context, ctx.spec
        window_start = max(0, c - observation_window(spec))
        # no vote: never a heavy hitter
        scores = np.full((ctx.trace.n_kv_heads, ctx.n_positions), -np.inf)
        # the window covers the whole context: nothing before it to rank
        if window_start == 0:
            return scores
        rows = ctx.history_rows[ctx.trace.query_positions[ctx.history_rows] >= window_start]
        # (q_heads, c): the window's attention summed over its rows (on the cache's device where it lives)
        votes = attention_sums(ctx.trace, ctx.layer, np.arange(ctx.trace.n_q_heads), rows, c)
        votes /= max(len(rows), 1)
        # 1-D average pooling over the tokens before the window, kernel k, stride 1,
        # zero padding of k // 2 on each side counted in the mean.
        k = spec.snapkv_kernel
        padded = np.pad(votes[:, :window_start], ((0, 0), (k // 2, k // 2)))
        pooled = np.stack([np.convolve(row, np.full(k, 1.0 / k), mode="valid") for row in padded])
        scores[:, :window_start] = ctx.per_kv_head(pooled) / ctx.trace.group_size
        return scores

    def scores_follow_budget(self, spec) -> bool:
        return spec.snapkv_window is None  # the automatic window follows the recent window
