"""Explorer: move the sliders, see what KV-cache compression does to attention, token by token.

`main` reads top to bottom as the page: the sidebar, the comparison, then each section into its place.
"""

import streamlit as st

from kvviz.plots import export, figures, style

from kvviz.app.charts import chart, folded
from kvviz.app.cards import metric_cards, metrics_table, plain_cards
from kvviz.app.compute import run_compare
from kvviz.app.layout import page_setup
from kvviz.app.lesson import lesson_export
from kvviz.app.notes import (
    budget_warnings,
    fp8_note,
    no_eviction_note,
    quant_model_note,
    quant_scope_note,
    quant_warning_box,
    scorer_note,
)
from kvviz.app.overview import has_text_tokens, head_overview, token_grid
from kvviz.app.presets import preset_buttons
from kvviz.app.router import run_page
from kvviz.app.sidebar import sidebar
from kvviz.app import explorer as ux
from kvviz.app.explorer import Shown
from kvviz.app import formats as ui_formats
from kvviz.app import ledger as ui_ledger
from kvviz.plots.figures import BAND_TEXT
from kvviz.analysis.frames import (
    attention_extent,
    ensemble_text,
    error_extent,
    ranges_text,
    row_text,
    token_frame,
    zoom_frame,
    BIN_THRESHOLD,
)


def main() -> None:
    present = page_setup(
        "KV-cache compression explorer",
        "Evict tokens (sinks, recent window, heavy hitters) and quantize keys and values; "
        "compare the compressed attention with the original, token by token.",
    )
    # Presentation mode: the four headline sliders in the main area, above the charts (their only widgets)
    settings = sidebar(headline=st.container() if present else None)
    if settings is None or settings.spec is None:
        return
    source, spec, vs = settings.source, settings.spec, settings.view
    n_tokens = int(source.trace.query_positions[source.trace.evaluated_queries[-1]]) + 1
    if not present:
        preset_buttons(n_tokens)
    comp = run_compare(source, spec, vs.view)
    if comp is None:
        return
    pinned_spec = ux.pinned_spec()
    pinned = run_compare(source, pinned_spec, vs.view) if pinned_spec is not None else None
    page = Shown(source, spec, vs, comp, pinned_spec, pinned, present)
    cards_slot, lock_slot, top_chart, bottom_chart = places(page)
    # The attention figure is built before the cards are drawn, so that the cards and the charts reach the
    # browser together (kvviz.app.livechart draws the charts once that first paint is on screen); the lock
    # toggle, drawn into its place below the cards, decides the figure's y-axis, so it runs first.
    with lock_slot:  # the toggle sits with the charts it locks
        y_range, y_top = ux.y_lock(error_extent(page.frame), attention_extent(page.frame), present)
    fig_attention = attention_figure(page, y_top)
    with cards_slot:
        if present:
            plain_cards_and_folded_notes(page)
        else:
            cards(page)
    with top_chart:
        attention_chart(page, fig_attention)
    with bottom_chart:
        fig_error = error_chart(page, y_range)
    if present:
        preset_buttons(n_tokens)
    else:
        about_and_notes(page)
    ux.solver_panel(source.trace, spec, vs.view)
    token_grid(comp, source)
    head_overview(source, spec, vs.view)
    if present:
        return
    ui_formats.key_rotation_expander(source, vs.view)
    stem = downloads(page, [fig_attention, fig_error])
    lesson_export(source, spec, vs.view, vs.bars, stem)
    all_numbers(comp)
    ui_ledger.ledger_expander(source, spec, vs.view.step)


def places(page: Shown) -> tuple:
    """The page's places top to bottom (Presentation mode: one projector screen, the attention chart first),
    and the row's tokens first..last the charts draw (a long row's range boxes sit above the charts), in bins
    past BIN_THRESHOLD tokens, so no chart carries more than a few hundred bars whatever the row's length.
    Returns the places of the cards, the lock toggle and the two charts."""
    if page.present:
        top_chart, lock_slot, cards_slot, bottom_chart = (st.container() for _ in range(4))
        page.first, page.last = 0, page.n_seen - 1
    else:
        cards_slot, lock_slot = st.container(), st.container()
        zoom_slot = st.container() if page.n_seen > BIN_THRESHOLD else None  # a long row's range boxes
        top_chart, bottom_chart = st.container(), st.container()
        page.first, page.last = ux.token_range(page.n_seen, (page.source.key, page.n_seen), zoom_slot)
    page.frame, page.binned = zoom_frame(page.comp, page.first, page.last)
    if page.pinned is not None:
        page.pinned_frame = zoom_frame(page.pinned, page.first, page.last)[0]
    return cards_slot, lock_slot, top_chart, bottom_chart


def notes(page: Shown) -> list[str]:
    """The comparison's notes, the scorer's, the typical-pattern note and FP8's."""
    source, spec = page.source, page.spec
    typical = st.session_state.get("_typical_note") if st.session_state.get("_typical_for") == source.key else None
    extra = [scorer_note(spec, source.trace), typical, fp8_note(source, spec, page.vs.view.step)]
    return list(page.comp.notes) + [note for note in extra if note]


def cards(page: Shown) -> None:
    """What the numbers mean when the sliders do not, above the eight cards and the pin."""
    spec, comp = page.spec, page.comp
    for w in budget_warnings(spec, page.n_seen):
        st.warning(w, icon=":material/warning:")
    eviction_off = no_eviction_note(spec)  # all three budgets at 0: said beside the numbers
    if eviction_off:
        st.info(eviction_off, icon=":material/info:")
    quant_warning_box(spec, comp.memory.kept_tokens)
    metric_cards(comp, page.pinned)
    ux.pin_controls(spec, page.pinned_spec if page.pinned is not None else None)


