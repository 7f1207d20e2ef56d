"""Adding a built-in scorer is one file in kvviz/policies/ (docs/plugins.md): a copy of the app with one more
file there, its setting declared in it, and nothing else edited; the scorer is then in the registry and the
scorer menus of every page, the link, the command line (its setting's flag too), a study's grid and the
eval sweep (with its merged twin). The copy runs in a subprocess, so this process's registry stays as it is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCORER = '''"""Oldest first: keeps the earliest tokens beyond the sinks (a test's scorer)."""

import numpy as np

from kvviz.policies.base import Policy, ScoreContext
from kvviz.settings import Setting, declare

declare(
    Setting("oldest_tilt", "float", 0.0, 0.0, 1.0, url="old_tilt", owner=("scorer", "oldest"),
            label="Oldest first: tilt", help="how much a later token loses")
)


class Oldest(Policy):
    name = "oldest"
    order = 990
    title = "Oldest first"
    colour = "#117733"
    symbol = "diamond-wide"
    description = "the earliest tokens first"

    def score(self, ctx: ScoreContext) -> np.ndarray:
        ranks = -np.arange(ctx.n_positions, dtype=np.float64) * (1.0 + ctx.spec.oldest_tilt)
        return np.broadcast_to(ranks, (ctx.trace.n_kv_heads, ctx.n_positions))
'''

CHECK = '''
import io, json, sys
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, "tests")
from apptest_util import run_app
from kvviz.analysis.study.grid import parse_study, cells
from kvviz.cli import main
from kvviz.decode.eval_sweep import SWEEP_METHODS
from kvviz.links import PARAMS
from kvviz.policies import POLICIES

out = {"registry": "oldest" in POLICIES, "sweep": ["oldest" in SWEEP_METHODS, "merge-oldest" in SWEEP_METHODS],
       "link": ["oldest" in PARAMS["scorer"].choices, "old_tilt" in PARAMS]}
buf = io.StringIO()
with redirect_stdout(buf):
    code = main(["compare", "--scorer", "oldest", "--oldest-tilt", "0.5", "--sink", "2", "--recent", "2",
                 "--heavy", "4", "--json"])
result = json.loads(buf.getvalue())
out["cli"] = [code, result["spec"]["scorer"], result["spec"]["oldest_tilt"], sum(result["kept"])]
study = parse_study("""name = "one-file"
[source]
kind = "synthetic"
context = 64
seeds = [0]
[grid]
scorers = ["oldest", "h2o"]
budgets = [0.25]
oldest_tilt = [0.0, 0.5]
""")
out["study"] = sorted({(c.settings["scorer"], c.settings.get("oldest_tilt", 0.0)) for c in cells(study)})
pages = {}
for page in ["app.py", *sorted(str(p) for p in Path("pages").glob("*.py"))]:
    at = run_app(str(Path(page).resolve()), 300, opened=("_advanced_open",), scorer="oldest", old_tilt="0.5")
    menus = [list(b.options) for b in at.selectbox if b.label == "Heavy-hitter scorer"]
    pages[page] = [bool(menus) and any("Oldest first" in o for o in menus[0]),
                   at.session_state["_kvviz_state"]["scorer"], [e.value for e in at.error]]
out["pages"] = pages
print("RESULT" + json.dumps(out))
'''


@pytest.mark.slow
def test_a_scorer_is_one_file_and_then_everywhere(tmp_path):
    copy = tmp_path / "kvviz-copy"
    copy.mkdir()
    # __pycache__ comes along: the copy keeps the modules' bytecode and numba's compiled quantization kernel
    # (both still valid, copytree keeps the files' times), which halves what the copy's run costs (32 -> 15
    # CPU-s). The new scorer's file has none and is compiled.
    for name in ("kvviz", "pages", "tests", ".streamlit"):
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("data"))
    shutil.copytree(ROOT / "kvviz" / "data", copy / "kvviz" / "data")
    shutil.copy(ROOT / "app.py", copy / "app.py")
    (copy / "kvviz" / "policies" / "oldest.py").write_text(SCORER, encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PYTHONPATH": str(copy),
            "HF_HUB_OFFLINE": "1",
            "KVVIZ_WARMUP": "0",
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
        },
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, run.stderr[-3000:]
    got = json.loads(line[len("RESULT") :])
    assert got["registry"] and got["sweep"] == [True, True] and got["link"] == [True, True]
    assert got["cli"] == [0, "oldest", 0.5, 8]
    assert ["oldest", 0.0] in got["study"] and ["oldest", 0.5] in got["study"]
    assert len(got["pages"]) == 8
    for page, (menu, scorer, errors) in got["pages"].items():
        assert scorer == "oldest" and errors == [], (page, scorer, errors)
        if page.endswith("app.py"):  # the Explorer's Advanced menu offers it by its title
            assert menu, page
