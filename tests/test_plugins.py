"""Your own policy as a plug-in: the example package under tests/plugin_example is
"installed" through a temporary dist-info on sys.path (importlib.metadata finds its entry points;
the shared venv is not touched) and runs through compare, sweep, the app and the decode path."""

import importlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from kvviz import Spec, SpecError, View, compare, keep_masks
from kvviz.policies import registry as plugins
from kvviz.cli import main
from kvviz.policies import POLICIES, ScoreContext, get_policy
from kvviz.spec import PLUGIN_SCORERS

from cli_util import SYNTHETIC_64

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "plugin_example"
PLUGIN_FILE = EXAMPLE / "kvviz_example_plugin" / "__init__.py"


def _forget():
    for name in ("last8", "keep_early"):
        POLICIES.pop(name, None)
        while name in PLUGIN_SCORERS:
            PLUGIN_SCORERS.remove(name)
    plugins._loaded_entry_points = False
    plugins.ERRORS.clear()
    for m in [m for m in sys.modules if m.startswith("kvviz_example_plugin") or m.startswith("kvviz_plugin_")]:
        sys.modules.pop(m)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The example package and a dist-info with its entry points, on sys.path for this test only."""
    shutil.copytree(EXAMPLE / "kvviz_example_plugin", tmp_path / "kvviz_example_plugin")
    info = tmp_path / "kvviz_example_plugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvviz-example-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[kvviz.policies]\nlast8 = kvviz_example_plugin:LastQueries\nkeep_early = kvviz_example_plugin:keep_early\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    _forget()
    yield tmp_path
    _forget()


def last8_reference(trace, layer):
    """The plug-in's rule recomputed: attention of the last 8 context queries, summed over the group."""
    c, g, d = trace.context_len, trace.group_size, trace.head_dim
    votes = np.zeros((trace.n_kv_heads, c))
    for qi in range(c - 8, c):
        for h in range(trace.n_q_heads):
            logits = trace.k[layer, h // g, : qi + 1].astype(np.float64) @ trace.q[layer, h, qi] / np.sqrt(d)
            a = np.exp(logits - logits.max())
            votes[h // g, : qi + 1] += a / a.sum()
    return votes


def test_installed_plugin_is_found_by_entry_point_and_matches_its_rule(installed):
    from test_policies_new import random_trace

    assert "last8" not in POLICIES
    spec = Spec(sink=2, recent=4, heavy=6, scorer="last8")  # the name is known from the installed metadata ...
    assert "last8" not in POLICIES  # ... its code is not loaded for a spec
    with pytest.raises(SpecError, match="unknown scorer 'nope'"):
        Spec(scorer="nope")  # a name no plug-in declares is refused
    assert get_policy("last8").name == "last8"  # the registry loads the entry points
    assert "last8" in POLICIES and "keep_early" in POLICIES
    assert POLICIES["keep_early"].description == "earliest tokens first (a position-only baseline)"
    trace = random_trace(11)
    c = trace.context_len
    kept = keep_masks(trace, spec, 1, [c - 1])[0]
    ref = last8_reference(trace, 1)
    for h in range(trace.n_kv_heads):
        order = sorted(range(2, c - 4), key=lambda i: (-ref[h, i], i))
        assert set(np.flatnonzero(kept[h])) - set(range(2)) - set(range(c - 4, c)) == set(order[:6])
    early = compare(trace, Spec(sink=0, recent=1, heavy=5, scorer="keep_early"), View())
    assert np.flatnonzero(early.primary.kept).tolist() == [0, 1, 2, 3, 4, early.primary.position]


def test_plugin_through_compare_and_sweep_on_the_cli(installed, capsys):
    assert main(["compare", "--scorer", "last8", "--sink", "4", "--recent", "8", "--heavy", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["scorer"] == "last8" and sum(out["kept"]) == 16
    assert (
        main(
            [
                "sweep",
                *SYNTHETIC_64,
                "--steps",
                "4",
                "--scorers",
                "last8,h2o",
                "--budgets",
                "0.25,0.5",
                "--bits-list",
                "16",
            ]
        )
        == 0
    )
    csv = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("last8,") for line in csv) == 2 and sum(line.startswith("h2o,") for line in csv) == 2


def test_policy_file_on_the_cli(capsys):
    _forget()
    try:
        assert (
            main(
                [
                    "compare",
                    "--policy",
                    f"{PLUGIN_FILE}:keep_early",
                    "--sink",
                    "0",
                    "--recent",
                    "1",
                    "--heavy",
                    "3",
                    "--json",
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        assert out["spec"]["scorer"] == "keep_early"
        assert [i for i, k in enumerate(out["kept"]) if k] == [0, 1, 2, len(out["kept"]) - 1]
        assert (
            main(
                [
                    "sweep",
                    "--policy",
                    f"{PLUGIN_FILE}:LastQueries",
                    "--scorers",
                    "h2o",
                    "--budgets",
                    "0.5",
                    "--bits-list",
                    "16",
                ]
            )
            == 0
        )
        assert any(line.startswith("last8,") for line in capsys.readouterr().out.splitlines())
        for bad, msg in (
            (f"{PLUGIN_FILE}:Nope", "has no 'Nope'"),
            ("nowhere.py:X", "no Python file"),
            (str(PLUGIN_FILE), "path/to/file.py:ClassName"),
        ):
            assert main(["compare", "--policy", bad]) == 2
            assert msg in capsys.readouterr().err
    finally:
        _forget()


def test_plugins_cannot_replace_built_ins():
    class Fake(POLICIES["h2o"].__class__):
        name = "h2o"

    with pytest.raises(SpecError, match="built-in"):
        plugins.register(Fake)


def test_plugin_in_the_app(installed):
    from apptest_util import run_app

    at = run_app(str(ROOT / "app.py"), opened=("_advanced_open",), scorer="last8", sink=4, recent=8, heavy=4)
    box = next(b for b in at.selectbox if b.label == "Heavy-hitter scorer")
    assert box.value == "last8"
    assert any("last8 (plug-in: attention from the last 8" in o for o in box.options)
    assert "last8" in at.session_state["_kvviz_state"]["scorer"]
    # code never comes through the browser: a `policy` link parameter is not a setting
    at = run_app(str(ROOT / "app.py"), policy=f"{PLUGIN_FILE}:LastQueries")
    assert at.session_state["_kvviz_state"]["scorer"] == "h2o"
    assert "policy" not in at.session_state["_kvviz_state"]
    assert any("`policy` is not a kvviz setting" in n for n in at.session_state["_kvviz_notices"])


def test_plugin_in_the_decode_path(installed):
    import torch
    from conftest import tiny_llama

    from kvviz.decode.loop import decode

    model, ids = tiny_llama()  # 2 layers, eager attention, token ids drawn from a fixed seed
    spec = Spec(sink=2, recent=4, heavy=6, scorer="last8")
    logits, _, cache = decode(model, ids[:24], spec, 8, feed=ids[24:32], record=True)
    assert torch.isfinite(logits).all()
    trace = cache.run_trace()
    for layer in range(2):
        want = get_policy("last8").keep_masks(ScoreContext(trace, layer, spec), np.arange(24, 32))
        assert np.array_equal(cache.kept_history(layer), want)


# --- the registry's own rules (register, as_policy, load_entry_points, load_file) ----------------


@pytest.fixture
def registry():
    """The registry module, its tables restored after the test."""
    saved = dict(POLICIES), list(PLUGIN_SCORERS), list(plugins.ERRORS), plugins._loaded_entry_points
    yield plugins
    POLICIES.clear()
    POLICIES.update(saved[0])
    PLUGIN_SCORERS[:] = saved[1]
    plugins.ERRORS[:] = saved[2]
    plugins._loaded_entry_points = saved[3]


def newest(ctx):
    """newest tokens first"""
    return np.arange(ctx.n_positions, dtype=np.float64)


def test_an_unknown_scorer_is_refused_naming_every_scorer(registry):
    with pytest.raises(ValueError) as refused:
        get_policy("nope")
    assert str(refused.value) == "unknown scorer 'nope'; choose one of " + ", ".join(POLICIES)
    assert str(refused.value).startswith("unknown scorer 'nope'; choose one of h2o, tova, snapkv, ")


def test_register_names_and_describes_what_it_is_given(registry):
    def anonymous(ctx):
        return np.zeros(ctx.n_positions)

    assert registry.register(newest, "newest-first").name == "newest-first"  # the given name wins
    assert get_policy("newest-first").description == "newest tokens first"  # the docstring's first line
    assert "newest-first" in PLUGIN_SCORERS
    plain = registry.register(anonymous)  # no name: the function's
    assert plain.name == "anonymous"
    assert plain.description == f"plug-in function {__name__}.{anonymous.__qualname__}"

    class Nameless(plugins.Policy):
        def score(self, ctx):
            return np.zeros(ctx.n_positions)

    named = registry.register(Nameless, "My.Scorer_2-b")  # capitals, digits, _ . -
    assert isinstance(named, Nameless) and named.name == "My.Scorer_2-b" and get_policy("My.Scorer_2-b") is named
    assert named.description == f"plug-in {__name__}.{Nameless.__qualname__}"
    instance = Nameless()
    assert registry.as_policy(instance, "given") is instance and instance.name == "given"
    with pytest.raises(plugins.PluginError) as refused:
        registry.as_policy(Nameless)
    assert str(refused.value) == "plug-in Nameless has no `name`"


@pytest.mark.parametrize(
    "obj, name, message",
    [
        (42, None, "42 is not a kvviz Policy subclass or a score(ctx) function"),
        (newest, "9lives", "plug-in scorer name '9lives' must be a short identifier (letters, digits, _ . -)"),
        (newest, "h2o", "plug-in scorer 'h2o' would replace kvviz's built-in 'h2o'; give it another name"),
        (type("Unscored", (plugins.Policy,), {}), "unscored", "plug-in 'unscored' does not implement score(ctx)"),
    ],
)
def test_register_refuses_with_a_reason(registry, obj, name, message):
    with pytest.raises(plugins.PluginError) as refused:
        registry.register(obj, name)
    assert str(refused.value) == message
    assert name not in PLUGIN_SCORERS


class FakeEntryPoint:
    def __init__(self, name, value, load):
        self.name, self.value, self.load = name, value, load


def test_entry_points_load_once_under_their_own_names_and_failures_are_reported_once(registry, monkeypatch):
    """An entry point registers under its entry-point name; one that fails to load is skipped with one line
    (its message's first line, or the exception's type when it has no message); the group is read once
    unless forced, and a failure read twice is reported once."""
    import importlib.metadata

    def multi_line():
        raise ValueError("bad thing\nmore detail")

    def silent():
        raise RuntimeError()

    reads = []

    def entry_points(group):
        reads.append(group)
        return [
            FakeEntryPoint("fresh", "pkg:newest", lambda: newest),
            FakeEntryPoint("broken", "pkg:Broken", multi_line),
            FakeEntryPoint("quiet", "pkg:quiet", silent),
        ]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    registry._loaded_entry_points = False
    registry.ERRORS.clear()
    assert "fresh" in registry.load_entry_points() and reads == ["kvviz.policies"]
    assert POLICIES["fresh"].name == "fresh" and "newest" not in POLICIES
    want = [
        "plug-in 'broken' (pkg:Broken) could not be loaded: bad thing",
        "plug-in 'quiet' (pkg:quiet) could not be loaded: RuntimeError",
    ]
    assert registry.ERRORS == want
    registry.load_entry_points()
    get_policy("fresh")
    assert len(reads) == 1  # read once ...
    registry.load_entry_points(force=True)
    assert len(reads) == 2 and registry.ERRORS == want  # ... unless forced; no line twice


PLUGIN_SOURCE = '''
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvviz.policies import Policy


@dataclass
class Newest(Policy):
    """A dataclass with string annotations: dataclasses looks its module up in sys.modules while importing."""
    weight: float = 1.0
    name = "newest_file"

    def score(self, ctx) -> np.ndarray:
        return self.weight * np.arange(ctx.n_positions, dtype=np.float64)
'''


def test_load_file_imports_a_plugin_file_as_its_own_module(registry, tmp_path):
    import re

    folder = tmp_path / "a:b"  # a colon in the path, not only before Name
    folder.mkdir()
    first, second = folder / "plug.py", tmp_path / "plug.py"
    first.write_text(PLUGIN_SOURCE)
    second.write_text(PLUGIN_SOURCE.replace("newest_file", "newest_other"))
    try:
        a, b = registry.load_file(f"{first}:Newest"), registry.load_file(f"{second}:Newest")
        module = "kvviz_plugin_" + re.sub(r"\W", "_", str(first.resolve()))  # the path, every non-word char _
        assert type(a).__module__ == module and module.isidentifier()
        assert sys.modules[module].Newest is type(a)  # each file its own module (pickle finds it)
        assert sys.modules[type(b).__module__].Newest is type(b) and type(b) is not type(a)
        assert get_policy("newest_file") is a and a.description == f"plug-in {module}.Newest"
    finally:
        _forget()


@pytest.mark.parametrize("target", [":Newest", "plug.py:", "plug.py"])
def test_load_file_needs_a_path_and_a_name(registry, target):
    with pytest.raises(plugins.PluginError) as refused:
        registry.load_file(target)
    assert str(refused.value) == f"--policy takes path/to/file.py:ClassName, got {target!r}"


def test_load_file_that_fails_to_import_leaves_no_module_behind(registry, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1 / 0\n")
    before = set(sys.modules)
    with pytest.raises(plugins.PluginError) as refused:
        registry.load_file(f"{broken}:X")
    assert str(refused.value) == f"--policy: {broken} failed to import: ZeroDivisionError: division by zero"
    assert set(sys.modules) == before
