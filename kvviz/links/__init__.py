"""What a link to the app carries: every setting's URL name, kind, default and widest range, and the
Spec, View and source they describe.

    params  `PARAMS`, the one table of settings a link may carry: `Param.parse` turns a raw
            query-parameter string into a value (clamped or replaced by the default, with a notice),
            `Param.encode` back
    values  a link's values read from a query string and written back, and the Spec, View and
            source they describe

The app (kvviz.app) keeps its controls in it and the command line reads links with it
(`kvviz lesson export --from-url`), so it sits below both.

May import: sources, policies, quant and the core (spec, settings, trace); never Streamlit, the
app or the command line.
"""

from kvviz.links.params import (
    ENSEMBLE_OPTIONS,
    LINK_DEFAULTS,
    MAX_TOKENS,
    NOT_IN_LINKS,
    OPEN_ENDED,
    PARAMS,
    SCORER_CHOICES,
    SOURCE_NAMES,
    LiveChoices,
    Param,
    compression_params,
    number_text,
    setting_param,
)
from kvviz.links.values import (
    HANDBOOK_QUANT_NOTE,
    SYNTHETIC_PARAMS,
    LinkedSource,
    defaults,
    encode_query,
    parse_query,
    read_settings,
    resolve_ensemble,
    source_from_values,
    spec_from_values,
    synthetic_from_values,
    synthetic_preset_values,
    view_from_values,
)

__all__ = [
    "ENSEMBLE_OPTIONS",
    "HANDBOOK_QUANT_NOTE",
    "LINK_DEFAULTS",
    "MAX_TOKENS",
    "NOT_IN_LINKS",
    "OPEN_ENDED",
    "PARAMS",
    "SCORER_CHOICES",
    "SOURCE_NAMES",
    "SYNTHETIC_PARAMS",
    "LinkedSource",
    "LiveChoices",
    "Param",
    "compression_params",
    "defaults",
    "encode_query",
    "number_text",
    "parse_query",
    "read_settings",
    "resolve_ensemble",
    "setting_param",
    "source_from_values",
    "spec_from_values",
    "synthetic_from_values",
    "synthetic_preset_values",
    "view_from_values",
]
