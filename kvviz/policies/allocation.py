"""Budget allocation: how the heavy budget is spread over the KV heads and the layers.

A wrapper around any scorer: the scorer says how much each token matters, the allocation
says how many heavy hitters each (layer, KV head) cache may hold. Sinks and the recent
window stay per head, as always.

    uniform  every KV head of every layer keeps `heavy` heavy hitters (kvviz's default).
    adakv    AdaKV (Feng et al. 2024; kvpress AdaKVPress): one budget per layer,
             kv_heads * budget tokens, given to the top scores across all KV heads of the
             layer taken together (scores must be comparable across heads, e.g. attention),
             after a safeguard: each head first keeps its own top floor(alpha * budget) tokens
             (kvpress alpha_safeguard = 0.2, budget = sink + recent + heavy = kvpress's n_kept).
             As in kvpress, the safeguard ranks all of a head's tokens, and the sinks and the
             window rank first (kvpress pads SnapKV's window with max + 1), so it is spent on
             them before any heavy hitter: floor(alpha * budget) - (sinks + window) heavy
             hitters, if that is positive. `adakv_floor="outside-window"` (not kvpress's):
             floor(alpha * heavy) heavy hitters on top of sinks and window. Heads then hold
             different numbers of tokens: the caches are ragged.
    pyramid  PyramidKV (Cai et al. 2024; kvpress PyramidKVPress): per-layer totals falling
             linearly (`pyramid_budgets`). `pyramid_schedule="heavy"` (not kvpress's): the
             heavy part alone sloped from 2h - h/beta to h/beta, summing to n_layers * h.

AdaKV is decided once, at the compression point, from the compression-time scores (the
oracle: from each evaluated query's own attention); afterwards each head keeps its own
budget, as a real ragged cache would.

Each allocation is a small frozen dataclass (`Uniform`, `AdaKV`, `Pyramid`) whose fields are its
settings, built from a Spec by `allocation_for`; like kvpress's `AdaKVPress(press)` it wraps the
scorer: `keep_masks(policy, ctx, positions)` asks the policy for its scores and spreads the
budget. The policies never read the allocation themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from kvviz.policies.select import select
from kvviz.settings import LABELS, Setting, declare, rule
from kvviz.spec import SCORERS, STREAMING_SCORERS, Spec, SpecError


class Scorer(Protocol):
    """What an allocation needs of the policy it wraps (kvviz.policies.base.Policy; the base imports this
    module, so it is named by its shape here). ctx is a kvviz.policies.base.ScoreContext."""

    name: str
    streaming: bool

    def keep_masks(self, ctx: Any, positions: np.ndarray) -> np.ndarray: ...

    def scores_at_compression(self, ctx: Any) -> np.ndarray: ...


declare(
    Setting(
        "allocation",
        "choice",
        "uniform",
        choices=("uniform", "adakv", "pyramid"),
        label="Budget allocation",
        option_labels={
            "uniform": "uniform (every head the same)",
            "adakv": "AdaKV (per layer, across heads)",
            "pyramid": "PyramidKV (per layer, linear)",
        },
        help="Uniform: every KV head of every layer keeps `heavy` heavy hitters. AdaKV (Feng et al. 2024; "
        "kvpress AdaKVPress): one budget per layer, given to the top scores across all its KV heads, "
        "each head keeping at least α × budget — heads end up with different cache lengths. PyramidKV "
        "(Cai et al. 2024; kvpress PyramidKVPress): layer budgets falling linearly from the lowest layer "
        "to the highest, the same total.",
    ),
    Setting(
        "adakv_alpha",
        "float",
        0.2,
        0.0,
        1.0,
        url="ada_alpha",
        owner=("allocation", "adakv"),
        step=0.05,
        fmt="%.2f",
        label="AdaKV safeguard α (share of the budget each head keeps)",
        help="kvpress alpha_safeguard, 0.2 by default: each KV head keeps at least floor(α × budget) tokens.",
    ),
    Setting(
        "adakv_floor",
        "choice",
        "all",
        choices=("all", "outside-window"),
        owner=("allocation", "adakv"),
        label="AdaKV safeguard counts",
        option_labels={"all": "sinks and window first (kvpress)", "outside-window": "heavy hitters only"},
        help="all = each head's top α × budget tokens, sinks and window first (kvpress); outside-window = "
        "α × heavy heavy hitters beside them (a larger floor than kvpress's)",
    ),
    Setting(
        "pyramid_beta",
        "float",
        20.0,
        1.0,
        1e6,
        url="pyr_beta",
        owner=("allocation", "pyramid"),
        step=1.0,
        label="PyramidKV β (slope; 1 = flat)",
        help="Top layer heavy/β, bottom layer 2·heavy − heavy/β (kvpress β = 20; 1 = flat).",
    ),
    Setting(
        "pyramid_schedule",
        "choice",
        "kvpress",
        choices=("kvpress", "heavy"),
        owner=("allocation", "pyramid"),
        label="PyramidKV slopes",
        option_labels={"kvpress": "layer totals (kvpress)", "heavy": "the heavy part"},
        help="kvpress = layer totals as PyramidKVPress.get_layer_budget; heavy = the heavy part alone from "
        "2h - h/beta down to h/beta, same total (sinks and window equal in every layer)",
    ),
)
LABELS["allocation:adakv"] = lambda spec, scorer: f"adakv-{scorer} (alpha {spec.adakv_alpha:g})"
LABELS["allocation:pyramid"] = lambda spec, scorer: f"pyramid-{scorer} (beta {spec.pyramid_beta:g})"


@rule
def _adakv_needs_one_shot_scores(spec) -> None:
    if spec.allocation != "adakv" or not spec.evicts:
        return
    if spec.scorer in STREAMING_SCORERS:
        one_shot = [n for n in SCORERS if n not in STREAMING_SCORERS and n != "chunkkv"]
        raise SpecError(
            f"AdaKV spreads one layer budget over the KV heads once, at the compression point, from "
            f"one-shot scores (kvpress: a ScorerPress); {spec.scorer} decides again at every step. Use "
            f"{', '.join(one_shot)}, or allocation uniform / pyramid"
        )
    if spec.scorer == "chunkkv":
        raise SpecError(
            "ChunkKV keeps the same chunks in every KV head, so there is nothing for AdaKV to spread "
            "over heads: use allocation uniform or pyramid"
        )
    if spec.quantizes and (
        spec.key_format != "int" or spec.value_format != "int" or spec.rotate != "none" or spec.residual_mode != "kivi"
    ):
        raise SpecError(
            "AdaKV's per-head caches have different lengths; the FP8 / FP4 formats, rotation and HF's "
            "residual flush quantize a layer's heads together and need equal lengths. Use the integer "
            "format with AdaKV, or allocation uniform / pyramid with these formats"
        )


def kvpress_kept(budget: int) -> float:
    """kvpress's unrounded n(1 - ratio) for kvviz's budget of B tokens: a kvpress press keeps
    floor(n(1 - ratio)) = B at every ratio with n(1 - ratio) in [B, B + 1); PyramidKV's and ChunkKV's
    schedules use the unrounded value, and kvviz takes the middle of that range, B + 1/2 (the
    ratio 0.5 of an odd n, kvpress's usual setting, is exactly that)."""
    return budget + 0.5


def pyramid_budgets(heavy: int, n_layers: int, beta: float) -> np.ndarray:
    """The "heavy" schedule (not kvpress's): heavy budget of each layer (n_layers,) int, linear from
    the bottom, non-increasing, sum n_layers * heavy. Sinks and window stay as in the uniform spec."""
    if n_layers <= 1 or heavy == 0:
        return np.full(max(n_layers, 1), heavy, dtype=np.int64)[:n_layers]
    lo = heavy / beta
    hi = 2.0 * heavy - lo
    real = hi - np.arange(n_layers) * (hi - lo) / (n_layers - 1)
    out = np.floor(real + 1e-9).astype(np.int64)
    # 0 <= rest < n_layers, to the largest fractional parts
    rest = int(n_layers * heavy - out.sum())
    # (largest remainder keeps the budgets non-increasing: of two layers with the same floor the
    # lower one has the larger fraction)
    order = np.lexsort((np.arange(n_layers), -(real - out)))
    out[order[:rest]] += 1
    return out


def pyramid_totals(budget: int, window: int, n_context: int, n_layers: int, beta: float) -> np.ndarray | None:
    """kvpress PyramidKVPress.get_layer_budget: each layer's total kept tokens (n_layers,), or None
    where kvpress falls back to the uniform budget.

    With A = kvpress_kept(budget): from max = 2A - A/beta at the bottom to min = A/beta at the top;
    where max exceeds n - window it is clamped there and min = 2A - max (so a short prompt's top
    layer keeps its window alone); unless n >= max >= min >= window, uniform. Each layer
    round(max - layer * (max - min) / (L - 1)), Python's round as kvpress's (halves to even).
    """
    a = kvpress_kept(budget)
    lo = a / beta
    hi = a * 2 - lo
    if hi >= n_context - window:
        hi = n_context - window
        lo = a * 2 - hi
    if not (n_context >= hi >= lo >= window):
        return None
    steps = (hi - lo) / (n_layers - 1) if n_layers > 1 else 0.0
    return np.array([round(hi - layer * steps) for layer in range(n_layers)], dtype=np.int64)


def layer_spec(spec: Spec, layer: int, n_layers: int, n_context: int) -> Spec:
    """The spec one layer runs under (n_context: the tokens at the compression point, which kvpress's
    schedule depends on): the pyramid's budget for that layer, as a uniform spec; otherwise `spec`."""
    return allocation_for(spec).layer_spec(spec, layer, n_layers, n_context)


def candidates(n: int, spec: Spec) -> tuple[int, int]:
    """[first, end): the tokens of a row of n that compete for heavy slots (outside sinks and window)."""
    first = min(spec.sink, n)
    return first, max(first, n - spec.recent)


def select_heads(scores: np.ndarray, spec: Spec, heavy: np.ndarray) -> np.ndarray:
    """`select` with a heavy budget per KV head (H,): a ragged kept mask (H, n)."""

    heavy = np.asarray(heavy)
    if (heavy == heavy[0]).all():
        return select(scores, spec if spec.heavy == heavy[0] else spec.with_(heavy=int(heavy[0])))
    out = np.zeros(scores.shape, dtype=bool)
    for v in np.unique(heavy):
        rows = np.flatnonzero(heavy == v)
        out[rows] = select(scores[rows], spec.with_(heavy=int(v)))
    return out


def allocate(scores: np.ndarray, spec: Spec, layer: int, n_layers: int, n_context: int) -> np.ndarray:
    """Kept mask (H, n) of one layer from its scores under the spec's allocation."""
    return allocation_for(spec).select(scores, spec, layer, n_layers, n_context)


def adakv_heavy(scores: np.ndarray, spec: Spec) -> np.ndarray:
    """AdaKV's heavy budget per KV head (H,) from scores (H, n) of one layer, for an evicting AdaKV spec
    (`AdaKV.head_budgets`)."""
    return allocation_for(spec).head_budgets(scores, spec)


# --- the allocations, each a wrapper around the scorer ---------------------------------------


@dataclass(frozen=True)
class Uniform:
    """Every KV head of every layer keeps the spec's `heavy` heavy hitters."""

    name: ClassVar[str] = "uniform"
    # heads of a layer may hold different numbers of tokens (a ragged cache)
    ragged: ClassVar[bool] = False
    # layers may hold different numbers of tokens
    per_layer: ClassVar[bool] = False

    def layer_spec(self, spec: Spec, layer: int, n_layers: int, n_context: int) -> Spec:
        """The uniform spec this layer runs under."""
        return spec

    def select(self, scores: np.ndarray, spec: Spec, layer: int, n_layers: int, n_context: int) -> np.ndarray:
        """Kept mask (H, n) of one layer from its scores (H, n), as one decision (the oracle and Quest
        decide at every query through this)."""
        return select(scores, self.layer_spec(spec, layer, n_layers, n_context))

    def keep_masks(self, policy: Scorer, ctx: Any, positions: np.ndarray) -> np.ndarray:
        """Kept masks (len(positions), kv_heads, positions) of the policy under this allocation."""
        return policy.keep_masks(ctx, positions)


@dataclass(frozen=True)
class Pyramid(Uniform):
    """PyramidKV: each layer its own total, falling linearly with depth; then each layer as uniform."""

    name: ClassVar[str] = "pyramid"
    per_layer: ClassVar[bool] = True
    beta: float = 20.0
    schedule: str = "kvpress"

    def layer_spec(self, spec: Spec, layer: int, n_layers: int, n_context: int) -> Spec:
        if self.schedule == "heavy":
            heavy = int(pyramid_budgets(spec.heavy, n_layers, self.beta)[layer])
            return spec.with_(heavy=heavy, allocation="uniform")
        protected = spec.sink + spec.recent
        totals = pyramid_totals(spec.budget, protected, n_context, n_layers, self.beta)
        heavy = spec.heavy if totals is None else int(totals[layer]) - protected
        return spec.with_(heavy=heavy, allocation="uniform")

    def keep_masks(self, policy: Scorer, ctx: Any, positions: np.ndarray) -> np.ndarray:
        trace = ctx.trace
        spec = self.layer_spec(ctx.spec, ctx.layer, trace.n_layers, trace.context_len)
        return policy.keep_masks(type(ctx)(trace, ctx.layer, spec), positions)


@dataclass(frozen=True)
class AdaKV(Uniform):
    """AdaKV: one budget per layer spread over its KV heads by their scores, after a safeguard."""

    name: ClassVar[str] = "adakv"
    ragged: ClassVar[bool] = True
    alpha: float = 0.2
    floor: str = "all"

    def head_budgets(self, scores: np.ndarray, spec: Spec) -> np.ndarray:
        """AdaKV's heavy budget per KV head (H,) from scores (H, n) of one layer.

        Safeguard: each head's top floor(alpha * budget) tokens first, of which the sinks and window
        take the first slots (adakv_floor "all", kvpress), or floor(alpha * heavy) candidates
        ("outside-window"); then the rest of the layer's H * heavy slots to the best remaining
        candidates of any head. Ties: the earlier token, then the lower head (as `select` breaks ties
        within a head).
        """
        H, n = scores.shape
        first, end = candidates(n, spec)
        n_c = end - first
        take = min(spec.heavy, n_c)
        if take <= 0:
            return np.zeros(H, dtype=np.int64)
        # kvpress: int(n_kept * alpha), sinks and window ranked first
        if self.floor == "all":
            floor = min(max(0, int(min(spec.budget, n) * self.alpha) - (n - n_c)), take)
        else:
            floor = min(int(self.alpha * spec.heavy), take)
        s = np.nan_to_num(np.asarray(scores[:, first:end], dtype=np.float64), nan=-np.inf, posinf=np.finfo(float).max)
        # per head, best first, earlier on ties
        order = np.argsort(-s, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(n_c)[None, :].repeat(H, 0), axis=1)
        counts = np.full(H, floor, dtype=np.int64)
        rest = H * take - H * floor
        if rest > 0:
            free = rank >= floor  # not taken by the safeguard
            hs, ts = np.nonzero(free)
            # best score, then earlier token, lower head
            key = np.lexsort((hs, ts, -s[hs, ts]))
            chosen = hs[key[:rest]]
            counts += np.bincount(chosen, minlength=H)
        return counts

    def select(self, scores: np.ndarray, spec: Spec, layer: int, n_layers: int, n_context: int) -> np.ndarray:
        return select_heads(scores, spec, self.head_budgets(scores, spec))

    def keep_masks(self, policy: Scorer, ctx: Any, positions: np.ndarray) -> np.ndarray:
        """Head budgets fixed at the compression point from the policy's one-shot scores; each head then
        grows its own kept set under fixed scores."""
        trace, spec = ctx.trace, ctx.spec
        if policy.streaming:
            raise SpecError(f"AdaKV allocates once from one-shot scores; {policy.name} decides at every step")
        positions = np.asarray(positions)
        P, Hkv = trace.n_positions, trace.n_kv_heads
        out = np.zeros((len(positions), Hkv, P), dtype=bool)
        scores = np.broadcast_to(policy.scores_at_compression(ctx), (Hkv, P))
        heavy = self.head_budgets(scores[:, : trace.context_len], spec)
        for i, p in enumerate(positions):
            out[i, :, : p + 1] = select_heads(scores[:, : p + 1], spec, heavy)
        return out


ALLOCATIONS: dict[str, type[Uniform]] = {a.name: a for a in (Uniform, AdaKV, Pyramid)}


def allocation_for(spec: Spec) -> Uniform:
    """The spec's allocation with its settings (uniform where nothing is evicted: every head keeps all)."""
    if not spec.evicts:
        return Uniform()
    if spec.allocation == "adakv":
        return AdaKV(spec.adakv_alpha, spec.adakv_floor)
    if spec.allocation == "pyramid":
        return Pyramid(spec.pyramid_beta, spec.pyramid_schedule)
    return Uniform()
