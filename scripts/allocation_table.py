#!/usr/bin/env python3
"""Mean attention mass retained per scorer x allocation on the bundled model's trace of the
sample text.

The trace: SmolLM2-135M (bundled, offline) reads kvviz's sample text teacher-forced, prompt
206 tokens (the compression point), then 57 decode steps whose queries read the compressed
cache (the decode path's own recording, full cache). Budget: a fraction (default 25%) of the
tokens the last step sees, split as every sweep splits it (kvviz.analysis.sweep.split_budget: 4 sinks,
the rest half recent window, half heavy hitters; StreamingLLM all window). Mass retained is
averaged over every layer, every query head and every decode step.

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/allocation_table.py

Options: --budget 0.25, --prompt-tokens 206, --steps 57, --scorers a,b,c, --csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvviz, not an installed one

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

SCORERS = (
    "oracle",
    "snapkv",
    "expected_attention",
    "keydiff",
    "knorm",
    "chunkkv",
    "quest",
    "h2o",
    "tova",
    "streaming",
    "random",
)
ALLOCATIONS = ("uniform", "adakv", "pyramid")


def bundled_trace(prompt_tokens: int, steps: int):
    from kvviz.decode.loop import decode
    from kvviz.decode.quality import sample_text, tokenize
    from kvviz.models import load_model
    from kvviz.spec import Spec

    model, tokenizer, _ = load_model("bundled")
    ids = tokenize(tokenizer, sample_text())
    if len(ids) < prompt_tokens + steps:
        raise SystemExit(f"the sample text has {len(ids)} tokens, fewer than {prompt_tokens} + {steps}")
    _, _, cache = decode(
        model, ids[:prompt_tokens], Spec(), steps, feed=ids[prompt_tokens : prompt_tokens + steps], record=True
    )
    trace = cache.run_trace()
    trace.meta["rope_inv_freq"] = cache.trace.meta.get("rope_inv_freq")  # RoPE, for Expected Attention
    trace.meta["source"] = "bundled SmolLM2-135M on the sample text (teacher-forced)"
    return trace


def mass_table(trace, budget_fraction: float, scorers, allocations, progress=None):
    """{(scorer, allocation): mean mass retained or a reason string}, and the budget split."""
    from kvviz.attention import logit_rows, softmax
    from kvviz.engine import keep_masks, read_masks
    from kvviz.policies import get_policy
    from kvviz.spec import Spec, SpecError
    from kvviz.analysis.sweep import split_budget

    steps = trace.later_queries
    positions = trace.query_positions[steps]
    n_last = int(positions[-1]) + 1
    budget = max(1, int(round(budget_fraction * n_last)))
    heads = np.arange(trace.n_q_heads)
    g = trace.group_size
    attention = {
        (layer, int(qi)): softmax(logit_rows(trace, layer, heads, int(qi)))
        for layer in range(trace.n_layers)
        for qi in steps
    }
    out, splits = {}, {}
    for scorer in scorers:
        split = split_budget(scorer, budget)
        splits[scorer] = split
        for allocation in allocations:
            try:
                spec = Spec(scorer=scorer, allocation=allocation, **split)
            except SpecError as exc:
                out[(scorer, allocation)] = "n/a: " + str(exc).split(";")[0].split(":")[0]
                continue
            if progress:
                progress(f"{scorer} {allocation}")
            masses = []
            for layer in range(trace.n_layers):
                if get_policy(scorer).needs_query:  # per query head (Quest reads its own pages)
                    masks = [read_masks(trace, spec, layer, int(qi)) for qi in steps]
                else:
                    all_masks = keep_masks(trace, spec, layer, positions)
                    masks = [np.repeat(all_masks[i, :, : int(p) + 1], g, axis=0) for i, p in enumerate(positions)]
                for qi, kept in zip(steps, masks):
                    a = attention[(layer, int(qi))]  # (Hq, n)
                    masses.append((a * kept).sum(axis=1))
            out[(scorer, allocation)] = float(np.mean(masses))
    return out, splits, budget, n_last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=0.25, help="budget fraction of the tokens the last step sees")
    ap.add_argument("--prompt-tokens", type=int, default=206)
    ap.add_argument("--steps", type=int, default=57)
    ap.add_argument("--scorers", default=",".join(SCORERS))
    ap.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    trace = bundled_trace(a.prompt_tokens, a.steps)
    scorers = [s for s in a.scorers.split(",") if s]
    table, splits, budget, n = mass_table(
        trace, a.budget, scorers, ALLOCATIONS, progress=lambda m: print(f"  {m}", file=sys.stderr)
    )
    if a.csv:
        print("scorer,sink,recent,heavy," + ",".join(ALLOCATIONS))
        for s in scorers:
            cells = [f"{table[(s, al)]:.4f}" if isinstance(table[(s, al)], float) else "" for al in ALLOCATIONS]
            print(f"{s},{splits[s]['sink']},{splits[s]['recent']},{splits[s]['heavy']}," + ",".join(cells))
        return 0
    print(f"{trace.describe()}")
    print(
        f"budget {a.budget:.0%} of {n} tokens = {budget} per KV head (split: 4 sinks, the rest half recent / "
        f"half heavy; streaming: all recent); mean mass retained over {trace.n_layers} layers x "
        f"{trace.n_q_heads} query heads x {len(trace.later_queries)} decode steps"
    )
    print(f"{'scorer':<20} {'sink/recent/heavy':<18}" + "".join(f"{al:>10}" for al in ALLOCATIONS))
    for s in scorers:
        sp = splits[s]
        cells = "".join(
            f"{table[(s, al)]:>10.4f}" if isinstance(table[(s, al)], float) else f"{'n/a':>10}" for al in ALLOCATIONS
        )
        print(f"{s:<20} {sp['sink']}/{sp['recent']}/{sp['heavy']:<13}{cells}")
    print(
        "n/a: AdaKV allocates once from one-shot scores (h2o / tova decide every step); ChunkKV keeps the same "
        "chunks in every head"
    )
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
