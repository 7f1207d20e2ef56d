"""`kvviz ledger`: declared vs kept tokens and bytes per layer and KV head."""

from __future__ import annotations

import argparse
import sys

from kvviz.cli.args import MAX_TOKENS, add_compression_args, integer, add_source_args, source_from_args, spec_from_args


def cmd_ledger(a: argparse.Namespace) -> int:
    from kvviz.analysis.ledger import budget_ledger, to_csv

    spec = spec_from_args(a)
    trace, _ = source_from_args(a)
    ledger = budget_ledger(trace, spec, a.step)
    if a.csv:
        sys.stdout.write(to_csv(ledger))
        return 0
    print(trace.describe())
    print(f"spec: {spec.label()}; caches at the query at position {ledger.position} ({ledger.n_tokens} tokens seen)")
    print(
        f"{'layer':>5} {'declared':>9} {'kept':>6} {'sink':>5} {'recent':>7} {'heavy':>6} {'stored B':>11} "
        f"{'read B':>11} {'overhead B':>11} {'16-bit B':>10}   (summed over the layer's KV heads)"
    )
    cols = ("declared_tokens", "kept_tokens", "sink", "recent", "heavy", "stored_bytes", "read_bytes", "overhead_bytes")
    per = {c: ledger.per_layer(c) for c in cols}
    full16 = ledger.per_layer("residual_bytes") + ledger.per_layer("partial_bytes")
    for i in range(len(per["kept_tokens"])):
        print(
            f"{i:>5} {per['declared_tokens'][i]:>9.0f} {per['kept_tokens'][i]:>6.0f} {per['sink'][i]:>5.0f} "
            f"{per['recent'][i]:>7.0f} {per['heavy'][i]:>6.0f} {per['stored_bytes'][i]:>11,.0f} "
            f"{per['read_bytes'][i]:>11,.0f} {per['overhead_bytes'][i]:>11,.0f} {full16[i]:>10,.0f}"
        )
    for note in ledger.notes():
        print(f"note: {note}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("ledger", help="declared vs kept tokens and bytes per layer and KV head (the budget ledger)")
    add_source_args(p)
    add_compression_args(p)
    p.add_argument(
        "--step", type=integer(0, MAX_TOKENS), default=None, help="which evaluated query (default: the last)"
    )
    p.add_argument("--csv", action="store_true", help="every (layer, KV head) row as CSV")
    p.set_defaults(func=cmd_ledger)
