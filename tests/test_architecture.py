"""The house rules (docs/architecture.md), read from the code with `ast`: every import counts,
the ones inside functions too, so a lazy import cannot hide a circle or a layer break.

- no import circle among kvviz's modules (a package re-exporting its own children is not one);
- a module imports only its own layer or lower ones (LAYERS);
- Streamlit only in kvviz/app, app.py and pages/; plotly only in kvviz/plots and kvviz/app;
  torch / transformers only on the real-model side, and never at import time;
- no module past MAX_LINES lines, no family of top-level modules sharing a prefix;
- pages are thin: no numerics (numpy, pandas, torch) and no engine calls of their own;
- every package's __init__ says what it is for and what it may import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvviz"
MAX_LINES = 600


# Lower number = lower layer. Data flows up: source -> trace -> policies / quantizers -> engine ->
# metrics -> analyses -> plots -> app. A module may import its own layer and the ones below. The layers
# are read from docs/architecture.md's table, so the document and what this test enforces are one.
def doc_layers(text: str | None = None) -> dict[str, int]:
    """docs/architecture.md's layer table (its first code block) as {module or package: layer}: a row
    starts with its layer's number or continues the layer above; its first words name the modules
    (`app/`, `engine.py`, `kvviz/__init__`) until a word that is not one."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8") if text is None else text
    layers, layer = {}, None
    for line in text.split("```")[1].splitlines():
        m = re.match(r"^ ?(\d)? {1,3}(?=\S)(.*)$", line)  # a row of names (deeper: a description goes on)
        if not m:
            continue
        layer = int(m.group(1)) if m.group(1) else layer
        for word in m.group(2).split(" "):
            if word == "kvviz/__init__":
                layers["kvviz"] = layer
            elif re.fullmatch(r"[a-z_]+(\.py|/)", word):
                layers["kvviz." + word.removesuffix(".py").removesuffix("/")] = layer
            elif word:
                break
    return layers


LAYERS = doc_layers()
NEVER = {("kvviz.cli", "kvviz.app"), ("kvviz.app", "kvviz.cli")}  # same layer, no business with each other

