"""The budget ledger on the app: an expander with the notes, the chart and the per-head table, computed
only while it is open (and cached)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvviz.analysis.ledger import Ledger, budget_ledger
from kvviz.app.charts import chart, folded
from kvviz.app.compute import Source
from kvviz.spec import Spec, SpecError
from kvviz.trace import Trace


@st.cache_resource(max_entries=16, show_spinner="Computing the budget ledger…")
def _ledger(source_key: tuple, spec: Spec, step: int | None, _trace: Trace) -> Ledger:
    return budget_ledger(_trace, spec, step)


def ledger_expander(source: Source, spec: Spec, step: int | None = None) -> None:
    trace = source.trace
    box = folded("Budget ledger: declared vs kept tokens and bytes, per layer and KV head", key="_ledger_open")
    with box:
        if not box.open:
            return
        st.caption(
            "Where a compression ratio meets what is stored: the budget each cache was declared, what it "
            "holds (sinks, window and heavy hitters are all inside the budget), and its bytes — quantized "
            "payload, scale / zero-point overhead, tokens kept at 16 bits. Read-selection methods (Quest) "
            "store everything and save bytes read instead."
        )
        # every layer's policy decisions: seconds on a real trace
        big = trace.n_layers * trace.n_positions > 20_000
        if big and not st.checkbox(
            f"Compute the ledger for all {trace.n_layers} layers",
            key="_ledger_on",
            help="Runs the policy in every layer, which takes a few seconds on a real trace.",
        ):
            return
        try:
            ledger = _ledger(source.key, spec, step, trace)
        except SpecError as e:
            st.error(f"The ledger cannot be computed: {e}")
            return
        for note in ledger.notes():
            st.markdown(f"- {note}")
        from kvviz.plots.style import CHART_CONFIG
        from kvviz.plots.ledger import ledger_figure

        chart(ledger_figure(ledger), key="ledger_chart", config=CHART_CONFIG)
        st.dataframe(pd.DataFrame(list(ledger.rows)), hide_index=True, height=240, key="ledger_table")
