"""One visitor must not take the server down: the work budget's notices, cancellation, a fair share of the cores.

- `serve(page)` (app.py's router) runs each page in one of a few slots - one per core by default
  (`--workers` / KVVIZ_WORKERS) - handed out first come, first served. A session that finds them taken
  waits in line with "Queued behind N" on its status line, instead of adding one more thread that
  fights for the cores and the interpreter lock: with ten busy sessions the server itself (its health
  endpoint, its static files, every websocket) still gets its turn. A slot is taken only at the start
  of a run, before the run holds any cache lock, so no run ever waits for a slot while holding what
  another run waits for.
- `start_run()` (every page's head, via layout.page_setup) makes this script run's own stop / rerun
  check the cancel check of every `kvviz.limits.checkpoint()` in it, and puts an empty status line at
  the top of the page. Streamlit raises its StopException / RerunException from that check (the
  `yield_check` its caches use while waiting for a value another session computes), so a rerun, a
  closed tab or a server shutdown stops the core's work at its next chunk: no thread is killed and
  nothing half-done is cached. A session waiting in line leaves it the same way.
- `within_budget(kind, build, default)`: a source too big for the work budget (kvviz.limits) gives one
  notice naming the knobs and the size; the page goes on with the session's previous source of that
  kind, or the default.

Server options, after `--` on the command line: `streamlit run app.py -- --max-bytes 3GB --workers 2`
(or KVVIZ_MAX_BYTES / KVVIZ_WORKERS in the environment, e.g. for `make run`).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

import streamlit as st

from kvviz import limits
from kvviz.app import internals

T = TypeVar("T")
WORKERS_ENV = "KVVIZ_WORKERS"
TICK_SECONDS = 0.5  # how often a queued session's status line is refreshed
SHOW_AFTER_S = 0.3  # a queued session's status line appears once it has waited this long
POLL_SECONDS = 0.1  # how often a queued session checks for a rerun or a closed tab
LAST_GOOD = "_kvviz_guard_last"  # session state: the last source of each kind that fit the budget
_STATUS: ContextVar = ContextVar("kvviz_status_line", default=None)
_SERVED: ContextVar = ContextVar("kvviz_served", default=False)


# --- server options -----------------------------------------------------------------------------


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """`--max-bytes` and `--workers` from the script's arguments (after `--` on `streamlit run`)."""
    p = argparse.ArgumentParser(prog="app.py", add_help=False)
    p.add_argument("--max-bytes", default=None)
    p.add_argument("--workers", type=int, default=None)
    return p.parse_known_args(sys.argv[1:] if argv is None else argv)[0]


@st.cache_resource(show_spinner=False)
def _server() -> dict:
    """Once per server process: apply --max-bytes; the pool of run slots."""
    atexit.register(gc.freeze)  # see _fast_exit
    opts = options()
    if opts.max_bytes:
        limits.set_max_bytes(opts.max_bytes)
    size = opts.workers or int(os.environ.get(WORKERS_ENV, "0") or 0) or os.cpu_count() or 1
    return {"pool": Pool(max(1, size))}


def pool() -> "Pool":
    return _server()["pool"]


# --- the pool -------------------------------------------------------------------------------------


