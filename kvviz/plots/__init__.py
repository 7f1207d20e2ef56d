"""Plotly figure builders: data in, `go.Figure` (or HTML) out; one module per page family.

May import: the core and `kvviz.analysis` (for the data they draw). Never Streamlit.
"""
