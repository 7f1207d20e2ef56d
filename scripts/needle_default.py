"""Compute the shipped default needle grids (kvviz/data/needle_default.json.gz) on the bundled model.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python scripts/needle_default.py [--lengths 320,640,1024]

Two grids in one file, one per compression point: after the question (query-aware, kvpress's
compress_questions=True) and before it (query-agnostic, kvpress's pipeline default); the page shows
both. Uses the same run (and disk cache) as `kvviz needle` and `kvviz needle --question-after-compression`,
so afterwards both CLI runs are instant. The page loads the file instantly; its "Run live" button recomputes
a grid.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvviz.analysis import needle  # noqa: E402
from kvviz.models import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=",".join(map(str, needle.DEFAULT_LENGTHS)))
    ap.add_argument("--depths", default=",".join(f"{d:g}" for d in needle.DEFAULT_DEPTHS))
    ap.add_argument("--scorers", default=",".join(needle.DEFAULT_SCORERS))
    ap.add_argument("--budget", type=float, default=needle.DEFAULT_BUDGET)
    ap.add_argument("--out", default=str(needle.DEFAULT_FILE))
    a = ap.parse_args()
    model, tokenizer, _ = load_model("bundled")
    t0 = time.perf_counter()
    grids, computed, cached = [], 0, 0
    for qac in (False, True):
        stats: dict = {}
        request = needle.GridRequest(
            lengths=[int(x) for x in a.lengths.split(",")],
            depths=[float(x) for x in a.depths.split(",")],
            scorers=a.scorers.split(","),
            budgets=[a.budget],
            question_after_compression=qac,
        )
        grid = needle.run_grid(
            model,
            tokenizer,
            "bundled",
            request,
            stats=stats,
            progress=lambda f, m: print(f"\r[{f:4.0%}] {m:<60}", end="", file=sys.stderr),
        )
        print(file=sys.stderr)
        print(needle.PROTOCOL_TITLES[needle.protocol(grid)])
        print(needle.format_grid(grid))
        grids.append(grid)
        computed, cached = computed + stats["computed"], cached + stats["cached"]
    needle.save_grids(a.out, grids)
    print(
        f"{computed} cells computed, {cached} from the cache, "
        f"{time.perf_counter() - t0:.0f} s; wrote {a.out} ({Path(a.out).stat().st_size / 1e3:.0f} kB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
