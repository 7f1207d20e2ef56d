"""kvviz: see what KV-cache compression does to attention.

The library API: a `Trace` (from `kvviz.sources`), a `Spec` (what the sliders set) and
`compare` (the engine). The layers and what each may import: docs/architecture.md.
The core never imports Streamlit; torch and transformers are imported lazily, only on the
real-model side (`kvviz.models`, `kvviz.sources.capture`, `kvviz.decode`).
"""

from kvviz.engine import Comparison, Memory, RowResult, compare, evaluate_row, keep_masks, memory_for
from kvviz.spec import ENSEMBLES, SCORERS, Spec, SpecError, View
from kvviz.trace import Trace, TraceError
from kvviz.version import __version__

__all__ = [
    "Comparison",
    "ENSEMBLES",
    "Memory",
    "RowResult",
    "SCORERS",
    "Spec",
    "SpecError",
    "Trace",
    "TraceError",
    "View",
    "__version__",
    "compare",
    "evaluate_row",
    "keep_masks",
    "memory_for",
]
