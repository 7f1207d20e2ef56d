"""Which settings a policy's scores depend on, found by watching the scorer read them.

A cache of scores is keyed by the settings the scores depend on. A list of them written by hand beside
each scorer drifts from what the scorer reads (ChunkKV's list once left out `chunk_rule`, and a "chunks"
run after a "budget" run reused stale scores). Here nothing is listed: the scorer runs on a `SpecReads`,
a read-only view of the Spec that notes every field read (through properties and helper functions too:
`budget` notes sink, recent and heavy), and the cache key is the values of the fields read so far by that
scorer (`ReadLog`).

Why this is exact: a scorer is deterministic given its trace, layer and the values it reads. An entry
computed from spec S was stored under the values of a set F of fields that contains every field that
computation read; a later spec S' with the same values on F takes the same path through the code,
reading the same fields with the same values, so it computes the same scores. A new branch that reads a
new field only grows F (later keys name more fields); it never makes an old entry answer wrongly.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from kvviz.settings import SETTINGS
from kvviz.spec import Spec


class SpecReads:
    """A read-only Spec that adds the name of every field read to `read`. A property is evaluated on this
    view (so the fields it reads are noted); a method (`with_`, `label`) may read anything: all noted.
    A view of a view notes into both sets (a wrapper's scorer runs its inner scorer on its own view)."""

    __slots__ = ("_spec", "_reads")

    def __init__(self, spec: Spec | SpecReads, read: set[str]):
        outer = spec._reads if isinstance(spec, SpecReads) else ()
        object.__setattr__(self, "_spec", spec._spec if isinstance(spec, SpecReads) else spec)
        object.__setattr__(self, "_reads", (*outer, read))

    def _note(self, names) -> None:
        for read in self._reads:
            read.update(names)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(Spec, name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if name in SETTINGS:
            self._note((name,))
        elif callable(attr):
            self._note(SETTINGS)
        return getattr(self._spec, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


class ReadLog:
    """Per scorer name, the Spec fields its scores have been seen to read; the key of a spec is their
    values. Thread-safe: the app's runs score in several threads."""

    def __init__(self) -> None:
        self._fields: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()

    def key(self, name: str, spec: Spec | SpecReads) -> tuple:
        """(fields, values) of the fields `name` has read so far, from `spec` (a SpecReads view notes
        them as read by the caller too: a wrapper such as ChunkKV depends on what its inner scorer does)."""
        with self._lock:
            fields = sorted(self._fields.get(name, ()))
        return tuple(fields), tuple(getattr(spec, f) for f in fields)

    def note(self, name: str, read: set[str]) -> None:
        with self._lock:
            self._fields[name] = self._fields.get(name, frozenset()) | frozenset(read)

    def fields(self, name: str) -> frozenset[str]:
        with self._lock:
            return self._fields.get(name, frozenset())


READS = ReadLog()
