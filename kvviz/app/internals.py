"""Streamlit's private parts that kvviz leans on, all in this one module (verified on the pinned 1.67.0).

Each has no public form, and each buys something measured; tests/test_streamlit_internals.py checks
that every one is still where and what this module expects, so a Streamlit upgrade that moves one fails
there, loudly, not somewhere in a page. Where one is gone, the caller falls back to Streamlit's own
behaviour (said at each function).

- `streamlit_run`: `streamlit run` in this process (`make run`: the binding below is wrapped first).
- `bind_no_delay`: Streamlit's socket binding (`starlette_server._bind_socket`), wrapped to set
  TCP_NODELAY: 40 ms per static file and per websocket message after an unacknowledged one otherwise
  (kvviz.app.serve).
- `batch_script_events`: a session's script events handed to the event loop in batches
  (`AppSession._call_soon_on_event_loop`): one wake-up of the loop per batch, not one per element (a
  class of thirty: server CPU per move 51.2 -> 41.3 ms, kvviz.app.serve); and on the loop's own thread
  the flush asked for without a wake-up (`Runtime._enqueued_some_message`, and the session manager's
  copy of it: 49.0 -> 43.3 ms).
- `ask_first_element_check`: Streamlit's once-per-process REPL check, asked at start (~0.1 s of the
  first visitor's run on two cores otherwise).
- `runtime_exists`: whether the server's runtime is up (the start-up preload waits for it).
- `run_context`, `run_yield_check`: the script run's context and its cancel check (a long computation
  stops when the page reruns: kvviz.limits).
- `pages_manager`, `set_legacy_pages`, `legacy_pages`: the address a request asked for (an old page
  address pointed at its page) and the legacy pages/ flag st.navigation sets on its first run (set at
  start, a fresh server's first request takes the app's own navigation: kvviz.app.router).
- `plotly_chunk`: the file name of the plotly code Streamlit ships (a 4.7 MB chunk beside its main
  script that sets `window.Plotly` when evaluated). kvviz.app.livechart draws every chart with it, in
  place: a slider move's redraw of the Explorer's two charts became a `Plotly.react` of what changed
  (move -> charts redrawn, median 0.32 -> 0.27 s, benchmarks/browser.py), and a first visit needs no
  second run to draw them (charts drawn 3.01 -> 2.59 s).

The app's JavaScript and CSS also read a few of Streamlit's DOM hooks: `data-testid` attributes
(kvviz.app.layout's styles), the main script's `<script type="module">` tag (livechart finds the
chunk beside it) and the `st-key-<key>` class of a keyed element (charts' step reporter). The browser
tests that use them fail when one goes (tests/test_browser.py, tests/test_layout_browser.py).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from pathlib import Path

VERIFIED = "1.67.0"  # the Streamlit these were read from (requirements.txt pins it)


def streamlit_run(args: list[str]) -> None:
    """`streamlit run ARGS` in this process, as the `streamlit` command runs it."""
    import sys

    from streamlit.web import cli

    sys.argv = ["streamlit", "run", *args]
    cli.main()


def bind_no_delay() -> bool:
    """Wrap Streamlit's socket binding so the listening socket (and every connection it accepts, Linux)
    sends small writes at once. Returns whether it is wrapped; where the function moved, the server
    starts as Streamlit binds it."""
    from streamlit.web.server.starlette import starlette_server

    bind = getattr(starlette_server, "_bind_socket", None)
    if bind is None:
        return False
    if getattr(bind, "no_delay", False):
        return True

    def bound(address: str, port: int, backlog: int) -> socket.socket:
        sock = bind(address, port, backlog)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    bound.no_delay = True
    starlette_server._bind_socket = bound
    return True


def batch_script_events() -> bool:
    """One wake-up of the server's event loop per batch of a session's script events, not one per element.

    Streamlit hands each event of a script run (every element's message among them) from the script's
    thread to the event loop with its own `call_soon_threadsafe` (`AppSession._call_soon_on_event_loop`):
    each writes a byte to the loop's self-pipe and wakes the loop's thread, and with two cores busy that
    wake-up is the writer's CPU (a tenth of the server's, read with py-spy under a class's load). Here a
    session's events wait in its own list, in order, and the loop takes the whole list at one wake-up. A
    class of thirty (`benchmarks/load.py 30 20`, six interleaved pairs): server CPU per move 51.2 ->
    41.3 ms, wait per move 1.39 -> 1.14 s. Returns whether it is in place; where the method moved,
    Streamlit schedules each event by itself, as before."""
    import threading

    from streamlit.runtime import app_session

    session = app_session.AppSession
    own = getattr(session, "_call_soon_on_event_loop", None)
    if own is None:
        return False
    if getattr(own, "batched", False):
        _flush_without_wake_up()  # a runtime made since the first call: its manager's copy bound too
        return True
    lock = threading.Lock()  # guards every session's list: held for an append or a swap only

    def call_soon(self, callback) -> None:
        with lock:
            pending = self.__dict__.setdefault("_kvviz_pending", [])
            pending.append(callback)
            first = len(pending) == 1
        if not first:
            return  # the loop has a drain of this list coming
        try:
            self._event_loop.call_soon_threadsafe(drain, self)
        except RuntimeError:  # the loop is closed (shutdown): Streamlit drops the event as well
            if not self._event_loop.is_closed():
                raise

    def drain(self) -> None:
        with lock:
            batch, self._kvviz_pending = self._kvviz_pending, []
        for callback in batch:
            try:
                callback()
            except Exception as e:  # noqa: BLE001 - as the loop treats a failed callback: reported, the rest run
                self._event_loop.call_exception_handler({"message": "Exception in a script event", "exception": e})

    call_soon.batched, call_soon.original = True, own
    session._call_soon_on_event_loop = call_soon
    _flush_without_wake_up()
    return True


def _flush_without_wake_up() -> None:
    """The loop, enqueuing a drained message, asks for the flush through `call_soon_threadsafe` too: on its
    own thread that is one more write to its self-pipe per element. There it now sets the flush event
    itself (a class of thirty, four interleaved pairs: server CPU per move 49.0 -> 43.3 ms, wait per move
    1.36 -> 1.20 s). The runtime gave its session manager the bound method when it was made, before the
    app's start-up hook: the manager's copy is bound again."""
    import asyncio

    from streamlit.runtime import Runtime

    own = Runtime._enqueued_some_message
    if not getattr(own, "batched", False):

        def enqueued(self) -> None:
            objs = self._get_async_objs()
            try:
                on_loop = asyncio.get_running_loop() is objs.eventloop
            except RuntimeError:  # no loop runs in this thread
                on_loop = False
            if on_loop:
                objs.need_send_data.set()
            else:
                own(self)

        enqueued.batched, enqueued.original = True, own
        Runtime._enqueued_some_message = enqueued
    if Runtime.exists():
        manager = getattr(Runtime.instance(), "_session_mgr", None)
        if getattr(manager, "_message_enqueued_callback", None) is not None:
            manager._message_enqueued_callback = Runtime.instance()._enqueued_some_message


def ask_first_element_check() -> None:
    """Streamlit's check, made when a script draws its first element, of whether it runs in a REPL
    (inspect.stack() over the whole stack): asked now, the first visitor's run skips it. Where it moved,
    the first run pays for it as before."""
    from streamlit import delta_generator

    check = getattr(delta_generator, "_maybe_print_use_warning", None)
    if check is not None:
        check()


def runtime_exists() -> bool:
    from streamlit.runtime import Runtime

    return Runtime.exists()


def run_context():
    """This thread's script-run context (None outside a run)."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    return get_script_run_ctx(suppress_warning=True)


def run_yield_check() -> Callable[[], None]:
    """The run's own check that raises when the page has asked for a rerun (what st.* calls do)."""
    from streamlit.runtime.scriptrunner_utils.script_run_context import get_run_yield_check

    return get_run_yield_check()


def pages_manager():
    """The run's page manager: the page a request asked for (None outside a run)."""
    return getattr(run_context(), "pages_manager", None)


def _pages_manager_class():
    try:
        from streamlit.runtime.pages_manager import PagesManager
    except ImportError:  # moved in a later Streamlit: nothing legacy to switch off
        return None
    return PagesManager


def set_legacy_pages(on: bool) -> None:
    """Streamlit's flag for an app run through its legacy pages/ list (st.navigation clears it on its
    first run)."""
    manager = _pages_manager_class()
    if manager is not None:
        manager.uses_pages_directory = on


def legacy_pages() -> bool:
    manager = _pages_manager_class()
    return bool(manager is not None and manager.uses_pages_directory)


@functools.cache
def plotly_chunk() -> str | None:
    """The file name of Streamlit's plotly chunk (PlotlyChart.<hash>.js, beside its main script), or
    None where this Streamlit names it otherwise or its code no longer sets window.Plotly (then every
    chart is st.plotly_chart's: kvviz.app.charts.chart)."""
    import streamlit

    found = sorted((Path(streamlit.__file__).parent / "static" / "static" / "js").glob("PlotlyChart.*.js"))
    if len(found) != 1 or b"window.Plotly=" not in found[0].read_bytes():
        return None
    return found[0].name
