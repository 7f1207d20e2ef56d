"""Studies: open a study folder (runs of `kvviz study run`) and draw its frontier with error bars."""

import streamlit as st

from kvviz.analysis.study import StudyError

from kvviz.app.layout import page_setup
from kvviz.app.router import run_page
from kvviz.app.store import show_notices, state, w_choice
from kvviz.app.studies import example_section, frontier_section, list_studies, resolve_study, studies_root


def main() -> None:
    present = page_setup(
        "Studies: a grid run from a study file",
        "A study file names a grid (methods × budgets × bits × seeds, texts or prompts); "
        "`kvviz study run` keeps every finished cell, here or on a Ray cluster. Each point is the "
        "mean over seeds or texts, with a 95% t-interval.",
    )
    show_notices()
    root = studies_root()
    found = list_studies(root)
    chosen = st.session_state.get("study", state()["study"])
    options = ["", *found] if chosen in found or not chosen else ["", chosen, *found]  # a bad link: refused below
    pick = w_choice(
        st,
        "study",
        f"Study (folders under {root})",
        tuple(options),
        format_func=lambda s: s or "— choose a study —",
        help="Folders written by `kvviz study run FILE --out DIR` under the studies folder "
        "(KVVIZ_STUDIES_DIR, default ./runs). The chosen study is kept in the link.",
    )
    if not pick:
        st.info("No study open. Pick one above, or run the shipped example below.", icon=":material/info:")
    else:
        try:
            path = resolve_study(pick, root)
        except StudyError as e:
            st.error(f"Cannot open this study: {e}", icon=":material/block:")
        else:
            try:
                frontier_section(path, present)
            except StudyError as e:
                st.error(f"Cannot read this study: {e}", icon=":material/error:")
    if not present or not pick:  # presenting, the example stays for as long as no study is open
        with st.expander("Shipped example study", expanded=not found):
            example_section(root)


run_page(main)