class Pool:
    """A few slots, handed out first come, first served.

    A release wakes only the run next in line (its own event), not every waiting run: with a class of
    thirty on two cores, thirty runs woke for each of the two that could go on."""

    def __init__(self, size: int):
        self.size = size
        self._cond = threading.Condition()  # guards the counts; wait_quiet waits on it
        self._running = 0
        self._queue: list[object] = []
        self._wakes: dict[object, threading.Event] = {}  # ticket -> the event its waiting run sleeps on
        self._last_busy = time.monotonic()  # when a run last held or waited for a slot

    def ahead_of(self, ticket: object) -> int:
        """How many runs hold a slot or wait before this ticket."""
        with self._cond:
            return self._running + (self._queue.index(ticket) if ticket in self._queue else 0)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running >= self.size or bool(self._queue)

    def others(self, holding: bool) -> int:
        """How many runs hold a slot or wait for one, besides the caller's own run (`holding`: it holds one)."""
        with self._cond:
            return max(0, self._running - int(holding)) + len(self._queue)

    def acquire(
        self, ticket: object, check: Callable[[], None], waiting: Callable[[float], None] | None = None
    ) -> None:
        """Wait for a slot; between waits `check` runs (it may raise to leave the line), then `waiting`
        with the seconds waited so far."""
        wake = threading.Event()
        t0 = time.monotonic()
        with self._cond:
            self._queue.append(ticket)
            self._wakes[ticket] = wake
        try:
            while True:
                with self._cond:
                    if self._queue[0] is ticket and self._running < self.size:
                        self._leave(ticket)
                        self._running += 1
                        self._wake_next()
                        return
                wake.wait(POLL_SECONDS)
                wake.clear()  # the state is read again under the lock: a wake-up cleared here is not lost
                check()
                if waiting is not None:
                    waiting(time.monotonic() - t0)
        except BaseException:
            with self._cond:
                if ticket in self._queue:
                    self._leave(ticket)
                    self._wake_next()
            raise

    def release(self) -> None:
        with self._cond:
            self._running -= 1
            self._last_busy = time.monotonic()
            self._wake_next()
            self._cond.notify_all()  # wait_quiet

    def _leave(self, ticket: object) -> None:  # holding the lock
        self._queue.remove(ticket)
        self._wakes.pop(ticket, None)

    def _wake_next(self) -> None:  # holding the lock
        if self._queue and self._running < self.size:
            self._wakes[self._queue[0]].set()

    def wait_quiet(self, quiet: float, timeout: float) -> bool:
        """Block until no run has held or waited for a slot for `quiet` seconds (at most `timeout`):
        background work that would slow a page being drawn starts after it. True if it got quiet."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                if self._running or self._queue:
                    self._last_busy = now
                elif now - self._last_busy >= quiet:
                    return True
                if now >= deadline:
                    return False
                self._cond.wait(min(POLL_SECONDS * 5, max(0.01, deadline - now)))


def other_runs() -> int:
    """How many other page runs (other visitors' pages, a Model lab or Needle run among them) this server
    is running or has waiting: the Model lab's estimate says the server is busy when there are any."""
    return pool().others(holding=bool(_SERVED.get()))


# --- a script run ---------------------------------------------------------------------------------


def start_run() -> None:
    """At the top of every page: this run's cancel check and an empty status line (once a run)."""
    if _SERVED.get():
        return
    _server()
    limits.install_check(internals.run_yield_check())
    _STATUS.set(st.empty())


def queued_text(n: int) -> str:
    size = pool().size
    pages = "other visitor's page" if n == 1 else "other visitors' pages"
    return (
        f"Queued behind {n} {pages} ({size} run at a time on this server): this page starts when one "
        "finishes. Changing a setting or closing the tab leaves the line."
    )


class _Status:
    """A queued run's status line, written by its own script thread between waits for a slot: the line
    appears once the run has waited SHOW_AFTER_S (a wait the eye barely sees says nothing) and says how
    many runs are ahead, refreshed every TICK_SECONDS."""

    def __init__(self, holder, ticket: object, queue: Pool):
        self.holder, self.ticket, self.queue = holder, ticket, queue
        self.shown: int | None = None
        self.at = 0.0  # seconds waited when it was last refreshed

    def __call__(self, waited: float) -> None:
        if waited < SHOW_AFTER_S or (self.shown is not None and waited - self.at < TICK_SECONDS):
            return
        n = self.queue.ahead_of(self.ticket)
        if n != self.shown:
            self.holder.info(queued_text(n), icon=":material/hourglass_top:")
            self.shown, self.at = n, waited

    def clear(self) -> None:
        if self.shown is not None:
            self.holder.empty()


def serve(page) -> None:
    """app.py's router: run `page` (an st.Page) while holding one of the server's slots."""
    start_run()
    p, ticket, holder = pool(), object(), _STATUS.get()
    status = _Status(holder, ticket, p) if holder is not None else None
    try:
        p.acquire(ticket, limits.checkpoint, status)
    finally:
        if status is not None:
            status.clear()
    token = _SERVED.set(True)
    try:
        page.run()
    finally:
        _SERVED.reset(token)
        p.release()


# --- sources past the budget --------------------------------------------------------------------------


def within_budget(kind: str, build: Callable[[], T], default: Callable[[], T]) -> T:
    """build(), or - when it is past the work budget - a notice and the session's previous value of
    this kind (the default if there is none), so the page stays usable."""
    last = st.session_state.setdefault(LAST_GOOD, {})
    try:
        value = build()
    except limits.BudgetError as e:
        previous = last.get(kind)
        st.warning(
            f"**Too big for this server:** {e}. Showing the "
            f"{'previous' if previous is not None else 'default'} setting instead.",
            icon=":material/memory:",
        )
        return previous if previous is not None else default()
    last[kind] = value
    return value
