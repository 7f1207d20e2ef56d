"""The Explorer's "Export this as a lesson": the current view as one HTML page with live sliders that runs
from disk, offline (kvviz.plots.lesson.export_lesson, the same page `kvviz lesson export` writes).

Folded, it computes nothing; "Build the lesson" runs kvviz.compare at every grid point with a progress
bar, then a download button hands over the page, for as long as the settings stay the same.
"""

from __future__ import annotations

from dataclasses import asdict

import streamlit as st

from kvviz.analysis.readout import fmt_bytes
from kvviz.app.compute import Source
from kvviz.app.store import settings_dict
from kvviz.links import LinkedSource
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import TraceError

KEY = "_kvviz_lesson"


def _linked(source: Source) -> LinkedSource:
    name = source.key[1] if source.key[0] == "external" else source.key[0]
    return LinkedSource(name, source.trace, source.label, source.seed_fn, source.quant_note_kv)


def _app_base() -> str:
    try:
        url = st.context.url or ""
    except AttributeError:   # older Streamlit
        url = ""
    return url.split("?")[0] or "http://localhost:8501/"


def lesson_export(source: Source, spec: Spec, view: View, bars: str, file_stem: str) -> None:
    """An expander: what a lesson holds, a Build button (with progress), then the download."""
    from kvviz.plots.lesson import export_lesson

    wanted = (source.key, tuple(sorted(asdict(spec).items())), tuple(sorted(asdict(view).items())), bars)
    with st.expander("Export this as a lesson (one HTML page with live sliders, runs offline)",
                     icon=":material/school:"):
        st.caption("For a lecture hall without Python or Wi-Fi, or for students at home: this view's charts and "
                   "numbers at a grid of the four sliders (sink tokens, recent window, heavy-hitter budget, bits; "
                   "the grid is listed on the page), computed here once and saved in one HTML file that any current "
                   "browser opens from disk. Everything else stays as it is now. Takes about a minute.")
        if st.button("Build the lesson", key="_lesson_build", icon=":material/build:"):
            bar = st.progress(0.0, text="Computing the lesson…")
            try:
                page, lesson = export_lesson(_linked(source), spec, view, settings_dict(), bars=bars,
                                             app_url=_app_base(),
                                             progress=lambda f, m: bar.progress(min(1.0, f), text=f"Computing: {m}"))
            except (SpecError, TraceError, ValueError) as e:
                st.session_state.pop(KEY, None)
                st.error(f"This view cannot be made into a lesson: {e}.")
            else:
                st.session_state[KEY] = (wanted, page.encode("utf-8"), lesson.points)
            finally:
                bar.empty()
        built = st.session_state.get(KEY)
        if built is not None and built[0] == wanted:
            data, points = built[1], built[2]
            st.download_button(f"Download the lesson ({fmt_bytes(len(data))}, {points:,} settings)", data=data,
                               file_name=f"{file_stem}-lesson.html", mime="text/html", on_click="ignore",
                               icon=":material/download:", key="_lesson_download")
        elif built is not None:
            st.caption("The settings changed since the lesson was built: build it again for this view.")
