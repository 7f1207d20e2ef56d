"""Sweep speed: `kvviz sweep` over every scorer x 6 budgets x 4 bit widths vs the bare attention work.

Trace: the engine benchmark's, synthetic, 4 layers x 8 query heads (2 KV heads) x 4096 context
tokens x 32 later steps x head dim 64. The sweep: every built-in scorer that can score a synthetic trace
(all but KVzip, which reads the model's own pass) at budgets of 5, 10, 20,
30, 50 and 75% of the tokens (all evicting: no "full" point), 16 / 8 / 4 / 2-bit K/V, error bars
over the 8 heads of one layer — kvviz.sweep.sweep, as `kvviz sweep` runs it; cold (the score
cache is cleared before each run).

Bare work, timed in the same run with benchmarks/engine.py's numpy attention: what the sweep
has to compute at the least. Each scorer's compression-time attention rows once (the whole
context for h2o, the SnapKV window for snapkv and chunkkv, the last context query for tova:
a scorer's compression-time scores do not depend on the budget or the bits, and kvviz caches
them), plus, for every configuration, the evaluated query of the 8 heads and the later queries
a streaming scorer reads step by step. Printed: total time, the bare time, the ratio
total / bare, and the ratio to configurations x one evaluated row set; exits 1 when the ratio
misses its target.

    python benchmarks/sweep.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import exit_status  # noqa: E402
from engine import LAYER, bare_attention, benchmark_trace, best_of  # noqa: E402  (benchmarks/engine.py)

from kvviz import View  # noqa: E402
from kvviz.analysis.sweep import sweep  # noqa: E402
from kvviz.spec import SCORERS, SpecError  # noqa: E402

FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75)
BITS = (16, 8, 4, 2)
TARGET = 3.0  # the sweep at most 3x the bare attention work it needs, as every single configuration


def compression_rows(trace, scorer, window=64):
    """The context rows a scorer reads at the compression point (once per sweep: cached scores)."""
    c = trace.context_len
    if scorer == "h2o":
        return [(trace.context_queries, c)]
    if scorer == "tova":
        return [(trace.context_queries[-1:], c)]
    if scorer in ("snapkv", "chunkkv"):  # chunkkv: SnapKV's votes, its default token scorer
        return [(trace.context_queries[-window:], c)]
    return []


def configuration_rows(trace, scorer):
    """The rows every configuration reads: the evaluated query, and a streaming scorer's later queries."""
    needs = [(trace.evaluated_queries[-1:], trace.n_positions)]
    if scorer in ("h2o", "tova"):
        needs.append((trace.later_queries, trace.n_positions))
    return needs


def scorers_for(trace, view) -> list[str]:
    """The scorers that can score this trace: KVzip reads the scores of the model's repeat-the-context pass,
    which a synthetic trace has not run."""
    usable = []
    for scorer in SCORERS:
        try:
            sweep(trace, [scorer], FRACTIONS[:1], BITS[:1], view)
            usable.append(scorer)
        except SpecError as e:
            print(f"{scorer}: not swept ({str(e).split(',')[0]})")
    return usable


def main() -> int:
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
    print("BLAS: 1 thread for both the sweep and the bare attention work")
    trace = benchmark_trace()
    view = View(layer=LAYER, ensemble="heads", ensemble_size=8)
    scorers = scorers_for(trace, view)
    n_configs = len(scorers) * len(FRACTIONS) * len(BITS)
    print(f"trace: {trace.describe()}")
    print(
        f"sweep: {len(scorers)} scorers x {len(FRACTIONS)} budgets x {len(BITS)} bit widths = {n_configs} "
        f"configurations, error bars over 8 heads"
    )

    def run():
        rows = sweep(trace, scorers, FRACTIONS, BITS, view)
        assert len(rows) == n_configs, len(rows)

    def bare():
        for scorer in scorers:
            bare_attention(trace, compression_rows(trace, scorer))
            for _ in range(len(FRACTIONS) * len(BITS)):
                bare_attention(trace, configuration_rows(trace, scorer))

    def one_row_set():
        bare_attention(trace, [(trace.evaluated_queries[-1:], trace.n_positions)])

    total, base, row = float("inf"), float("inf"), float("inf")
    for _ in range(3):  # pairs back to back, so load on a shared machine hits both alike
        total = min(total, best_of(run, 1))
        base = min(base, best_of(bare, 1))
    for _ in range(200):
        row = min(row, best_of(one_row_set, 1))
    ratio = total / base
    print(f"sweep: total {total * 1e3:.0f} ms, bare {base * 1e3:.0f} ms, ratio {ratio:.2f}")
    print(
        f"per configuration: {total / n_configs * 1e3:.2f} ms = {total / (n_configs * row):.2f} x one evaluated "
        f"row set ({row * 1e3:.2f} ms: the 8 heads' attention of the last query)"
    )
    return exit_status(f"worst ratio {ratio:.2f}", ratio, TARGET)


if __name__ == "__main__":
    sys.exit(main())