def about_and_notes(page: Shown) -> None:
    """Below the charts, so that the first chart starts on the first screen."""
    st.caption(f"{page.about} " + (quant_scope_note(page.spec) or ""))
    for note in notes(page):
        st.info(note, icon=":material/info:")


def plain_cards_and_folded_notes(page: Shown) -> None:
    """Presentation mode: three cards, the explanations folded."""
    spec = page.spec
    plain_cards(page.comp)
    st.caption(quant_scope_note(spec) or quant_model_note(page.source, spec))
    warnings = budget_warnings(spec, page.n_seen)
    eviction_off = no_eviction_note(spec)
    more = ([eviction_off] if eviction_off else []) + notes(page)
    with st.expander(f"Notes ({len(warnings) + len(more) + 1})", icon=":material/info:"):
        for w in warnings:
            st.warning(w, icon=":material/warning:")
        quant_warning_box(spec, page.comp.memory.kept_tokens)
        st.caption(page.about)
        for note in more:
            st.info(note, icon=":material/info:")


def attention_figure(page: Shown, y_top: float | None):
    """The original and the compressed attention per token (per bin past BIN_THRESHOLD tokens)."""
    row = row_text(page.comp)
    if page.binned:
        fig = figures.binned_attention_figure(page.frame, row=row, y_top=y_top)
        return page.look(fig, "attention mass")
    fig = figures.attention_figure(
        page.frame, row=row, text_tokens=has_text_tokens(page.source.trace), pinned=page.pinned_frame, y_top=y_top
    )
    return page.look(fig, "attention")


def attention_chart(page: Shown, fig) -> None:
    frame, first, last = page.frame, page.first, page.last
    if page.binned and not page.present:
        st.caption(
            f"Tokens {first}-{last} of {page.n_seen}, in {len(frame)} bins of up to "
            f"{int(frame['tokens'].max())} tokens: each bar is the sum of its bin's attention (the mass), "
            "the black tick its largest single token. Zoom to a range of "
            f"{BIN_THRESHOLD} tokens or fewer to see each token (the CSV has every token)."
        )
    elif page.spec.evicts and not page.present:  # the tokens first..last, one row each
        st.markdown(
            f"**Kept tokens{'' if len(frame) == page.n_seen else f' ({first}-{last})'}:** "
            f"{ranges_text(frame.index[frame['kept']])}"
        )
    chart(fig, key="attention_chart", config=style.CHART_CONFIG)
    if not page.present:
        st.caption(
            "What to look for: grey is the original attention, coloured bars what the compressed cache "
            "gives each kept token (renormalised, so kept tokens gain weight: sinks dotted, the recent "
            "window lined, heavy hitters crossed); hatched vermillion bars are evicted tokens, whose "
            "attention drops to zero."
        )


def error_chart(page: Shown, y_range: float | None):
    """The handbook's lesson, two kinds of error, with the ensemble's error bars; returns the figure."""
    members, ensemble, bars = len(page.comp.members), ensemble_text(page.comp), page.vs.bars
    fig = page.look(
        figures.error_figure(
            page.frame,
            bars,
            members,
            what=ensemble,
            y_range=y_range,
            text_tokens=has_text_tokens(page.source.trace) and not page.binned,
            pinned=page.pinned_frame,
        ),
        "attention error",
    )
    chart(fig, key="error_chart", config=style.CHART_CONFIG)
    if not page.present:
        st.caption(
            "What to look for: the two causes of error apart. Eviction (hatched vermillion) loses whole "
            "tokens and shifts their mass onto the kept ones; quantization (purple) spreads small errors "
            "over every kept token. "
            + (
                f"Bars are the mean over N = {members} rows ({ensemble}); black ticks the total, with "
                f"error bars: {BAND_TEXT[bars]}" + (" (assumes independent rows)." if bars == "ci95" else ".")
                if members > 1
                else "One row, no ensemble: pick one under View → Error bars over."
            )
        )
    return fig


def downloads(page: Shown, figs: list) -> str:
    """The per-token CSV and the charts as one HTML file, with the settings and the link; returns the file
    names' stem."""
    source, spec, comp = page.source, page.spec, page.comp
    stem = ux.slug(spec, source.key[0] if source.key[0] != "external" else source.key[1])
    link = ux.page_link()
    header = ux.settings_header(comp, source.label, link, page.vs.bars)
    row = st.container(horizontal=True, gap="small")
    row.download_button(
        "Download per-token data (CSV)",
        data=lambda: header + token_frame(comp).to_csv(index=False),
        file_name=f"{stem}.csv",
        mime="text/csv",
        on_click="ignore",
        icon=":material/download:",
    )
    row.download_button(
        "Download charts (standalone HTML)",
        data=lambda: export.figures_html(figs, f"kvviz: {spec.label()}", metrics=comp.metrics, about=header, link=link),
        file_name=f"{stem}.html",
        mime="text/html",
        on_click="ignore",
        icon=":material/download:",
    )
    st.caption(
        "For slides: every chart's toolbar (top right of the chart, on hover) has a camera button that "
        "saves it as an SVG image in your browser, offline."
    )
    return stem


def all_numbers(comp) -> None:
    """Folded until opened: its tables would load the data grid's scripts (~1.2 MB) into the first paint."""
    numbers = folded("All numbers", key="_numbers_open")
    with numbers:
        if numbers.open:
            st.dataframe(metrics_table(comp), hide_index=True, key="metrics_table")
            st.dataframe(token_frame(comp), hide_index=True, height=240)  # every token


run_page(main)
