"""The Explorer's "Export this as a lesson": the current view as one HTML page with live sliders that runs
from disk, offline (kvviz.plots.lesson, the same page `kvviz lesson export` writes).

Folded, it computes nothing; "Build the lesson" runs kvviz.compare at every grid point with a progress
bar; the page (with the title and words typed here) is then a download for as long as the settings stay.
"""

from __future__ import annotations

from dataclasses import asdict

import streamlit as st

from kvviz.analysis.readout import fmt_bytes
from kvviz.app.charts import folded
from kvviz.app.compute import Source
from kvviz.app.store import settings_dict
from kvviz.links import LinkedSource
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import TraceError

KEY = "_kvviz_lesson"  # session: {wanted, lesson, source, values, base, words, page}


def _linked(source: Source) -> LinkedSource:
    name = source.key[1] if source.key[0] == "external" else source.key[0]
    return LinkedSource(name, source.trace, source.label, source.seed_fn, source.quant_note_kv)


def _app_base() -> str:
    try:
        url = st.context.url or ""
    except AttributeError:  # older Streamlit
        url = ""
    return url.split("?")[0] or "http://localhost:8501/"


def _build(source: Source, spec: Spec, view: View, bars: str, wanted: tuple) -> None:
    """Compute the lesson with a progress bar and keep it in the session (its page is written after);
    a view that cannot be one says why."""
    from kvviz.plots.lesson import build_lesson

    bar = st.progress(0.0, text="Computing the lesson…")
    try:
        lesson = build_lesson(
            _linked(source),
            spec,
            view,
            bars=bars,
            progress=lambda f, m: bar.progress(min(1.0, f), text=f"Computing: {m}"),
        )
    except (SpecError, TraceError, ValueError) as e:
        st.session_state.pop(KEY, None)
        st.error(f"This view cannot be made into a lesson: {e}.")
    else:
        st.session_state[KEY] = {
            "wanted": wanted,
            "lesson": lesson,
            "source": _linked(source),
            "view": view,
            "values": settings_dict(),
            "words": None,
            "page": b"",
        }
    finally:
        bar.empty()


def lesson_export(source: Source, spec: Spec, view: View, bars: str, file_stem: str) -> None:
    """An expander: what a lesson holds, its words, a Build button (with progress), then the download."""
    from kvviz.plots.lesson import default_title, lesson_page

    ss = st.session_state
    wanted = (source.key, tuple(sorted(spec.as_dict().items())), tuple(sorted(asdict(view).items())), bars)
    box = folded(
        "Export this as a lesson (one HTML page with live sliders, runs offline)",
        key="_lesson_open",
        icon=":material/school:",
    )
    with box:
        if not box.open:
            return
        st.caption(
            "For a lecture hall without Python or Wi-Fi, or for students at home: this view's charts and "
            "numbers at a grid of the four sliders (sink tokens, recent window, heavy-hitter budget, bits; "
            "the grid is listed on the page), computed here once and saved in one HTML file that any current "
            "browser opens from disk. Everything else stays as it is now. Takes about a minute."
        )
        title = st.text_input("Title (optional)", key="_lesson_title", placeholder=default_title(source.label))
        words = st.text_area("Your words for the class (optional)", key="_lesson_text", height=80)
        if st.button("Build the lesson", key="_lesson_build", icon=":material/build:"):
            _build(source, spec, view, bars, wanted)
        built = ss.get(KEY)
        if built is not None and built["wanted"] == wanted:
            # the numbers stay; only the page is written again
            if built["words"] != (title, words):
                built["page"] = lesson_page(
                    built["lesson"],
                    built["source"],
                    built["view"],
                    built["values"],
                    title=title,
                    lecturer=words,
                    app_url=_app_base(),
                ).encode("utf-8")
                built["words"] = (title, words)
            st.download_button(
                f"Download the lesson ({fmt_bytes(len(built['page']))}, {built['lesson'].points:,} settings)",
                data=built["page"],
                file_name=f"{file_stem}-lesson.html",
                mime="text/html",
                on_click="ignore",
                icon=":material/download:",
                key="_lesson_download",
            )
        elif built is not None:
            st.caption("The settings changed since the lesson was built: build it again for this view.")
