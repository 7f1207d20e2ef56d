"""`kvviz solve`: the smallest cache for a target, checked against a brute-force scan."""

import json

import pytest

from kvviz import Spec, SpecError, View, compare
from kvviz.cli import main
from kvviz.analysis.solve import solve
from kvviz.sources.handbook import handbook_trace
from kvviz.sources.synthetic import make_synthetic
from synthetic_util import small_synthetic
from kvviz.analysis.sweep import split_budget


@pytest.fixture(scope="module")
def trace():
    return make_synthetic(small_synthetic(context=96, steps=6, layers=1))


def brute_force(trace, base, view, metric, target):
    n = int(trace.query_positions[trace.evaluated_queries[-1]]) + 1
    values = {}
    for b in range(1, n + 1):
        values[b] = compare(trace, base.with_(**split_budget(base.scorer, b)), view).metrics[metric]
    ok = [b for b, v in values.items() if (v >= target if metric == "mass_retained" else v <= target)]
    return min(ok), values


@pytest.mark.parametrize(
    "scorer, bits, metric, target",
    [
        ("h2o", 16, "mass_retained", 0.9),
        ("tova", 4, "mass_retained", 0.95),
        ("snapkv", 16, "mass_retained", 0.8),
        ("streaming", 16, "mass_retained", 0.9),
        ("oracle", 4, "mass_retained", 0.97),
        ("knorm", 16, "tv_distance", 0.2),
        ("h2o", 4, "tv_distance", 0.1),
    ],
)
def test_smallest_means_smallest(trace, scorer, bits, metric, target):
    base = Spec(scorer=scorer, key_bits=bits, value_bits=bits)
    view = View(head=1)
    kwargs = {"target_mass": target} if metric == "mass_retained" else {"target_tv": target}
    sol = solve(trace, base, view, **kwargs)
    smallest, values = brute_force(trace, base, view, metric, target)
    good = (lambda v: v >= target) if metric == "mass_retained" else (lambda v: v <= target)
    assert good(values[sol.budget]) and sol.value == values[sol.budget]
    assert sol.budget == 1 or not good(values[sol.budget - 1])  # one token less misses
    if sol.exact:
        assert sol.budget == smallest
    assert sol.spec.sink + sol.spec.recent + sol.spec.heavy == sol.budget
    assert sol.evaluations < len(values) / 2  # a search, not a scan


def test_exact_where_kept_sets_nest(trace):
    """K-norm's scores do not depend on the budget, so its kept sets grow with it and the bisection finds the
    brute-force smallest (exact); SnapKV's automatic window follows the recent window, so they need not."""
    view = View(head=1)
    sol = solve(trace, Spec(scorer="knorm"), view, target_mass=0.9)
    assert sol.exact and sol.budget == brute_force(trace, Spec(scorer="knorm"), view, "mass_retained", 0.9)[0]
    assert not solve(trace, Spec(scorer="snapkv"), view, target_mass=0.9).exact
    assert not solve(trace, Spec(scorer="knorm", compress_every=4), view, target_mass=0.9).exact


def test_unreachable_target_says_what_to_change(trace):
    with pytest.raises(SpecError, match="raise the bits"):
        solve(trace, Spec(key_bits=1, value_bits=1, key_axis="token"), target_tv=1e-6)
    with pytest.raises(SpecError, match="exactly one target"):
        solve(trace, Spec())


def test_cli_solve_json(capsys):
    code = main(["solve", "--target-mass", "0.95", "--bits", "4", "--scorer", "h2o", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"budget", "sink", "recent", "heavy", "mass_retained", "split_rule"} <= set(out)
    assert out["mass_retained"] >= 0.95 and out["one_token_less"] < 0.95
    again = compare(
        handbook_trace(), Spec(sink=out["sink"], recent=out["recent"], heavy=out["heavy"], key_bits=4, value_bits=4)
    )
    assert again.metrics["mass_retained"] == out["mass_retained"]
    with pytest.raises(SystemExit) as exc:
        main(["solve", "--target-mass", "1.5"])
    assert exc.value.code == 2
