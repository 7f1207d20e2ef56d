#!/usr/bin/env python3
"""Why Quest keeps less attention mass than the one-shot scorers, in numbers.

Notebook-style: each section prints one table. The trace is scripts/allocation_table.py's: the
bundled SmolLM2-135M reads kvviz's sample text teacher-forced, prompt 206 tokens, 57 decode
steps; mass = the attention a query head puts on what it reads, averaged over 30 layers x 9
query heads x 57 steps. Budget = a fraction of the tokens the last step sees, split as every
sweep splits it (4 sinks, the rest half recent window, half heavy: for Quest, whole pages).

Columns, for each setting:
    quest         Quest per query head (the paper): its own top pages by the bound
    page-oracle   the same pages' granularity, ranked by the true attention in each page (what a
                  perfect bound would pick): quest vs page-oracle = the cost of the bound,
                  page-oracle vs token-oracle = the cost of reading whole pages
    token-oracle  top tokens of this query head's own attention at the same budget (page size 1
                  of the page-oracle)
    read          tokens a KV head reads per step for Quest (the union of its 3 query heads'
                  pages; the bytes the ledger counts), and
    oracle@read   kvviz's oracle (one kept set per KV head, top-k of the group's attention) given
                  that many tokens: the bound at the same bytes read

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/quest_mass.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvviz
sys.path.insert(0, str(Path(__file__).resolve().parent))  # allocation_table's trace

import numpy as np

PAGE_SIZES = (1, 4, 16, 64)
BUDGETS = (0.1, 0.25, 0.5)


def page_oracle(attention: np.ndarray, spec) -> np.ndarray:
    """(Hq, n) reads: sinks + window + the pages with the most true attention, by Quest's own page rule."""
    from kvviz.policies.select import select

    Hq, n = attention.shape
    size = spec.page_size
    pad = -(-n // size) * size - n
    per_page = np.pad(attention, ((0, 0), (0, pad))).reshape(Hq, -1, size).sum(axis=2)
    return select(np.repeat(per_page, size, axis=1)[:, :n], spec)


def measure(trace, budget_fraction: float, page_size: int) -> dict:
    from kvviz.analysis.sweep import split_budget
    from kvviz.attention import logit_rows, softmax
    from kvviz.engine import read_masks
    from kvviz.policies.select import select
    from kvviz.spec import Spec

    steps = trace.later_queries
    n_last = int(trace.query_positions[steps[-1]]) + 1
    budget = max(1, int(round(budget_fraction * n_last)))
    quest = Spec(scorer="quest", page_size=page_size, **split_budget("quest", budget))
    tok = quest.with_(scorer="oracle")
    heads = np.arange(trace.n_q_heads)
    g = trace.group_size
    out = {k: [] for k in ("quest", "page-oracle", "token-oracle", "read", "oracle@read", "quest-kv")}
    for layer in range(trace.n_layers):
        for qi in steps:
            qi = int(qi)
            a = softmax(logit_rows(trace, layer, heads, qi))  # (Hq, n)
            reads = read_masks(trace, quest, layer, qi)
            out["quest"].append((a * reads).sum(axis=1))
            out["quest-kv"].append((a * read_masks(trace, quest.with_(quest_heads="kv"), layer, qi)).sum(axis=1))
            out["page-oracle"].append((a * page_oracle(a, quest)).sum(axis=1))
            out["token-oracle"].append((a * select(a, tok)).sum(axis=1))
            union = reads.reshape(trace.n_kv_heads, g, -1).any(axis=1)  # what each KV head serves
            out["read"].append(union.sum(axis=1))
            kept = np.zeros_like(union)
            for h in range(trace.n_kv_heads):  # the oracle at that many
                r = int(union[h].sum())
                spec = Spec(
                    scorer="oracle", sink=quest.sink, recent=quest.recent, heavy=max(0, r - quest.sink - quest.recent)
                )
                kept[h] = select(a[h * g : (h + 1) * g].sum(axis=0, keepdims=True), spec)[0]
            out["oracle@read"].append((a * np.repeat(kept, g, axis=0)).sum(axis=1))
    return {"budget": budget, **{k: float(np.mean(v)) for k, v in out.items()}}


def main() -> int:
    from allocation_table import bundled_trace

    t0 = time.perf_counter()
    trace = bundled_trace(206, 57)
    print(trace.describe())
    cols = ("quest", "quest-kv", "page-oracle", "token-oracle", "read", "oracle@read")
    head = f"{'':24}" + "".join(f"{c:>14}" for c in cols)

    def row(label, m):
        return f"{label:24}" + "".join(f"{m[c]:>14.1f}" if c == "read" else f"{m[c]:>14.4f}" for c in cols)

    print("\n1. page size, at the 25% budget (tokens per query head; quest-kv = one choice per KV head)")
    print(head)
    for size in PAGE_SIZES:
        m = measure(trace, 0.25, size)
        print(row(f"page {size:>2} (budget {m['budget']})", m))
    print("\n2. budget, at Quest's page size 16")
    print(head)
    for frac in BUDGETS:
        m = measure(trace, frac, 16)
        print(row(f"{frac:.0%} (budget {m['budget']})", m))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
