"""Ask for a target, not a slider position: the smallest cache that meets it.

    smallest B such that metric(split(B)) meets the target, and metric(split(B - 1)) does not

where split(B) is the sweep's split rule (`kvviz.analysis.sweep.split_budget`: up to 4 sinks, at
least one recent token, the rest half recent window, half heavy hitters; StreamingLLM
puts it all in the window) and the metric is the evaluated row's attention mass retained
(>= target) or TV distance (<= target), with the spec's quantizer applied to what is kept.

For one-shot policies the kept sets of growing budgets are nested (a token enters the
recent window or one more heavy slot opens), so the mass retained grows with B and the
binary search finds the exact smallest budget. Streaming policies (H2O, TOVA), SnapKV with
its window following the recent window, one-shot scorers compressed again during decoding (`compress_every`)
and TV under quantization need not be monotone; the search then walks down from the binary
search's answer until one token less misses the target, so the answer always satisfies
"one token less misses", and `exact` says whether it is also the global smallest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvviz.engine import Comparison, check_view, compare
from kvviz.limits import checkpoint
from kvviz.policies import get_policy
from kvviz.spec import Spec, SpecError, View
from kvviz.analysis.sweep import split_budget
from kvviz.trace import Trace

SPLIT_RULE = (
    "up to 4 sinks (at least one recent token), then half recent window and half heavy hitters "
    "(StreamingLLM: all recent window)"
)


@dataclass(frozen=True)
class Solution:
    budget: int
    spec: Spec
    value: float  # the metric reached at `budget`
    below: float | None  # the metric one token less (None at budget 1)
    metric: str  # "mass_retained" or "tv_distance"
    target: float
    tokens: int  # tokens the evaluated query sees
    exact: bool  # the global smallest (monotone case), not only "one less misses"
    evaluations: int
    comparison: Comparison

    def as_dict(self) -> dict:
        m = self.comparison.metrics
        return {
            "budget": self.budget,
            "sink": self.spec.sink,
            "recent": self.spec.recent,
            "heavy": self.spec.heavy,
            "scorer": self.spec.scorer,
            "key_bits": self.spec.key_bits,
            "value_bits": self.spec.value_bits,
            "metric": self.metric,
            "target": self.target,
            "reached": self.value,
            "one_token_less": self.below,
            "mass_retained": m["mass_retained"],
            "tv_distance": m["tv_distance"],
            "kl": m["kl"],
            "memory_ratio": m["memory_ratio"],
            "tokens": self.tokens,
            "exact": self.exact,
            "split_rule": SPLIT_RULE,
        }


def _smallest(meets: Callable[[int], bool], n: int) -> int:
    """The smallest budget in 1..n that meets the target (n does): bisection, then down one token at a time
    while one token less still meets it (the non-monotone cases: one token less must miss)."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    b = hi
    while b > 1 and meets(b - 1):
        b -= 1
    return b


def _nested(policy, base: Spec, metric: str) -> bool:
    """Are the kept sets nested in the budget, so that the bisection is exact? One-shot scores that do not
    depend on the budget (SnapKV's automatic window follows the recent window), a metric set by the kept set
    alone, and no compression during decoding (each budget would hold its own sets)."""
    return (
        not policy.streaming
        and not policy.scores_follow_budget(base)
        and (metric == "mass_retained" or not base.quantizes)
        and not base.compress_every
    )


def solve(
    trace: Trace,
    base: Spec = Spec(),
    view: View = View(),
    target_mass: float | None = None,
    target_tv: float | None = None,
    max_sink: int = 4,
    progress: Callable[[float, str], None] | None = None,
) -> Solution:
    """The smallest budget meeting the target with base's scorer and quantizer (see the module doc)."""
    if (target_mass is None) == (target_tv is None):
        raise SpecError("give exactly one target: a mass to keep (0-1) or a TV distance to stay under (0-1)")
    metric, target = ("mass_retained", target_mass) if target_mass is not None else ("tv_distance", target_tv)
    if not 0 < target <= 1 or target != target:
        raise SpecError(f"the target is a share between 0 and 1, got {target}")
    policy = get_policy(base.scorer)
    if policy.ragged:
        raise SpecError(
            f"{policy.title or base.scorer} keeps each head's own number of tokens by its own rule, not a budget: "
            "the solver searches budgets. Move the method's own setting (under Advanced) and read the memory card"
        )
    # one row: what the cards show
    view = View(layer=view.layer, head=view.head, step=view.step)
    n = int(trace.query_positions[check_view(trace, view)]) + 1
    results: dict[int, Comparison] = {}

    def evaluate(b: int) -> Comparison:
        checkpoint()
        if b not in results:
            spec = base.with_(**split_budget(base.scorer, b, max_sink))
            results[b] = compare(trace, spec, view)
            if progress is not None:
                progress(min(0.95, len(results) / (2 * max(n.bit_length(), 1))), f"budget {b} of {n} tokens")
        return results[b]

    def value(b: int) -> float:
        return float(evaluate(b).metrics[metric])

    def meets(b: int) -> bool:
        return value(b) >= target if metric == "mass_retained" else value(b) <= target

    if not meets(n):
        what = "attention mass" if metric == "mass_retained" else "TV distance"
        raise SpecError(
            f"even keeping all {n} tokens the {what} is {value(n):.4f} with "
            f"{base.key_bits}/{base.value_bits}-bit keys/values: raise the bits or relax the target"
        )
    b = _smallest(meets, n)
    comp = evaluate(b)
    return Solution(
        budget=b,
        spec=comp.spec,
        value=value(b),
        below=value(b - 1) if b > 1 else None,
        metric=metric,
        target=target,
        tokens=n,
        exact=_nested(policy, base, metric),
        evaluations=len(results),
        comparison=comp,
    )
