"""Explorer: move the sliders, see what KV-cache compression does to attention, token by token."""

import streamlit as st

from kvviz.plots import figures, style

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
    headline = st.container() if present else None
    settings = sidebar(headline=headline)
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
    n_seen = len(comp.tokens)

    about = f"{source.label} · {row_text(comp)} · {spec.label()} · {quant_model_note(source, spec)}"  # the cards
    eviction_off = no_eviction_note(spec)  # all three budgets at 0: said beside the numbers

    def notes() -> list[str]:
        typical = (
            st.session_state.get("_typical_note")
            if st.session_state.get("_typical_for") == source.key
            else None
        )
        return list(
            comp.notes
            + tuple(
                filter(
                    None,
                    [
                        scorer_note(spec, source.trace),
                        typical,
                        fp8_note(source, spec, vs.view.step),
                    ],
                )
            )
        )

    def cards() -> None:  # what the numbers mean when the sliders do not, above them
        for w in budget_warnings(spec, n_seen):
            st.warning(w, icon=":material/warning:")
        if eviction_off:
            st.info(eviction_off, icon=":material/info:")
        quant_warning_box(spec, comp.memory.kept_tokens)
        metric_cards(comp, pinned)
        ux.pin_controls(spec, pinned_spec if pinned is not None else None)

    def about_and_notes() -> (
        None
    ):  # below the charts, so that the first chart starts on the first screen
        st.caption(f"{about} " + (quant_scope_note(spec) or ""))
        for note in notes():
            st.info(note, icon=":material/info:")

    def plain_cards_and_folded_notes() -> (
        None
    ):  # Presentation mode: three cards, the explanations folded
        plain_cards(comp)
        st.caption(quant_scope_note(spec) or quant_model_note(source, spec))
        warnings = budget_warnings(spec, n_seen)
        more = ([eviction_off] if eviction_off else []) + notes()
        with st.expander(f"Notes ({len(warnings) + len(more) + 1})", icon=":material/info:"):
            for w in warnings:
                st.warning(w, icon=":material/warning:")
            quant_warning_box(spec, comp.memory.kept_tokens)
            st.caption(about)
            for note in more:
                st.info(note, icon=":material/info:")

    members = len(comp.members)
    row, ensemble = row_text(comp), ensemble_text(comp)
    text = has_text_tokens(source.trace)
    # the page's places, top to bottom (Presentation mode: one projector screen, the attention chart first)
    if present:
        top_chart, lock_slot, cards_slot, bottom_chart = (
            st.container(),
            st.container(),
            st.container(),
            st.container(),
        )
        zoom_slot = None
    else:
        cards_slot, lock_slot = st.container(), st.container()
        zoom_slot = st.container() if n_seen > BIN_THRESHOLD else None  # a long row's range boxes
        top_chart, bottom_chart = st.container(), st.container()
    # the charts: the tokens first..last of the row (a long row's range boxes sit above the charts), in bins
    # past BIN_THRESHOLD tokens, so no chart carries more than a few hundred bars whatever the row's length
    first, last = (
        (0, n_seen - 1) if present else ux.token_range(n_seen, (source.key, n_seen), zoom_slot)
    )
    frame, binned = zoom_frame(comp, first, last)
    pinned_frame = zoom_frame(pinned, first, last)[0] if pinned is not None else None
    drawn = {}

    def look(fig, y_title: str):  # Presentation mode: text >= 18 px, a y title that fits
        return style.projector(fig, height=470, y_title=y_title) if present else fig

    def lock_toggle() -> tuple:  # the toggle sits with the charts it locks
        return ux.y_lock(error_extent(frame), attention_extent(frame), present)

    def error_chart(y_range: float | None) -> None:  # the handbook's lesson, two kinds of error
        drawn["error"] = look(
            figures.error_figure(
                frame,
                vs.bars,
                members,
                what=ensemble,
                y_range=y_range,
                text_tokens=text and not binned,
                pinned=pinned_frame,
            ),
            "attention error",
        )
        chart(drawn["error"], key="error_chart", config=style.CHART_CONFIG)
        if not present:
            st.caption(
                "What to look for: the two causes of error apart. Eviction (hatched vermillion) loses whole "
                "tokens and shifts their mass onto the kept ones; quantization (purple) spreads small errors "
                "over every kept token. "
                + (
                    f"Bars are the mean over N = {members} rows ({ensemble}); black ticks the total, with "
                    f"error bars: {BAND_TEXT[vs.bars]}"
                    + (" (assumes independent rows)." if vs.bars == "ci95" else ".")
                    if members > 1
                    else "One row, no ensemble: pick one under View → Error bars over."
                )
            )

    def attention_figure(y_top: float | None) -> None:
        if binned:
            drawn["attention"] = look(
                figures.binned_attention_figure(frame, row=row, y_top=y_top), "attention mass"
            )
        else:
            drawn["attention"] = look(
                figures.attention_figure(
                    frame, row=row, text_tokens=text, pinned=pinned_frame, y_top=y_top
                ),
                "attention",
            )

    def attention_chart() -> None:
        if binned and not present:
            st.caption(
                f"Tokens {first}-{last} of {n_seen}, in {len(frame)} bins of up to "
                f"{int(frame['tokens'].max())} tokens: each bar is the sum of its bin's attention (the mass), "
                "the black tick its largest single token. Zoom to a range of "
                f"{BIN_THRESHOLD} tokens or fewer to see each token (the CSV has every token)."
            )
        elif spec.evicts and not present:
            shown = frame  # the tokens first..last, one row each
            st.markdown(
                f"**Kept tokens{'' if len(shown) == n_seen else f' ({first}-{last})'}:** "
                f"{ranges_text(shown.index[shown['kept']])}"
            )
        chart(drawn["attention"], key="attention_chart", config=style.CHART_CONFIG)
        if not present:
            st.caption(
                "What to look for: grey is the original attention, coloured bars what the compressed cache "
                "gives each kept token (renormalised, so kept tokens gain weight: sinks dotted, the recent "
                "window lined, heavy hitters crossed); hatched vermillion bars are evicted tokens, whose "
                "attention drops to zero."
            )

    # The attention figure is built (~0.1 s) before the cards are drawn, so that the cards and the charts'
    # frames reach the browser together (kvviz.app.charts: the first paint); the lock toggle, drawn into its
    # place below the cards, decides the figure's y-axis, so it runs first.
    with lock_slot:
        y_range, y_top = lock_toggle()
    attention_figure(y_top)
    with cards_slot:
        if present:
            plain_cards_and_folded_notes()
        else:
            cards()
    with top_chart:
        attention_chart()
    with bottom_chart:
        error_chart(y_range)
    if not present:
        about_and_notes()
    fig_att = drawn["attention"]
    if present:
        preset_buttons(n_tokens)
    ux.solver_panel(source.trace, spec, vs.view)
    token_grid(comp, source)
    head_overview(source, spec, vs.view)
    if present:
        return
    ui_formats.key_rotation_expander(source, vs.view)

    stem, link = (
        ux.slug(spec, source.key[0] if source.key[0] != "external" else source.key[1]),
        ux.page_link(),
    )
    header = ux.settings_header(comp, source.label, link, vs.bars)
    downloads = st.container(horizontal=True, gap="small")
    downloads.download_button(
        "Download per-token data (CSV)",
        data=lambda: header + token_frame(comp).to_csv(index=False),
        file_name=f"{stem}.csv",
        mime="text/csv",
        on_click="ignore",
        icon=":material/download:",
    )
    downloads.download_button(
        "Download charts (standalone HTML)",
        data=lambda: figures.figures_html(
            [fig_att, drawn["error"]],
            f"kvviz: {spec.label()}",
            metrics=comp.metrics,
            about=header,
            link=link,
        ),
        file_name=f"{stem}.html",
        mime="text/html",
        on_click="ignore",
        icon=":material/download:",
    )
    st.caption(
        "For slides: every chart's toolbar (top right of the chart, on hover) has a camera button that "
        "saves it as an SVG image in your browser, offline."
    )
    lesson_export(source, spec, vs.view, vs.bars, stem)
    # folded until opened: its tables would load the data grid's scripts (~1.2 MB) into the first paint
    numbers = folded("All numbers", key="_numbers_open")
    with numbers:
        if numbers.open:
            st.dataframe(metrics_table(comp), hide_index=True, key="metrics_table")
            st.dataframe(token_frame(comp), hide_index=True, height=240)  # every token
    ui_ledger.ledger_expander(source, spec, vs.view.step)


run_page(main)
