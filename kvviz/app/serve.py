"""The app's start: warm from the first second, whether started as `streamlit run app.py` or `make run`.

Streamlit runs no page code before the first browser session, so the first visitor paid for importing
the app (plotly, scipy, the app's modules: ~2 s on two cores) before anything was drawn. Two ways in:
- `streamlit run app.py`: app.py defines an `st.App` (Streamlit's ASGI server), so Streamlit imports it
  at start and runs its start-up hook, `lifespan` below, once the runtime exists: it turns Nagle's
  algorithm off on the listening socket (see `_no_delay`), hands each session's script events to the
  event loop in batches, and starts `_preload` in a thread.
- `python -m kvviz.app.serve [streamlit options]` (`make run`): the same `streamlit run app.py` in this
  process, with Streamlit's socket binding patched before the server binds, so even the very first
  connection is accepted with TCP_NODELAY; the hook then finds it done.
The bundled model still starts loading at the first page view (kvviz.app.sources.warm_up): on two
cores, loading torch at server start would slow the very first paint it is meant to help.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import sys
import threading
import time
from pathlib import Path

from kvviz.app import internals

APP = Path(__file__).resolve().parents[2] / "app.py"
PAGES_DIR = APP.parent / "pages"


def app_modules() -> tuple[str, ...]:
    """The kvviz modules app.py and the page scripts import at their top level, read from their source
    (app.py first: the Explorer is the usual first page), so the list cannot drift from the pages."""
    import ast

    def is_module(name: str) -> bool:  # by its file, without importing its package
        path = APP.parent.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found: dict[str, None] = {}
    for script in [APP, *sorted(PAGES_DIR.glob("*.py"))]:
        for node in ast.parse(script.read_text(encoding="utf-8")).body:
            names = (
                [(a.name, None) for a in node.names]
                if isinstance(node, ast.Import)
                else [(node.module, a.name) for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            for module, member in names:
                if not (module == "kvviz" or module.startswith("kvviz.")):
                    continue
                # `from kvviz.app import explorer`: a module
                sub = f"{module}.{member}" if member else None
                found[sub if sub and is_module(sub) else module] = None
    return tuple(found)


def _no_delay() -> None:
    """Send small writes at once (TCP_NODELAY) on every connection the server accepts.

    Streamlit (1.67) binds its listening socket itself as socket.socket(family) -- protocol 0, so
    asyncio, which turns Nagle's algorithm off only on sockets whose protocol is IPPROTO_TCP, leaves it
    on for every accepted connection. Each response written as headers then body, and each websocket
    message after an unacknowledged one, then waits for the browser's delayed ACK: 40 ms per static
    file on a reused connection (the page's 60 scripts took 0.4 s over six connections instead of
    0.06 s). Set on the listening socket, the option is inherited by the sockets it accepts (Linux)."""
    internals.bind_no_delay()


def _preload(wait_s: float = 30.0) -> None:
    """Once the runtime exists (Streamlit's caches bind to it when a decorated function is defined),
    import the app's modules and start its warm-up. Any failure only leaves the work to the first run."""
    import importlib

    deadline = time.monotonic() + wait_s
    while not internals.runtime_exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not internals.runtime_exists():
        return
    try:
        internals.ask_first_element_check()
        for name in app_modules():
            importlib.import_module(name)
        from kvviz.app.compute import warm_up

        # the kernel and the first move's modules; the bundled model waits for the first page view
        warm_up()
    except Exception:  # noqa: BLE001 - the first page run imports (and reports) the same itself
        pass


def _listening_sockets() -> list[socket.socket]:
    """The TCP sockets of this process that listen: the server's. Streamlit's ASGI mode binds its socket
    before importing the app and hands it to uvicorn, and neither exposes it to the app's hook; the
    garbage collector's list of live objects does (a few ms once at start)."""
    found = []
    for obj in gc.get_objects():
        # type(), not isinstance(): a proxy object (torch has some) can warn when asked its __class__
        if issubclass(type(obj), socket.socket) and obj.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a closed socket: fileno -1
                if obj.fileno() >= 0 and obj.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    found.append(obj)
    return found


def start_warm() -> None:
    """What the start-up hook does, once per process: TCP_NODELAY on the listening sockets (inherited by
    every connection accepted from now on, Linux), a session's script events handed to the event loop in
    batches (kvviz.app.internals.batch_script_events), and the preload thread."""
    with _started_lock:
        if _started:
            return
        _started.append(True)
    no_delay_on_listening()
    internals.batch_script_events()
    threading.Thread(target=_preload, name="kvviz-preload", daemon=True).start()


def no_delay_on_listening() -> int:
    """TCP_NODELAY on every listening TCP socket of this process (see `_no_delay` for why); how many."""
    done = 0
    for sock in _listening_sockets():
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            done += 1
    return done


_started: list = []
_started_lock = threading.Lock()


@contextlib.asynccontextmanager
async def lifespan(app):
    """app.py's st.App start-up hook: runs once the server's runtime exists, before the first request."""
    from kvviz.app.router import no_legacy_pages

    no_legacy_pages()
    start_warm()
    yield


def local_command(port: int, app: Path = APP, launcher: bool = False) -> list[str]:
    """The command that serves `app` on 127.0.0.1:PORT for a test or a benchmark: headless, no usage stats,
    no file watching or rerun on save. launcher=True starts it as `make run` does (this module, which
    serves this checkout's app.py), else as `streamlit run APP`."""
    import shutil

    streamlit = shutil.which("streamlit", path=str(Path(sys.executable).parent)) or "streamlit"
    start = [sys.executable, "-m", "kvviz.app.serve"] if launcher else [streamlit, "run", str(app)]
    return [
        *start,
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        "127.0.0.1",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--server.runOnSave",
        "false",
    ]


def main(argv: list[str] | None = None) -> None:
    _no_delay()
    internals.streamlit_run([str(APP), *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
