"""`kvviz solve`: the smallest cache that keeps a target attention mass (or TV)."""

from __future__ import annotations

import argparse
import json
import sys

from kvviz.cli.args import CliError, _json_safe, _nonneg, add_trace_args, number, spec_trace_view


def cmd_solve(a: argparse.Namespace) -> int:
    from kvviz.analysis.solve import SPLIT_RULE, solve

    if a.sink or a.recent or a.heavy:
        raise CliError(
            "solve chooses sink, recent and heavy itself (split rule: "
            + SPLIT_RULE
            + "); use --max-sink to change the number of sinks"
        )
    if (a.target_mass is None) == (a.target_tv is None):
        raise CliError("give one target: --target-mass M (keep at least M of the attention) or --target-tv T")
    base, trace, _, view = spec_trace_view(a)
    sol = solve(trace, base, view, target_mass=a.target_mass, target_tv=a.target_tv, max_sink=a.max_sink)
    if a.json:
        json.dump(_json_safe(sol.as_dict()), sys.stdout)
        sys.stdout.write("\n")
        return 0
    what = "attention mass" if sol.metric == "mass_retained" else "TV distance"
    sign = ">=" if sol.metric == "mass_retained" else "<="
    below = "" if sol.below is None else f"; one token less gives {sol.below:.4f}"
    print(
        f"smallest cache with {what} {sign} {sol.target:g} ({base.scorer}, {base.label()}): "
        f"{sol.budget} of {sol.tokens} tokens = sink {sol.spec.sink} + recent {sol.spec.recent} + "
        f"heavy {sol.spec.heavy}; reaches {sol.value:.4f}{below}"
    )
    print(
        f"split rule: {SPLIT_RULE}; {'exact smallest' if sol.exact else 'one token less misses the target'}; "
        f"{sol.evaluations} budgets evaluated"
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser("solve", help="the smallest cache that keeps a target attention mass (or TV)")
    add_trace_args(p)
    g = p.add_argument_group("target (give one)")
    g.add_argument(
        "--target-mass", type=number(0, 1, open_low=True), help="keep at least this share of the attention (0-1)"
    )
    g.add_argument("--target-tv", type=number(0, 1, open_low=True), help="keep the TV distance at most this (0-1)")
    p.add_argument("--max-sink", type=_nonneg, default=4, help="sinks in the split rule (default 4)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_solve)
