"""A needle grid read out: its CSV, its plain-text table, and the cell the page opens on."""

from __future__ import annotations

import numpy as np

from kvviz.analysis.needle.cell import ANSWER_FIELDS, NeedleCell
from kvviz.analysis.needle.results import NeedleGrid
from kvviz.analysis.needle.prompt import FULL
from kvviz.policies import POLICIES
from kvviz.spec import FULL_BITS


CSV_FIELDS = (
    "scorer",
    "length",
    "depth",
    "budget",
    "bits",
    "question_after_compression",
    "budget_tokens",
    *ANSWER_FIELDS,
    "spec",
)


def to_csv(grid: NeedleGrid) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for c in grid.cells:
        d = c.as_dict()
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in d.items() if k in CSV_FIELDS})
    return buf.getvalue()


def format_grid(grid: NeedleGrid) -> str:
    """Plain-text grid: one block per scorer (and budget/bits), rows = depth, columns = length."""
    lines = []
    groups = list(dict.fromkeys((c.scorer, c.budget, c.bits) for c in grid.cells))
    lengths = grid.lengths
    for scorer, budget, bits in groups:
        title = scorer if scorer == FULL else f"{scorer} {budget:g}"
        if bits != FULL_BITS:
            title += f" {bits}-bit"
        lines.append(f"{title:<18}" + "".join(f"{n:>14}" for n in lengths))
        for d in grid.depths:
            row = []
            for n in lengths:
                c = next(
                    (
                        c
                        for c in grid.cells
                        if (c.scorer, c.budget, c.bits, c.length) == (scorer, budget, bits, n)
                        and abs(c.depth - d) < 1e-9
                    ),
                    None,
                )
                row.append("" if c is None else f"{'ok' if c.correct else 'MISS'} {c.needle_kept:4.0%}")
            lines.append(f"  depth {d:>4.0%}      " + "".join(f"{r:>14}" for r in row))
        n_ok = sum(c.correct for c in grid.cells if (c.scorer, c.budget, c.bits) == (scorer, budget, bits))
        n_all = sum(1 for c in grid.cells if (c.scorer, c.budget, c.bits) == (scorer, budget, bits))
        lines.append(f"  correct {n_ok}/{n_all}")
    lines.append("cells: ok/MISS = the key exactly right or not; % = needle tokens kept over all layers x KV heads")
    return "\n".join(lines)


# --- what the page opens on ----------------------------------------------------------------------


def classic_failure(grid: NeedleGrid) -> tuple[str, int, float] | None:
    """The classic failure to show in one click: a window-only policy such as StreamingLLM (else any policy)
    wrong where the full cache is right, the needle nearest the start, at the shortest such length."""
    methods = [s for s in grid.scorers if s != FULL]
    for scorer in sorted(methods, key=lambda s: not (s in POLICIES and POLICIES[s].window_only)):
        bad = [c for c in grid.cells if c.scorer == scorer and not c.correct and c.full_correct]
        if bad:
            c = min(bad, key=lambda c: (c.depth, c.length))
            return c.scorer, c.length, c.depth
    return None


def loudest_head(cell: NeedleCell) -> tuple[int, int]:
    """(layer, KV head) where the full model wanted the needle most (where a loss hurts most)."""
    w = np.asarray(cell.wanted_mass_by_head)
    layer, head = np.unravel_index(int(np.argmax(w)), w.shape)
    return int(layer), int(head)
