"""The app's parameters: every control's URL name, kind, default and widest range.

The table itself lives in kvviz.links (the command line reads links too, and may not import the
app); the app's modules keep importing it from here.
"""

from __future__ import annotations

from kvviz.links import ENSEMBLE_OPTIONS, MAX_TOKENS, PARAMS, SCORER_CHOICES, Param, compression_params, read_settings
from kvviz.quant.integer import BITS_OPTIONS

__all__ = [
    "BITS_OPTIONS",
    "ENSEMBLE_OPTIONS",
    "MAX_TOKENS",
    "PARAMS",
    "Param",
    "SCORER_CHOICES",
    "compression_params",
    "read_settings",
]
