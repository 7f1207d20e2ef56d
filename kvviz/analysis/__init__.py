"""Questions asked of the engine: sweeps, the smallest cache for a target (solve), the budget
ledger, the decode timeline, the needle test, and the per-token tables the charts draw (frames).

May import: the core (trace, spec, attention, metrics, engine), sources, policies, quant; the
needle test also the real-model side (`kvviz.decode`, `kvviz.models`), lazily. Never plotly or
Streamlit.
"""
