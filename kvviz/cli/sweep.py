"""`kvviz sweep`: several policies over several budgets and bit widths -> CSV."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvviz.cli.args import CliError, add_trace_args, number_list, scorer_from_args, spec_trace_view
from kvviz.quant.formats import SERVING_FORMATS
from kvviz.spec import FULL_BITS
from kvviz.spec import SCORERS, SpecError, scorer_names


def cmd_sweep(a: argparse.Namespace) -> int:
    from kvviz.analysis.sweep import sweep, to_csv

    scorers = [s.strip() for s in a.scorers.split(",") if s.strip()]
    if a.policy:  # the plug-in joins the sweep
        name = scorer_from_args(a)
        scorers += [] if name in scorers else [name]
    from kvviz.policies.registry import load_entry_points

    load_entry_points()
    bad = [s for s in scorers if s not in scorer_names()]
    if bad:
        raise SpecError(f"unknown scorer {bad[0]!r}; choose from {', '.join(scorer_names())}")
    fractions, bits = a.budgets, a.bits_list  # checked by their argparse types
    base, trace, _, view = spec_trace_view(a, ensemble=a.ensemble or "heads", ensemble_size=a.ensemble_size)
    from kvviz.analysis.sweep import SWEEP_FORMATS

    formats = [f.strip() for f in a.formats_list.split(",") if f.strip()]
    bad = [f for f in formats if f not in SWEEP_FORMATS]
    if bad:
        raise CliError(f"unknown format {bad[0]!r} in --formats-list; choose from {', '.join(SWEEP_FORMATS)}")
    rows = sweep(
        trace,
        scorers,
        fractions,
        bits,
        view,
        base,
        progress=(lambda f, msg: print(f"\r[{f:4.0%}] {msg:<50}", end="", file=sys.stderr)),
        formats=formats,
    )
    print(file=sys.stderr)
    text = to_csv(rows)
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {len(rows)} rows to {a.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def register(sub) -> None:
    p = sub.add_parser("sweep", help="several policies over several budgets and bits -> CSV")
    add_trace_args(p)
    p.add_argument("--scorers", default=",".join(SCORERS), help="comma-separated scorers")
    p.add_argument(
        "--budgets",
        type=number_list(float, 0, 1, "0.1,0.25,1", open_low=True),
        default=[0.05, 0.1, 0.2, 0.3, 0.5, 1.0],
        help="budget fractions of the tokens, each in (0, 1] (default 0.05,0.1,0.2,0.3,0.5,1)",
    )
    p.add_argument(
        "--bits-list",
        type=number_list(int, 1, FULL_BITS, "16,4,2"),
        default=[16, 8, 4, 2],
        help="bit widths to sweep, each 1-8 or 16 (default 16,8,4,2)",
    )
    p.add_argument(
        "--formats-list",
        default="",
        help=f"cache formats to add to the sweep, K and V alike: {','.join(SERVING_FORMATS)} (default none)",
    )
    p.add_argument("--out", help="CSV file (default: standard output)")
    p.set_defaults(func=cmd_sweep)
