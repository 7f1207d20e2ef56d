"""Trade-offs: error against memory for every policy over a sweep of budgets and bit widths."""

import streamlit as st

from kvviz import figures, ui
from kvviz.spec import SCORERS, View
from kvviz.sweep import DEFAULT_FRACTIONS, pareto_front, to_csv

# URL value -> (label, sweep column, engine metric)
METRICS = {"tv": ("TV distance", "tv", "tv_distance"),
           "kl": ("KL(compressed ‖ original)", "kl_compressed_vs_original", "kl"),
           "js": ("Jensen–Shannon", "js", "js"),
           "output_error": ("output error", "output_error", "output_rel_error")}


def main() -> None:
    ui.page_setup("Trade-offs: error vs memory",
                  "Every policy over a sweep of budgets (5%–100% of the tokens) and bit widths; the explorer's "
                  "current setting is the star, the Pareto frontier the thick dashed line.")
    settings = ui.sidebar(ensemble=False, head=False)   # the sweep averages over every query head of the layer
    if settings is None or settings.spec is None:
        return
    source, spec, vs = settings.source, settings.spec, settings.view
    c1, c2, c3 = st.columns([1, 2, 1])
    metric = ui.w_choice(c1, "metric", "Error measure", tuple(METRICS), widget="radio",
                         format_func=lambda m: METRICS[m][0])
    methods = ui.w_multi(c2, "methods", "Methods", SCORERS, format_func=ui.SCORER_LABELS.get)
    bits = ui.w_multi(c3, "sweep_bits", "Bit widths", (16, 8, 4, 3, 2), format_func=ui.bits_label)
    if not methods or not bits:
        st.warning("Pick at least one method and one bit width to sweep.", icon=":material/warning:")
        return
    # the sweep and the star average over every query head of the chosen layer
    n_heads = source.trace.n_q_heads
    view = View(layer=vs.view.layer, head=0, step=vs.view.step, ensemble="heads", ensemble_size=n_heads)
    st.caption(f"Each point is the mean over all {n_heads} query head{'s' if n_heads != 1 else ''} of layer "
               f"{view.layer} at the query chosen under View.")
    rows = ui.run_sweep(source, tuple(methods), tuple(sorted(bits, reverse=True)), view, spec)
    if not rows:
        return
    column = METRICS[metric][1]
    valid = [r for r in rows if r[column] is not None]
    front = pareto_front([(r["memory_ratio"], r[column]) for r in valid])
    if len(valid) < len(rows):
        st.info("This source has no values, so output error is not available; showing the rest.", icon=":material/info:")
    comp = ui.run_compare(source, spec, view)
    current = None
    if comp is not None:
        mean = comp.metrics_mean
        current = {"memory_ratio": comp.memory.ratio, column: mean[METRICS[metric][2]], "label": spec.label()}
    fig = figures.tradeoff_figure(valid, column, front, current)
    st.plotly_chart(fig, key="tradeoff_chart")
    st.caption("What to look for: lower-left is better. Where the dashed frontier is made of quantized points, "
               "quantization beats eviction at that memory; eviction curves bend up sharply once the budget drops "
               "below the tokens that hold the mass. Budgets: "
               + ", ".join(f"{f:.0%}" for f in DEFAULT_FRACTIONS) + " of the tokens the query sees.")
    best = [valid[i] for i in front] if front else []
    if best:
        st.markdown("**Pareto-optimal settings**")
        st.dataframe([{k: r[k] for k in ("method", "budget", "bits", "memory_ratio", column)} for r in best],
                     hide_index=True, key="pareto_table")
    d1, d2 = st.columns(2)
    d1.download_button("Download sweep (CSV)", data=lambda: to_csv(rows), file_name="kvviz-sweep.csv",
                       mime="text/csv", on_click="ignore", icon=":material/download:")
    d2.download_button("Download chart (standalone HTML)", data=lambda: figures.figures_html([fig], "kvviz trade-offs"),
                       file_name="kvviz-tradeoffs.html", mime="text/html", on_click="ignore", icon=":material/download:")


main()
ui.sync_url()
