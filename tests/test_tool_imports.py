"""The benchmarks and scripts name kvviz's modules and functions that exist.

They run by hand, not in the suite, and most import kvviz inside `main`, so a function that moved in a
split (kvviz.plots.decode's timeline_animation, once) left a benchmark that failed only when someone ran it.
Every `import kvviz...` and `from kvviz... import names` in them, inside functions too, must resolve."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")])


def kvviz_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every kvviz import in the file, wherever it stands (names: [] for `import`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvviz":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "kvviz"]
    return found


def test_the_tools_import_kvviz():
    assert sum(bool(kvviz_imports(p)) for p in TOOLS) >= 15, "the benchmarks and scripts are where they were"


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_kvviz_name_a_tool_imports_exists(path: Path):
    for line, module_name, names in kvviz_imports(path):
        module = importlib.import_module(module_name)
        for name in names:
            # a submodule imported by name (from kvviz.analysis import needle) is an attribute once imported
            found = hasattr(module, name) or (
                hasattr(module, "__path__") and importlib.util.find_spec(f"{module_name}.{name}") is not None
            )
            assert found, f"{path.name}:{line}: {module_name} has no {name}"
