"""The Streamlit app's building blocks: URL-backed parameters, the sidebar, cards, cached
compute and the page sections. The only package that imports Streamlit (with app.py and pages/).

May import: every other layer of kvviz; nothing imports it but app.py and pages/.
"""
