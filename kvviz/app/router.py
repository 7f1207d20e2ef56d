"""The app's pages and how a request reaches one: app.py's navigation, and the last line of every page script.

The page scripts live in `pages/`, as Streamlit's own multipage layout has them, and app.py declares them
with `st.navigation` (our titles, our URLs, the Explorer as a function). Streamlit (1.67) treats an app
with a `pages/` folder beside its entry script as a *legacy* multipage app until `st.navigation` has run
once in the process: the first request of a fresh server runs through Streamlit's own page list, made
from the folder's file names. A link to `/` then runs app.py (its main page), which calls st.navigation
and takes over. A deep link (`/trade-offs`) instead runs the page file directly, outside app.py -- so each
file is named after its URL (`1_trade-offs.py` -> `/trade-offs`: Streamlit drops the number) to be
found, and its last line, `run_page(main)`, hands that one run over to app.py, which draws the page
through our navigation (the same URL, so the same page). Every later request goes straight through
st.navigation. Streamlit has no option to turn the legacy layout off before the first session, hence
this hand-over.
"""

from __future__ import annotations

import runpy
from collections.abc import Callable
from pathlib import Path

import streamlit as st

from kvviz.app import guard, internals
from kvviz.app.layout import PAGES
from kvviz.app.store import sync_url

APP = Path(__file__).resolve().parents[2] / "app.py"

# key -> (file in pages/, title in the sidebar, URL path); a file is named N_<URL path>.py (see above)
PAGE_FILES = {
    "explorer": ("0_explorer.py", "Explorer", "explorer"),
    "tradeoffs": ("1_trade-offs.py", "Trade-offs", "trade-offs"),
    "concentration": ("2_concentration.py", "Concentration", "concentration"),
    "model_lab": ("3_model-lab.py", "Model lab", "model-lab"),
    "timeline": ("4_decode-timeline.py", "Decode timeline", "decode-timeline"),
    "needle": ("5_needle-test.py", "Needle test", "needle-test"),
    "studies": ("6_studies.py", "Studies", "studies"),
}


def page_for_address(name: str) -> str | None:
    """The URL path of the page an address names, or None. Streamlit matches a page's URL path exactly;
    links shared before the pages moved to pages/ named them by their titles (`/Trade-offs`,
    `/Model-lab`), and people retype an address in any case: each such name opens its page."""
    wanted = name.strip("/").lower().replace("_", "-").replace(" ", "-")
    for key, (_, title, url) in PAGE_FILES.items():
        if wanted in (url, key.replace("_", "-"), title.lower().replace(" ", "-")):
            return url
    return None


def _open_old_address() -> None:
    """Before st.navigation resolves this run's page: an address that names a page by another spelling
    (page_for_address) is pointed at that page. Streamlit keeps the address a request asked for in the
    run context's page manager, and offers no hook to map it, hence its set_script_intent here."""
    manager = internals.pages_manager()
    asked = getattr(manager, "intended_page_name", None)
    if not asked or manager.intended_page_script_hash:
        return
    url = page_for_address(asked)
    if url is not None and url != asked:
        manager.set_script_intent("", url)


def no_legacy_pages() -> None:
    """At the server's start (kvviz.app.serve.lifespan): the app is a st.navigation app from its first
    request. Streamlit takes an app with a pages/ folder for a legacy one until st.navigation first runs,
    and its legacy first run resolves the address against the folder's file names, so an old address
    (`/Trade-offs`) got its 'Page not found' before navigate() could point it at its page. The flag is
    the one st.navigation sets on its first call; set here, before any session, the first request takes
    navigate()'s path like every later one."""
    internals.set_legacy_pages(False)


def _legacy_run() -> bool:
    """Whether Streamlit runs this script through its legacy pages/ list (a fresh server's first run)."""
    return internals.legacy_pages()


def navigate() -> None:
    """app.py's body: the page registry, st.navigation, then the chosen page in one of the server's run
    slots, its URL synced before (this run's interactions) and after (values the page clamped or set).
    The Explorer is the default page, at the app's root URL."""
    st.set_page_config(page_title="kvviz", layout="wide")
    PAGES.update(
        {
            key: st.Page(f"pages/{file}", title=title, url_path=url, default=key == "explorer")
            for key, (file, title, url) in PAGE_FILES.items()
        }
    )
    _open_old_address()
    page = st.navigation(list(PAGES.values()))
    # first: this run's interaction callbacks have set the store; link to it before computing
    sync_url()
    guard.serve(page)  # in one of the server's run slots, cancelled by a rerun or a closed tab
    sync_url()  # last: the page may have clamped or set values on the way


def run_page(main: Callable[[], None]) -> None:
    """The last line of every page script: draw the page, then sync its URL -- or, when Streamlit ran the
    file itself (a fresh server's first request was a deep link to it), hand the run over to app.py."""
    if _legacy_run():
        runpy.run_path(str(APP), run_name="__main__")
        return
    main()
    sync_url()
