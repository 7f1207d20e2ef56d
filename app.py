"""kvviz: see what KV-cache compression does to attention. Run with `streamlit run app.py`.

This file is two things, as Streamlit (1.67) allows. Streamlit runs it as the script of every page view
(`__main__`): it declares the pages (pages/, kvviz/app/router.py) and runs the one asked for. And
`streamlit run app.py` finds the `st.App` below and serves it, importing this file once at start: the
app's start-up hook (kvviz.app.serve.lifespan) then warms the app before the first visitor arrives.
"""

import streamlit as st

if __name__ == "__main__":  # a page view: Streamlit runs this file as its script
    from kvviz.app.router import navigate

    navigate()
else:  # the server's start: `streamlit run app.py` imports this file
    from kvviz.app.serve import lifespan

    app = st.App(__file__, lifespan=lifespan)
