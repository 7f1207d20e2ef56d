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

from conftest import BROWSER_SECOND

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_module_with_its_own_fixture_is_one_xdist_group():
    pytest.importorskip("xdist")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
         "tests/test_metrics.py", "-k", "no_compression_gives_zero_divergence or handbook_kl_is_minus_log"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = re.findall(r"^PASSED (\S+)", out.stdout, re.M)
    # the module-scoped `trace` fixture: grouped; a test without it: no group (any worker)
    assert sorted(passed) == ["tests/test_metrics.py::test_handbook_kl_is_minus_log_of_the_mass_kept",
                              "tests/test_metrics.py::test_no_compression_gives_zero_divergence@test_metrics"], passed


def test_the_second_browser_group_names_browser_tests_that_exist():
    """A renamed browser test would silently move to the first group and unbalance the two."""
    source = (ROOT / "tests" / "test_browser.py").read_text()
    for name in BROWSER_SECOND:
        assert (ROOT / "tests" / f"{name}.py").is_file() or re.search(rf"^def {name}\(", source, re.M), name
