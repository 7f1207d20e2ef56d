"""The suite's own xdist groups (tests/conftest.py) take effect: under `--dist loadgroup` a test of a module
with its own module-scoped fixture carries its group in its id (`path::test@group`), the key by which
pytest-xdist hands the whole module to one worker, which builds the fixture once. With pytest 9 and
pytest-xdist 3.8 every group was silently dropped (xdist writes the suffix where pytest 9 no longer reads
it): each module fixture was built in both workers and the browser tests ran wherever they fell."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BROWSER_SECONDS, _browser_groups, slow_first

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_module_with_its_own_fixture_is_one_xdist_group():
    pytest.importorskip("xdist")
    # One worker is enough: the group suffix is written by each worker's collection under `--dist loadgroup`,
    # whatever the number of workers; a second worker (a third Python importing the suite) cost 2 s of CPU.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-n",
            "1",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            "tests/test_metrics.py",
            "-k",
            "no_compression_gives_zero_divergence or handbook_kl_is_minus_log",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = re.findall(r"^PASSED (\S+)", out.stdout, re.M)
    # the module-scoped `trace` fixture: grouped; a test without it: no group (any worker)
    assert sorted(passed) == [
        "tests/test_metrics.py::test_handbook_kl_is_minus_log_of_the_mass_kept",
        "tests/test_metrics.py::test_no_compression_gives_zero_divergence@test_metrics",
    ], passed


def test_the_browser_weights_name_browser_tests_that_exist():
    """A renamed browser test would silently lose its weight and unbalance the groups."""
    source = (ROOT / "tests" / "test_browser.py").read_text()
    for name in BROWSER_SECONDS:
        assert (ROOT / "tests" / f"{name}.py").is_file() or re.search(rf"^def {name}\(", source, re.M), name


def test_the_browser_tests_are_dealt_heaviest_first_onto_the_lightest_group(monkeypatch):
    """One group per worker; the weights (a test_browser.py test's own, another module's whole) are dealt
    heaviest first onto the lightest group; another module's browser tests stay together (its fixtures)."""
    import conftest

    weights = {
        "test_explorer_link_follows_every_single_interaction": 32,
        "test_model_lab_cancel_stops_the_run_and_keeps_the_previous_results": 37,
        "test_every_page_opens_from_the_explorer_fits_a_projector_and_links_its_first_move": 8,
        "test_layout_browser": 30,
    }
    monkeypatch.setattr(conftest, "BROWSER_SECONDS", weights)  # these numbers, not today's measured ones
    monkeypatch.setattr(conftest, "BROWSER_UNKNOWN", 15)

    class Item:
        def __init__(self, module, name):
            self.path, self.name, self.originalname = (Path(f"tests/{module}.py"), name, name.split("[")[0])
            self.nodeid = f"tests/{module}.py::{name}"

    every_page = "test_every_page_opens_from_the_explorer_fits_a_projector_and_links_its_first_move"
    items = [
        Item("test_browser", "test_explorer_link_follows_every_single_interaction"),  # 32
        Item("test_browser", "test_model_lab_cancel_stops_the_run_and_keeps_the_previous_results"),  # 37
        Item("test_browser", f"{every_page}[a]"),
        Item("test_browser", f"{every_page}[b]"),  # 8 each
        Item("test_layout_browser", "test_one"),
        Item("test_layout_browser", "test_two"),  # 30, whole
        Item("test_browser", "test_not_weighed_yet"),
    ]  # 15
    group = _browser_groups(items, 2)
    assert group == {
        items[1].nodeid: "browser-1",
        items[0].nodeid: "browser-2",
        items[4].nodeid: "browser-2",
        items[5].nodeid: "browser-2",  # 32 + 30 onto 37 ...
        items[6].nodeid: "browser-1",
        items[2].nodeid: "browser-1",  # 37 + 15 + 8 = 60
        items[3].nodeid: "browser-1",
    }  # + 8 = 68 vs 62
    assert set(_browser_groups(items, 1).values()) == {"browser-1"}
    assert len(set(_browser_groups(items, 4).values())) == 4


def test_slow_tests_outside_a_group_come_first_and_the_rest_keep_their_order():
    class Item:
        def __init__(self, name, *marks):
            self.name, self.marks = name, marks

        def get_closest_marker(self, mark):
            return mark if mark in self.marks else None

    items = [
        Item("a"),
        Item("slow grouped", "slow", "xdist_group"),
        Item("b"),
        Item("slow", "slow"),
        Item("c", "xdist_group"),
        Item("slow too", "slow"),
    ]
    assert [i.name for i in slow_first(items)] == ["slow", "slow too", "a", "slow grouped", "b", "c"]
