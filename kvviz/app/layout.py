"""Every page's frame: the app-wide styles, the Presentation mode switch, the title and the page registry."""

from __future__ import annotations

from contextlib import contextmanager

import streamlit as st

from kvviz.app import guard
from kvviz.app.sources import warm_up
from kvviz.app.store import w_check

PAGES: dict = {}  # app.py registers its st.Page objects here, so a page can switch to another

PRESENT_CSS = """
<style>
  html { font-size: 18px; }
  [data-testid="stMainBlockContainer"] { padding-top: 1rem; }
  [data-testid="stCaptionContainer"] { font-size: 1rem; }
</style>
"""
LAYOUT_CSS = """
<style>
  /* a projector's 1024 px: less side padding, labels and values wrap instead of being cut */
  [data-testid="stMainBlockContainer"] { padding-left: 2rem; padding-right: 2rem; padding-top: 2.5rem; }
  h1 { font-size: 2.1rem !important; }
  [data-testid="stMetricLabel"] p, [data-testid="stMetricLabel"] div { white-space: normal !important;
      overflow: visible !important; text-overflow: clip !important; line-height: 1.2; }
  [data-testid="stMetricValue"] { font-size: 1.7rem; }
  [data-testid="stMetricValue"] > div { white-space: normal !important; overflow: visible !important;
      text-overflow: clip !important; }
</style>
"""


def page_setup(title: str, intro: str) -> bool:
    """Every page's head: the app-wide layout styles, the Presentation mode switch (sidebar,
    in the URL), the title and its one-line intro (a smaller title and no intro when
    presenting). Returns whether presentation mode is on."""
    guard.start_run()  # this run's cancel check and status line
    # the first page view of the process: the kernel, then the bundled model, in the background
    warm_up()
    present = bool(
        w_check(
            st.sidebar,
            "present",
            "Presentation mode",
            help="For a projector: larger text, the main chart first, the extras (tables, downloads, "
            "explanations) folded away. Kept in the link.",
        )
    )
    st.html(LAYOUT_CSS + (PRESENT_CSS if present else ""))
    if present:
        st.subheader(title)
    else:
        st.title(title)
        st.caption(intro)
    return present


@contextmanager
def progress_status(label: str):
    """A long run's status box with a progress bar and a line of what it is doing; yields
    say(fraction, message) for the run's progress callback, and closes the box as finished."""
    with st.status(label, expanded=True) as status:
        bar, line = st.progress(0.0), st.empty()

        def say(fraction: float, message: str) -> None:
            bar.progress(min(max(float(fraction), 0.0), 1.0))
            line.caption(message)

        yield say
        status.update(state="complete", expanded=False)
