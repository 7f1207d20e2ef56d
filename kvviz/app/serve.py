"""`python -m kvviz.app.serve [streamlit options]`: `streamlit run app.py`, warm from the start.

Streamlit runs no app code before the first browser session, so the first visitor paid for importing
the app (plotly, scipy, the app's modules: ~2 s on two cores) before anything was drawn. This
launcher starts Streamlit's own server in this process (its CLI, unchanged options) and, once the
server's runtime exists, imports what app.py imports and starts the app's background warm-up (the
quantization kernel, the first move's modules) in a thread -- so the first page view finds them
ready. The bundled model still starts loading at the first page view (kvviz.app.sources.warm_up): on
two cores, loading torch at server start would slow the very first paint it is meant to help. Streamlit has no start-up hook for this (its options cover the
server, not the app), hence our own few lines. `make run` uses it; `streamlit run app.py` still works,
only with a slower first paint.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app.py"
PAGES_DIR = APP.parent / "app_pages"


def app_modules() -> tuple[str, ...]:
    """The kvviz modules app.py and the page scripts import at their top level, read from their source
    (app.py first: the Explorer is the usual first page), so the list cannot drift from the pages."""
    import ast

    def is_module(name: str) -> bool:        # by its file, without importing its package
        path = APP.parent.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found: dict[str, None] = {}
    for script in [APP, *sorted(PAGES_DIR.glob("*.py"))]:
        for node in ast.parse(script.read_text(encoding="utf-8")).body:
            names = ([(a.name, None) for a in node.names] if isinstance(node, ast.Import) else
                     [(node.module, a.name) for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            for module, member in names:
                if not (module == "kvviz" or module.startswith("kvviz.")):
                    continue
                sub = f"{module}.{member}" if member else None   # `from kvviz.app import explorer`: a module
                found[sub if sub and is_module(sub) else module] = None
    return tuple(found)


def _preload(wait_s: float = 30.0) -> None:
    """Once the runtime exists (Streamlit's caches bind to it when a decorated function is defined),
    import the app's modules and start its warm-up. Any failure only leaves the work to the first run."""
    import importlib

    from streamlit.runtime import Runtime

    deadline = time.monotonic() + wait_s
    while not Runtime.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not Runtime.exists():
        return
    try:
        for name in app_modules():
            importlib.import_module(name)
        from kvviz.app.compute import warm_up
        warm_up()   # the kernel and the first move's modules; the bundled model waits for the first page view
    except Exception:  # noqa: BLE001 - the first page run imports (and reports) the same itself
        pass


def main(argv: list[str] | None = None) -> None:
    from streamlit.web import cli

    threading.Thread(target=_preload, name="kvviz-preload", daemon=True).start()
    sys.argv = ["streamlit", "run", str(APP), *(sys.argv[1:] if argv is None else argv)]
    cli.main()


if __name__ == "__main__":
    main()
