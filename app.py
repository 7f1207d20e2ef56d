"""kvviz Explorer: move the sliders, see what KV-cache compression does to attention.

Run with `streamlit run app.py`. This file is the router and the Explorer page; the
Trade-offs and Concentration pages live in pages/. Widgets -> kvviz -> figures.
"""

import streamlit as st

from kvviz import figures, ui
from kvviz.figures import BAND_TEXT
from kvviz.ui_data import BIN_THRESHOLD, binned_frame, ensemble_text, ranges_text, row_text, token_frame


def explorer() -> None:
    ui.page_setup("KV-cache compression explorer",
                  "Evict tokens (sinks, recent window, heavy hitters) and quantize keys and values; "
                  "compare the compressed attention with the original, token by token.")
    settings = ui.sidebar()
    if settings is None or settings.spec is None:
        return
    source, spec, vs = settings.source, settings.spec, settings.view
    ui.preset_buttons(int(source.trace.query_positions[source.trace.evaluated_queries[-1]]) + 1)
    comp = ui.run_compare(source, spec, vs.view)
    if comp is None:
        return
    n_seen = len(comp.tokens)
    for w in ui.budget_warnings(spec, n_seen):
        st.warning(w, icon=":material/warning:")

    ui.metric_cards(comp)
    p = comp.primary
    st.caption(f"{source.label} · layer {p.layer}, query head {p.head} (KV head {p.kv_head}), query at "
               f"position {p.position} · {spec.label()} · {ui.quant_model_note(source, spec)}")
    for note in comp.notes + tuple(filter(None, [ui.scorer_note(spec, source.trace)])):
        st.info(note, icon=":material/info:")

    members = len(comp.members)
    per_token = token_frame(comp)
    row, ensemble = row_text(comp), ensemble_text(comp)
    if n_seen > BIN_THRESHOLD:
        frame = binned_frame(comp)
        fig_att = figures.binned_attention_figure(frame, row=row)
        fig_err = figures.error_figure(frame, vs.bars, members, what=ensemble)
        st.caption(f"{n_seen} tokens: the charts show {len(frame)} bins of up to {int(frame['tokens'].max())} "
                   "tokens each (the CSV has every token).")
    else:
        fig_att = figures.attention_figure(per_token, row=row)
        fig_err = figures.error_figure(per_token, vs.bars, members, what=ensemble)
        if spec.evicts:
            st.markdown(f"**Kept tokens:** {ranges_text(per_token.index[per_token['kept']])}")

    st.plotly_chart(fig_att, key="attention_chart")
    st.caption("What to look for: grey is the original attention, coloured bars what the compressed cache gives "
               "each kept token (renormalised, so kept tokens gain weight); "
               + ("the vermillion part of each grey bar is mass on evicted tokens, lost to the compressed cache."
                  if n_seen > BIN_THRESHOLD else "crosses mark evicted tokens, whose attention drops to zero."))
    st.plotly_chart(fig_err, key="error_chart")
    st.caption("What to look for: eviction zeroes some tokens (deep negative bars) and shifts their mass onto the "
               "kept ones; quantization spreads small errors over every kept token. "
               + (f"Bars are the mean over N = {members} rows ({ensemble}); error bars: {BAND_TEXT[vs.bars]}"
                  + (" (assumes independent rows)." if vs.bars == "ci95" else ".")
                  if members > 1 else "One row, no ensemble: pick one under View → Error bars over for error bars."))

    ui.token_grid(comp, source)
    ui.head_overview(source, spec, vs.view)

    c1, c2 = st.columns(2)
    c1.download_button("Download per-token data (CSV)", data=lambda: per_token.to_csv(index=False),
                       file_name="kvviz-tokens.csv", mime="text/csv", on_click="ignore", icon=":material/download:")
    c2.download_button("Download charts (standalone HTML)",
                       data=lambda: figures.figures_html([fig_att, fig_err], f"kvviz: {spec.label()}"),
                       file_name="kvviz-explorer.html", mime="text/html", on_click="ignore", icon=":material/download:")
    with st.expander("All numbers"):
        st.dataframe(ui.metrics_table(comp), hide_index=True, key="metrics_table")
        st.dataframe(per_token, hide_index=True, height=240)


st.set_page_config(page_title="kvviz", layout="wide")
page = st.navigation([
    st.Page(explorer, title="Explorer", default=True),
    st.Page("pages/1_Trade-offs.py", title="Trade-offs", url_path="trade-offs"),
    st.Page("pages/2_Concentration.py", title="Concentration", url_path="concentration"),
    st.Page("pages/3_Model_lab.py", title="Model lab", url_path="model-lab"),
    st.Page("pages/4_Decode_timeline.py", title="Decode timeline", url_path="decode-timeline"),
])
page.run()
ui.sync_url()
