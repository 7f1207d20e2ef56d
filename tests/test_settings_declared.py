"""One setting, one place: a scorer declares its settings in its own file, and the link, the
command line, the app's widgets and the study grid are made from the declarations.

The proof: a scorer defined here, with one setting declared here, and no other file touched, gets a flag in
`kvviz compare --help`, is read from a link, gets a widget in the app and can be a study axis.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from kvviz import Spec, SpecError, keep_masks, links
from kvviz.cli import main
from kvviz.policies import POLICIES, Policy
from kvviz.policies import registry
from kvviz.settings import SETTINGS, Setting, declare
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.spec import PLUGIN_SCORERS

ROOT = Path(__file__).resolve().parents[1]
PIVOT = Setting(
    "pivot_at",
    "int",
    10,
    0,
    100_000,
    url="pivot",
    owner=("scorer", "pivot"),
    label="Pivot position (tokens)",
    help="The heavy hitters are the context tokens nearest this one.",
)


class Pivot(Policy):
    """Keeps the context tokens nearest a position the user sets: its one setting, `pivot_at`."""

    name = "pivot"
    description = "the context tokens nearest the pivot position"

    def score(self, ctx):
        positions = np.arange(ctx.n_positions, dtype=np.float64)
        scores = -np.abs(positions - ctx.spec.pivot_at)
        scores[ctx.n_context :] = -np.inf
        return np.broadcast_to(scores, (ctx.trace.n_kv_heads, ctx.n_positions))


@pytest.fixture
def pivot():
    """The scorer and its setting, as a plug-in file would declare them; withdrawn afterwards."""
    declare(PIVOT)
    registry.register(Pivot)
    yield
    SETTINGS.pop("pivot_at", None)
    POLICIES.pop("pivot", None)
    while "pivot" in PLUGIN_SCORERS:
        PLUGIN_SCORERS.remove("pivot")


TRACE = SyntheticSpec(context=96, steps=0, layers=1, q_heads=2, kv_heads=1, head_dim=64)


def kept_heavy(spec: Spec) -> set[int]:
    """The heavy hitters the spec keeps at the last context query (no sinks; a window of 1)."""
    trace = make_synthetic(TRACE)
    c = trace.context_len
    kept = keep_masks(trace, spec, 0, [c - 1])[0, 0]
    return {int(p) for p in np.flatnonzero(kept[: c - spec.recent])}


def test_the_setting_reaches_the_scorer_through_spec(pivot):
    assert Spec(scorer="pivot").pivot_at == 10
    assert kept_heavy(Spec(recent=1, heavy=5, scorer="pivot", pivot_at=40)) == {38, 39, 40, 41, 42}
    with pytest.raises(SpecError, match=r"Pivot position \(tokens\) must be 0-100,000, got -1"):
        Spec(scorer="pivot", pivot_at=-1)


def test_the_setting_is_a_flag_in_compare_help_and_reaches_the_spec(pivot, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--help"])
    assert exit_.value.code == 0
    assert "--pivot-at" in capsys.readouterr().out
    argv = [
        "compare",
        "--source",
        "synthetic",
        "--context",
        "96",
        "--steps",
        "0",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "64",
        "--scorer",
        "pivot",
        "--recent",
        "1",
        "--heavy",
        "5",
        "--json",
    ]
    assert main([*argv, "--pivot-at", "40"]) == 0
    at40 = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    at10 = json.loads(capsys.readouterr().out)
    assert (at40["spec"]["pivot_at"], at10["spec"]["pivot_at"]) == (40, 10)
    assert at40["metrics"] != at10["metrics"]
    with pytest.raises(SystemExit) as exit_:  # the declared range: one line, exit 2
        main([*argv, "--pivot-at=-3"])
    assert exit_.value.code == 2
    assert "argument --pivot-at: must be 0-100,000, got -3" in capsys.readouterr().err


def test_the_setting_is_read_from_a_link(pivot):
    values, notes = links.parse_query("scorer=pivot&recent=1&heavy=5&pivot=40")
    assert notes == [] and links.spec_from_values(values).pivot_at == 40
    values, notes = links.parse_query("scorer=pivot&pivot=200000")
    assert values["pivot"] == 100_000 and "clamped to 100000" in notes[0]
    assert "pivot" in links.compression_params()  # a pinned setting A records it too


def test_the_setting_gets_a_widget_in_the_app(pivot):
    from apptest_util import run_app

    from kvviz.app.compression import ADVANCED

    at = run_app(str(ROOT / "app.py"), opened=(ADVANCED,), scorer="pivot", sink=0, recent=1, heavy=5, pivot=40)
    box = at.number_input(key="pivot")
    assert box.label == "Pivot position (tokens)" and box.value == 40
    box.set_value(41).run()
    assert at.session_state["_kvviz_state"]["pivot"] == 41
    at = run_app(str(ROOT / "app.py"), opened=(ADVANCED,), scorer="h2o")  # another scorer's settings are not shown
    assert "pivot" not in [w.key for w in at.number_input]


def test_the_setting_is_a_study_axis(pivot, tmp_path):
    from study_util import check_one_axis

    from kvviz.analysis.study import parse_study

    study = check_one_axis(
        tmp_path / "s", "pivots", context=96, steps=0, scorer="pivot", budget=0.1, axis="pivot_at", values=[10, 40]
    )
    with pytest.raises(SpecError, match="pivot_at"):
        parse_study(study.text.replace("pivot_at = [10, 40]", "pivot_at = [10, -1]"))


def test_every_declared_setting_has_a_link_name_a_flag_and_a_valid_default():
    """The built-ins: each setting's default passes its own check, its link parameter parses its default back,
    and the flag exists (every Spec keyword can be set from the command line, except the Model lab's key
    positions, set by --rerotate)."""
    from kvviz.cli.parser import build_parser

    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["compare"]._actions}
    for name, s in SETTINGS.items():
        assert s.problem(s.default) is None, name
        assert name in flags or name == "positions", name
        if name not in links.NOT_IN_LINKS:
            p = links.PARAMS[s.url_name]
            assert p.setting == name
            assert p.parse(p.encode(p.default)) == (p.default, None), name
