"""Where attention comes from: the handbook example, a synthetic pattern, trace files, and captures
of a real model (`capture`). Each produces a `Trace`.

May import: the core (trace, spec, attention); `capture` (and its recorder and request) also
`kvviz.models`, and capture and recorder, inside functions, torch and transformers.
"""

from __future__ import annotations

from pathlib import Path

from kvviz.trace import Trace, TraceError
from kvviz.sources.handbook import handbook_trace
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.sources.tracefile import load_trace, save_trace

SOURCES = ("handbook", "synthetic")


def load_source(name: str, synthetic: SyntheticSpec | None = None) -> Trace:
    """`handbook`, `synthetic` (with its spec) or the path of a saved trace file."""
    if name == "handbook":
        return handbook_trace()
    if name == "synthetic":
        return make_synthetic(synthetic or SyntheticSpec())
    path = Path(name)
    if not path.exists():
        raise TraceError(f"unknown source {name!r}: use handbook, synthetic, or the path of a trace file")
    return load_trace(path)


__all__ = ["SOURCES", "SyntheticSpec", "handbook_trace", "load_source", "load_trace", "make_synthetic", "save_trace"]