# Third-party packages that only some layers may import.
ONLY_IN = {
    "streamlit": ("kvviz.app",),
    "plotly": ("kvviz.plots", "kvviz.app"),
    "torch": (
        "kvviz.models",
        "kvviz.sources.capture",
        "kvviz.sources.recorder",
        "kvviz.decode",
        "kvviz.analysis.needle",
    ),
    "transformers": (
        "kvviz.models",
        "kvviz.sources.capture",
        "kvviz.sources.recorder",
        "kvviz.decode",
        "kvviz.analysis.needle",
    ),
    "pyarrow": ("kvviz.analysis.study",),  # the study results' part files
    "ray": ("kvviz.analysis.study.engines",),  # the optional engine, one module
}
HEAVY = ("torch", "transformers", "ray")  # never imported at module level: `import kvviz` must stay fast


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def resolve(name: str, modules=MODULES) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, mod: str | None = None, modules=MODULES):
    """(target module, top level?, line) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    mod = mod or module_name(path)
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, id(node) in top, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, id(node) in top, node.lineno
            for a in node.names:  # `from kvviz.decode import cache` names a module
                if f"{target}.{a.name}" in modules:
                    yield f"{target}.{a.name}", id(node) in top, node.lineno


def graph(modules=MODULES) -> dict[str, set[str]]:
    g: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        for target, _, _ in imports(path, mod, modules):
            if target.split(".")[0] == "kvviz":
                r = resolve(target, modules)
                # a package importing its own children (re-exports in __init__) is not a circle
                if r and r != mod and not r.startswith(mod + "."):
                    g[mod].add(r)
    return g


def layer_of(mod: str) -> tuple[str, int]:
    name = mod
    while name not in LAYERS:
        name = name.rpartition(".")[0]
    return name, LAYERS[name]


def test_every_module_has_a_layer():
    for mod in MODULES:
        name = mod
        while name and name not in LAYERS:
            name = name.rpartition(".")[0]
        assert name, f"{mod} is in no layer: add its package to LAYERS (and to docs/architecture.md)"


def find_circle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(g[v]):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(g):
        if v not in state:
            circle = visit(v)
            if circle:
                return circle
    return None


def test_no_import_circle():
    circle = find_circle(graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def layer_breaks(modules=MODULES) -> list[str]:
    wrong = []
    for mod, path in modules.items():
        mine, rank = layer_of(mod)
        for target, _, line in imports(path, mod, modules):
            r = resolve(target, modules) if target.split(".")[0] == "kvviz" else None
            if not r or r == mod or r.startswith(mod + "."):
                continue
            theirs, their_rank = layer_of(r)
            if their_rank > rank or (mine, theirs) in NEVER:
                wrong.append(f"{path.name}:{line} ({mine}, layer {rank}) imports {r} ({theirs}, layer {their_rank})")
    return wrong


def test_imports_follow_the_layers():
    wrong = layer_breaks()
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_third_party_packages_stay_in_their_layers():
    wrong = []
    for mod, path in MODULES.items():
        for target, top, line in imports(path):
            root = target.split(".")[0]
            if root in ONLY_IN and not any(mod == p or mod.startswith(p + ".") for p in ONLY_IN[root]):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {root}")
            if root in HEAVY and top:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {root} at module level (import it lazily)")
    assert not wrong, "\n".join(wrong)


def test_streamlit_only_in_the_app_and_pages():
    outside = [p for p in ROOT.glob("*.py") if p.name != "app.py"] + list(PKG.rglob("*.py"))
    for path in outside:
        if module_name(path).startswith("kvviz.app"):
            continue
        assert not any(t.split(".")[0] == "streamlit" for t, _, _ in imports(path)), path


def test_rooms_are_small_and_families_are_packages():
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert not [m for m, n in long.items() if n > MAX_LINES], {m: n for m, n in long.items() if n > MAX_LINES}
    top = [p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__")]
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    prefixes = defaultdict(list)
    for name in top:
        prefixes[name.split("_")[0]].append(name)
    families = {k: v for k, v in prefixes.items() if len(v) > 1 or (k in packages and v != [k])}
    assert not families, f"top-level modules sharing a prefix (make them a package): {families}"
    assert not set(top) & packages, f"a module beside a package of the same name: {set(top) & packages}"


# Where a built-in scorer may be named outside its own file: the default setting (spec.py) and the presets,
# whose content is a named method. Everything else asks the scorer (Policy.featured, .bound, .window_only,
# .allocated_in_sweeps, ...) or the registry, so that a new scorer needs no edit outside kvviz/policies/.
SCORER_NAMED_IN = {"kvviz/spec.py", "kvviz/app/presets.py"}


def scorer_literals(paths, names) -> list[str]:
    """`path:line 'name'` for each string constant that is a scorer's name, or a comma list holding one."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            words = node.value.split(",") if " " not in node.value else [node.value]
            if any(w in names for w in words):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    return found


def test_scorers_are_named_only_in_their_own_files():
    from kvviz.spec import SCORERS

    import kvviz.policies  # noqa: F401  (fills SCORERS)

    paths = [
        p
        for p in [*PKG.rglob("*.py"), *(ROOT / "pages").glob("*.py"), ROOT / "app.py"]
        if "policies" not in p.relative_to(PKG if p.is_relative_to(PKG) else ROOT).parts
        and str(p.relative_to(ROOT)) not in SCORER_NAMED_IN
    ]
    assert scorer_literals(paths, set(SCORERS)) == []
    # and the check sees them where they are allowed: the presets name their methods
    assert scorer_literals([PKG / "app" / "presets.py"], set(SCORERS)), "the check finds nothing"


