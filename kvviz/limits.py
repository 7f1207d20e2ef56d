"""The work budget and cancellation: how big a request is, the limit it must fit, and how to stop it.

A request states its size before anything is allocated, as a `Work`: named parts, each a product of
the knobs that set it (`Part`: 32 layers x 32 query heads x 33,280 positions x 64 dims x 4 B = 8.7 GB
of queries). `Work.check()` compares the total with the limit and raises `BudgetError` (a SpecError)
whose one line names the biggest part, the total, the limit and the knobs to lower. The limit is
`KVVIZ_MAX_BYTES` (default 1.5 GB; "3GB", "2.5e9", "800MB" and "2GiB" are understood), or what a
program sets with `set_max_bytes` (the app's `--max-bytes` server option).

Long work runs in chunks and calls `checkpoint()` between them. The check it runs is the caller's:
`with cancellable(token): compare(...)` with a `CancelToken` that another thread may `cancel()`
(checkpoint then raises `Cancelled`), or any callable that raises to stop - the Streamlit app
installs the script run's own stop/rerun check, so a rerun or a closed tab ends the work at the next
chunk. Without a check, `checkpoint()` does nothing.

Core layer: imports nothing of kvviz but the spec (for SpecError).
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from kvviz.spec import SpecError

ENV = "KVVIZ_MAX_BYTES"
DEFAULT_MAX_BYTES = 1_500_000_000
MIN_MAX_BYTES = 16_000_000  # below this even the built-in examples would be refused
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# set_max_bytes(): a program's own limit, ahead of the environment
_override: list[int] = []


class BudgetError(SpecError):
    """A request larger than the work budget; the message names the knobs, the size and the limit."""

    def __init__(self, message: str, work: "Work", limit: int):
        super().__init__(message)
        self.work, self.limit = work, limit


class Cancelled(Exception):
    """Raised at a checkpoint when the work was cancelled (a CancelToken was set)."""


# --- sizes ------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units, two significant figures past the first: 8.7 GB, 512 MB, 3.0 kB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """'1.5GB', '1500000000', '2.5e9', '800 MB', '2GiB' -> bytes; SpecError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise SpecError(f"{text!r} is not a size: give bytes like 1500000000, 1.5GB, 800MB or 2GiB")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise SpecError(f"{text!r} is not a positive size")
    return int(value)


def max_bytes() -> int:
    """The work budget in bytes: set_max_bytes(), else $KVVIZ_MAX_BYTES, else 1.5 GB."""
    if _override:
        return _override[-1]
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        return _at_least_min(parse_bytes(raw))
    except SpecError as e:
        raise SpecError(f"{ENV}={raw!r}: {e}") from None


def _at_least_min(limit: int) -> int:
    if limit < MIN_MAX_BYTES:
        raise SpecError(f"the work budget must be at least {fmt_bytes(MIN_MAX_BYTES)}, got {fmt_bytes(limit)}")
    return limit


def set_max_bytes(limit: int | str | None) -> None:
    """A program's own limit (bytes or a size like '3GB'); None returns to the environment / default."""
    _override.clear()
    if limit is not None:
        _override.append(_at_least_min(parse_bytes(limit) if isinstance(limit, str) else int(limit)))


@dataclass(frozen=True)
class Part:
    """One allocation: `what` ("queries") = the product of the factors (count, name) x item bytes."""

    what: str
    factors: tuple[tuple[int, str], ...]
    item_bytes: int = 4

    @property
    def bytes(self) -> int:
        return math.prod(int(n) for n, _ in self.factors) * self.item_bytes

    def describe(self) -> str:
        terms = [f"{int(n):,} {name}".rstrip() for n, name in self.factors]
        return " × ".join(terms + [f"{self.item_bytes} B"]) + f" = {fmt_bytes(self.bytes)} of {self.what}"


@dataclass(frozen=True)
class Work:
    """What a request will hold at its peak: its parts, and the knobs that make it smaller."""

    what: str  # "the synthetic pattern"
    parts: tuple[Part, ...]
    lower: str  # "the context, the layers or the heads"

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def plus(self, other: "Work") -> "Work":
        """Both at once (a trace and the engine's temporaries over it)."""
        return Work(self.what, self.parts + other.parts, self.lower)

    def message(self, limit: int) -> str:
        parts = sorted(self.parts, key=lambda p: p.bytes, reverse=True)
        head = parts[0].describe() if parts else self.what
        rest = (
            ""
            if len(parts) < 2
            else (f", {fmt_bytes(self.bytes)} in all with " + " and ".join(p.what for p in parts[1:]))
        )
        return f"{self.what} needs {head}{rest}; the limit is {fmt_bytes(limit)} ({ENV}): lower {self.lower}"

    def check(self, limit: int | None = None) -> "Work":
        """Raise BudgetError if the total is over the limit (default: max_bytes()); else return self."""
        limit = max_bytes() if limit is None else limit
        if self.bytes > limit:
            raise BudgetError(self.message(limit), self, limit)
        return self


# --- cancellation ---------------------------------------------------------------------------

_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("kvviz_cancel_check", default=None)


def checkpoint() -> None:
    """Between chunks of long work: run the caller's cancel check (it raises to stop)."""
    check = _CHECK.get()
    if check is not None:
        check()


@contextmanager
def cancellable(check: Callable[[], None]) -> Iterator[None]:
    """Run the body with `check` as the cancel check of every checkpoint inside it."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


def install_check(check: Callable[[], None] | None) -> None:
    """Make `check` the cancel check of this thread's context from now on (a server's script run,
    which has no enclosing `with`); None removes it."""
    _CHECK.set(check)


class CancelToken:
    """A cancel check another thread can trip: `token.cancel()`; checkpoints then raise Cancelled."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def __call__(self) -> None:
        if self._event.is_set():
            raise Cancelled("the computation was cancelled")
