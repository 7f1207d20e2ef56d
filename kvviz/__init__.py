"""kvviz: see what KV-cache compression does to attention.

The core never imports Streamlit; torch and transformers are imported lazily, only by the
model-capture code.
"""

from .heap import keep_heap

keep_heap()  # the engine's temporaries reuse freed memory instead of faulting it in again

from .engine import Comparison, Memory, RowResult, compare, evaluate_row, keep_masks, memory_for
from .spec import ENSEMBLES, SCORERS, Spec, SpecError, View
from .trace import Trace, TraceError

__version__ = "0.1.0"

__all__ = ["Comparison", "ENSEMBLES", "Memory", "RowResult", "SCORERS", "Spec", "SpecError",
           "Trace", "TraceError", "View", "compare", "evaluate_row", "keep_masks", "memory_for"]
