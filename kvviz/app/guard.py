"""One visitor must not take the server down: the work budget, cancellation and a fair share of the cores.

- `start_run()` (every page's head, via layout.page_setup): reads the server options, makes this script
  run's own stop / rerun check the cancel check of every `kvviz.limits.checkpoint()` in it, and puts an
  empty status line at the top of the page. Streamlit raises its StopException / RerunException from that
  check (the same `yield_check` its caches use while they wait for a value another session computes), so
  a rerun, a closed tab or a server shutdown stops the core's work at its next chunk - no thread is
  killed, nothing half-done is cached.
- `heavy(what)`: the body holds one of a few slots (one per core by default: KVVIZ_WORKERS or
  `--workers`); a session that finds them taken waits in line, with "Queued behind N" on its status line,
  instead of starving the others. Put it inside a cached function's body, so a cache hit never queues.
  Nested `heavy` blocks on one thread hold one slot.
- `within_budget(kind, build, default)`: a source too big for the work budget (kvviz.limits) shows one
  notice naming the knobs and the size, and the page goes on with the session's previous source of that
  kind, or the default.

Server options, after `--` on the command line: `streamlit run app.py -- --max-bytes 3GB --workers 2`
(or KVVIZ_MAX_BYTES / KVVIZ_WORKERS in the environment, e.g. for `make run`).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import streamlit as st

from kvviz import limits

T = TypeVar("T")
WORKERS_ENV = "KVVIZ_WORKERS"
TICK_SECONDS = 0.5              # how often a queued session's status line is refreshed
POLL_SECONDS = 0.1              # how often a queued session checks for a rerun or a closed tab
LAST_GOOD = "_kvviz_guard_last"   # session state: the last source of each kind that fit the budget
_STATUS: ContextVar = ContextVar("kvviz_status_line", default=None)
_held = threading.local()       # .depth: heavy() blocks this thread is inside


# --- server options -----------------------------------------------------------------------------

def _options() -> argparse.Namespace:
    """`--max-bytes` and `--workers` from the script's arguments (after `--` on `streamlit run`)."""
    p = argparse.ArgumentParser(prog="app.py", add_help=False)
    p.add_argument("--max-bytes", default=None)
    p.add_argument("--workers", type=int, default=None)
    return p.parse_known_args(sys.argv[1:])[0]


@st.cache_resource(show_spinner=False)
def _server() -> dict:
    """Once per server process: apply --max-bytes; the pool of slots for heavy work."""
    opts = _options()
    if opts.max_bytes:
        limits.set_max_bytes(opts.max_bytes)
    size = opts.workers or int(os.environ.get(WORKERS_ENV, "0") or 0) or os.cpu_count() or 1
    return {"pool": Pool(max(1, size))}


# --- the pool -------------------------------------------------------------------------------------