def test_charts_are_drawn_through_kvviz_app_charts():
    """Every plotly chart goes through kvviz.app.charts.chart, which leaves it as a frame until the browser's
    first paint: one st.plotly_chart called directly would hold the page's first paint back again."""
    called = []
    for path in [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), *sorted((PKG / "app").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "plotly_chart" and path.name != "charts.py":
                called.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not called, f"st.plotly_chart called directly (use kvviz.app.charts.chart): {called}"


def test_pages_are_thin():
    numeric = {"numpy", "pandas", "torch", "transformers", "scipy"}
    for page in [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py"))]:
        names = {t.split(".")[0] for t, _, _ in imports(page)}
        assert not names & numeric, f"{page.name} imports {names & numeric}: numerics belong in kvviz"
        assert "kvviz.engine" not in {t for t, _, _ in imports(page)}, f"{page.name} calls the engine directly"


def test_every_package_says_what_it_is_for():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 8, f"{init.relative_to(ROOT)} needs a docstring: what the package is for"
        if init.parent != PKG:
            assert "import" in doc, f"{init.relative_to(ROOT)}: say what the package may import"


@pytest.mark.parametrize(
    "module",
    [
        "kvviz",
        "kvviz.sources",
        "kvviz.analysis.sweep",
        "kvviz.analysis.solve",
        "kvviz.analysis.ledger",
        "kvviz.analysis.timeline",
        "kvviz.analysis.needle",
        "kvviz.analysis.study",
        "kvviz.decode",
        "kvviz.models",
        "kvviz.plots.figures",
        "kvviz.cli",
    ],
)
def test_the_handbook_path_starts_without_torch(module):
    code = f"import sys, {module}; print(any(m in sys.modules for m in ('torch', 'transformers', 'streamlit', 'ray')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} loads torch, transformers, Streamlit or Ray"


def test_the_rules_catch_what_they_claim(tmp_path):
    """The checker itself, on a made-up tree: a lazy import closing a circle, an engine that imports
    a plot, and a package re-exporting its children (allowed) are each judged as they should be."""
    sources = {
        "kvviz.engine": "from kvviz.plots.figures import attention_figure\n",  # a layer break
        "kvviz.plots.figures": "import numpy\n\ndef f():\n    from kvviz.plots import style\n",
        "kvviz.plots.style": "def g():\n    import kvviz.plots.figures\n",  # a lazy circle
        "kvviz.policies": "from kvviz.policies.h2o import H2O\n",  # re-export: fine
        "kvviz.policies.h2o": "from kvviz.policies import base\n",
        "kvviz.policies.base": "from kvviz.spec import Spec\n",
        "kvviz.spec": "",
    }
    modules = {}
    for mod, src in sources.items():
        path = tmp_path / f"{mod}.py"
        path.write_text(src)
        modules[mod] = path
    g = graph(modules)
    assert "kvviz.plots.figures" in g["kvviz.plots.style"]  # the lazy import is seen
    assert set(find_circle(g)) == {"kvviz.plots.figures", "kvviz.plots.style"}
    assert "kvviz.policies.h2o" not in g["kvviz.policies"]  # a package's own children
    assert layer_breaks(modules) == [
        "kvviz.engine.py:1 (kvviz.engine, layer 3) imports kvviz.plots.figures (kvviz.plots, layer 6)"
    ]
    del sources["kvviz.plots.style"], modules["kvviz.plots.style"]
    assert find_circle(graph(modules)) is None


def test_the_launcher_preloads_what_the_pages_import_and_nothing_heavy():
    """`make run` imports the app's modules before the first visitor (kvviz.app.serve): the list is read
    from app.py and the page scripts, so a page's new section is preloaded too; none of it is torch."""
    import subprocess
    import sys

    from kvviz.app.serve import app_modules

    modules = app_modules()
    assert modules[0].startswith("kvviz.") and len(set(modules)) == len(modules)
    assert {
        "kvviz.app.sidebar",
        "kvviz.app.explorer",
        "kvviz.app.studies",
        "kvviz.plots.figures",
        "kvviz.analysis.frames",
        "kvviz.app.modellab",
    } <= set(modules)
    code = (
        "import sys, importlib; import streamlit; from kvviz.app.serve import app_modules\n"
        "for m in app_modules(): importlib.import_module(m)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_layers_are_read_from_the_documents_table():
    """A row's number starts a layer, a row without one continues it, its first words are the modules until
    a word that is not one, and a description's continuation (indented deeper) names none."""
    table = """
```
 2  sources/  handbook, synthetic              core
    quant/    one format a file                core
              registry (built-ins)
 1  attention.py   attention rows             trace
 0  trace.py spec.py settings.py             nothing
    kvviz/__init__   the library API
```"""
    assert doc_layers(table) == {
        "kvviz.sources": 2,
        "kvviz.quant": 2,
        "kvviz.attention": 1,
        "kvviz.trace": 0,
        "kvviz.spec": 0,
        "kvviz.settings": 0,
        "kvviz": 0,
    }
    assert {"kvviz.app", "kvviz.cli", "kvviz.engine", "kvviz.trace"} <= set(LAYERS)  # the real table, read
