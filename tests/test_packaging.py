"""A wheel of kvviz carries every file the package reads: `pip install kvviz` (not only the editable
install of `make venv`) must find the sample text, the shipped needle grid and the lesson template."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_every_file_the_package_ships(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to list the package's files")
    tracked = subprocess.run(
        ["git", "ls-files", "kvviz"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    shipped = {f for f in tracked if not f.endswith(".py")}
    assert {"kvviz/data/sample.txt", "kvviz/data/needle_default.json.gz"} <= shipped
    source = tmp_path / "src"  # a clean copy: no build/ or egg-info of the checkout leaks in
    for f in tracked + ["pyproject.toml"]:
        (source / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, source / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("kvviz-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert shipped <= names, sorted(shipped - names)
    assert {f for f in tracked if f.endswith(".py")} <= names