class Pool:
    """A few slots for heavy work, handed out first come, first served."""

    def __init__(self, size: int):
        self.size = size
        self._cond = threading.Condition()
        self._running = 0
        self._queue: list[object] = []

    def ahead_of(self, ticket: object) -> int:
        """How many computations run or wait before this ticket's."""
        with self._cond:
            return self._running + (self._queue.index(ticket) if ticket in self._queue else 0)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running >= self.size or bool(self._queue)

    def acquire(self, ticket: object, check: Callable[[], None]) -> None:
        """Wait for a slot; `check` runs between waits and may raise to leave the line."""
        with self._cond:
            self._queue.append(ticket)
        try:
            while True:
                with self._cond:
                    if self._queue[0] is ticket and self._running < self.size:
                        self._queue.pop(0)
                        self._running += 1
                        self._cond.notify_all()
                        return
                    self._cond.wait(POLL_SECONDS)
                check()
        except BaseException:
            with self._cond:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                    self._cond.notify_all()
            raise

    def release(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()


def pool() -> Pool:
    return _server()["pool"]


# --- a script run ---------------------------------------------------------------------------------

def _run_context():
    from streamlit.runtime.scriptrunner import get_script_run_ctx
    return get_script_run_ctx(suppress_warning=True)


def start_run() -> None:
    """At the top of every page: this run's cancel check and an empty status line."""
    _server()
    from streamlit.runtime.scriptrunner_utils.script_run_context import get_run_yield_check

    limits.install_check(get_run_yield_check())
    _STATUS.set(st.empty())


def _queued_text(n: int, what: str) -> str:
    size = pool().size
    return (f"Queued behind {n} computation{'s' if n != 1 else ''} of other visitors ({size} run at a time on "
            f"this server): {what} starts when one finishes. Changing a setting or closing the tab cancels it.")


class _Ticker:
    """Refreshes a queued session's status line from a helper thread attached to its script run, as
    Streamlit's own spinner shows itself while a cached function runs (a cached function's body may not
    draw elements created outside it)."""

    def __init__(self, holder, ticket: object, what: str):
        from streamlit.runtime.scriptrunner import add_script_run_ctx

        self.holder, self.ticket, self.what = holder, ticket, what
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvviz-queue-status", daemon=True)
        add_script_run_ctx(self.thread, _run_context())
        self.thread.start()

    def _run(self) -> None:
        shown = None
        while not self.done.wait(0 if shown is None else TICK_SECONDS):
            n = pool().ahead_of(self.ticket)
            if n != shown:
                self.holder.info(_queued_text(n, self.what), icon=":material/hourglass_top:")
                shown = n
        self.holder.empty()       # from this thread too: the script thread may be inside a cached function

    def stop(self) -> None:
        self.done.set()
        self.thread.join(2)


def _take(p: Pool, ticket: object) -> None:
    p.acquire(ticket, limits.checkpoint)
    _held.slot = True


def _give_back(p: Pool) -> None:
    if getattr(_held, "slot", False):
        _held.slot = False
        p.release()


@contextmanager
def heavy(what: str) -> Iterator[None]:
    """Run the body in one of the pool's slots, waiting in line (visibly) if they are taken."""
    depth = getattr(_held, "depth", 0)
    _held.depth = depth + 1
    try:
        if depth:                             # this thread already holds a slot
            yield
            return
        p, ticket, holder = pool(), object(), _STATUS.get()
        ticker = _Ticker(holder, ticket, what) if p.busy and holder is not None and _run_context() else None
        try:
            _take(p, ticket)
        finally:
            if ticker is not None:
                ticker.stop()
        try:
            yield
        finally:
            _give_back(p)
    finally:
        _held.depth = depth


def outside_slot(fn: Callable[..., T] | None) -> Callable[..., T] | None:
    """`fn` called without this thread's slot: for work that may wait on another session's cached
    computation (a seed trace another session is generating), so no one holds a slot while waiting
    for someone who waits for a slot."""
    if fn is None:
        return None

    def call(*args, **kwargs):
        if not getattr(_held, "slot", False):
            return fn(*args, **kwargs)
        p, depth = pool(), _held.depth
        _give_back(p)
        _held.depth = 0               # heavy() blocks inside fn take a slot of their own
        try:
            return fn(*args, **kwargs)
        finally:
            _held.depth = depth
            _take(p, object())        # may raise (a rerun while waiting): heavy() then has nothing to give back
    return call


# --- sources past the budget --------------------------------------------------------------------------

def within_budget(kind: str, build: Callable[[], T], default: Callable[[], T]) -> T:
    """build(), or - when it is past the work budget - a notice and the session's previous value of
    this kind (the default if there is none), so the page stays usable."""
    last = st.session_state.setdefault(LAST_GOOD, {})
    try:
        value = build()
    except limits.BudgetError as e:
        previous = last.get(kind)
        st.warning(f"**Too big for this server:** {e}. Showing the "
                   f"{'previous' if previous is not None else 'default'} setting instead.",
                   icon=":material/memory:")
        return previous if previous is not None else default()
    last[kind] = value
    return value
