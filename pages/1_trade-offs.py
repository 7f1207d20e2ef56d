"""Trade-offs: error against memory for every policy over a sweep of budgets and bit widths."""

import streamlit as st

from kvviz.plots import export, style, tradeoffs

from kvviz.app.charts import chart
from kvviz.app.compute import run_compare, run_sweep
from kvviz.app.leaderboard import leaderboard_section
from kvviz.app.labels import SCORER_SHORT, bits_label
from kvviz.app.layout import PAGES, page_setup
from kvviz.app.router import run_page
from kvviz.app.params import PARAMS, SCORER_CHOICES
from kvviz.app.sidebar import sidebar
from kvviz.app.store import STORE, w_check, w_choice, w_pills
from kvviz.policies.registry import is_bound
from kvviz.spec import View
from kvviz.analysis.sweep import DEFAULT_FRACTIONS, pareto_front, split_budget, to_csv

# URL value -> (label, sweep column, engine metric)
METRICS = {
    "tv": ("TV distance", "tv", "tv_distance"),
    "kl": ("KL(compressed ‖ original)", "kl_compressed_vs_original", "kl"),
    "js": ("Jensen–Shannon", "js", "js"),
    "mass": ("Attention mass retained", "mass_retained", "mass_retained"),
    "output_error": ("Output error", "output_error", "output_rel_error"),
}
HIGHER_IS_BETTER = {"mass"}
# the Pareto table's columns: (short header, what it means); short so the table fits 1024 px without scrolling
TABLE_COLUMNS = {
    "method": ("method", "the eviction policy"),
    "budget": ("budget", "tokens kept"),
    "budget_fraction": ("share", "the budget as a share of the tokens the query sees"),
    "bits": ("bits", "bits of the kept keys and values (16 = not quantized)"),
    "format": ("format", "the number format of the kept keys and values"),
    "memory_ratio": ("memory", "memory of the compressed cache, × the 16-bit cache"),
}
TABLE_FORMATS = {"budget_fraction": "percent", "memory_ratio": "%.3f×"}


def open_in_explorer(point: dict) -> None:
    """Set the sliders to a clicked sweep point and go to the Explorer."""
    method, budget, bits = point["customdata"][:3]
    fmt = point["customdata"][3] if len(point["customdata"]) > 3 else "int"
    values = dict(sink=0, recent=0, heavy=0) if method == "full" else split_budget(method, int(budget))
    values.update(bits=int(bits), split=False, key_fmt=fmt, value_fmt=fmt)
    if method != "full":
        values["scorer"] = method
    for name, value in values.items():
        st.session_state[STORE][name] = value
        st.session_state.pop(name, None)  # the widget takes the store's value when it renders
    st.switch_page(PAGES["explorer"])


def main() -> None:
    present = page_setup(
        "Trade-offs: error vs memory",
        "Every policy over a sweep of budgets (5%–100% of the tokens) and bit widths; the explorer's "
        "current setting is the star, the Pareto frontier of the real policies the thick dashed line, "
        "the oracle the dotted bound.",
    )
    # the sweep averages over every query head of the layer
    settings = sidebar(ensemble=False, head=False)
    if settings is None or settings.spec is None:
        return
    source, spec, vs = settings.source, settings.spec, settings.view
    # Presentation mode: the chart first, on the projector's first screen, its controls under it
    chart_slot = st.container() if present else None
    metric, log_x, methods, bits, formats = controls()
    if not methods or not (bits or formats):
        st.warning("Pick at least one method and one bit width to sweep.", icon=":material/warning:")
        return
    view = heads_view(source, vs.view, present)
    rows = run_sweep(source, tuple(methods), tuple(sorted(bits, reverse=True)), view, spec, formats=tuple(formats))
    if not rows:
        return
    valid, front = frontier(rows, metric)
    if len(valid) < len(rows):
        st.info(
            "This source has no values, so output error is not available; showing the rest.", icon=":material/info:"
        )
    fig = tradeoffs.tradeoff_figure(
        valid, METRICS[metric][1], front, star(source, spec, view, metric), log_x=bool(log_x)
    )
    if present:  # text >= 18 px, the chart as tall as the first screen allows
        fig = style.projector(fig, height=520, y_title=METRICS[metric][0], legend_right=True)
    with chart_slot or st.container():
        picked = chart(fig, key="tradeoff_chart", config=style.CHART_CONFIG, selectable=True)
    points = [p for p in picked if len(p.get("customdata") or []) >= 3]
    if points:
        open_in_explorer(points[0])
    if present:
        return
    what_to_look_for(metric)
    pareto_table([valid[i] for i in front], metric)
    downloads(rows, fig, source)
    leaderboard_section()


def controls() -> tuple:
    """The measure, the memory axis, the methods, the bit widths and the serving formats to sweep."""
    metric = w_choice(st, "metric", "Measure", tuple(METRICS), widget="radio", format_func=lambda m: METRICS[m][0])
    log_x = w_check(
        st,
        "logx",
        "Log memory axis",
        help="Spreads out the small-memory end, where methods and bit widths differ; off, the 2- and "
        "4-bit curves crowd together at the left.",
    )
    methods = w_pills(st, "methods", "Methods", tuple(SCORER_CHOICES), format_func=SCORER_SHORT.get)
    bits = w_pills(st, "sweep_bits", "Bit widths", (16, 8, 4, 3, 2), format_func=bits_label)
    formats = w_pills(
        st,
        "sweep_formats",
        "Serving formats (FP8 / FP4 / llama.cpp points)",
        PARAMS["sweep_formats"].choices,
        format_func=style.FORMAT_NAMES.get,
        help="Add points in FP8 (8 bits + FP32 scales, per the Advanced FP8 scale), block-scaled "
        "FP4 (NVFP4: 4.5 bits a value, MXFP4: 4.25) or llama.cpp's q8_0 / q4_0 (8.5 / 4.5 bits "
        "a value: an fp16 scale per 32), keys and values alike, with the Advanced rotation "
        "setting.",
    )
    return metric, log_x, methods, bits, formats


def heads_view(source, chosen: View, present: bool) -> View:
    """The sweep and the star average over every query head of the chosen layer, at the chosen query."""
    n_heads = source.trace.n_q_heads
    view = View(layer=chosen.layer, head=0, step=chosen.step, ensemble="heads", ensemble_size=n_heads)
    if not present:
        heads = f"all {n_heads} query heads" if n_heads > 1 else "its one query head"
        st.caption(
            f"Each point is the mean over {heads} of layer {source.trace.layer_numbers[view.layer]} at the "
            "query chosen under View. Click a point to open that setting in the Explorer."
        )
    return view


def frontier(rows: list[dict], metric: str) -> tuple[list[dict], list[int]]:
    """The rows that have the measure, and the Pareto frontier of the real policies among them (indices;
    no real policy reaches the oracle)."""
    column = METRICS[metric][1]
    sign = -1.0 if metric in HIGHER_IS_BETTER else 1.0
    valid = [r for r in rows if r[column] is not None]
    real = [i for i, r in enumerate(valid) if not is_bound(r["method"])]
    front = pareto_front([(valid[i]["memory_ratio"], sign * valid[i][column]) for i in real])
    return valid, [real[j] for j in front]


def star(source, spec, view: View, metric: str) -> dict | None:
    """The Explorer's current setting on the chart: its memory and its measure over the same heads."""
    comp = run_compare(source, spec, view)
    if comp is None:
        return None
    return {
        "memory_ratio": comp.memory.ratio,
        METRICS[metric][1]: comp.metrics_mean[METRICS[metric][2]],
        "label": spec.label(),
    }


def what_to_look_for(metric: str) -> None:
    st.caption(
        (
            "What to look for: upper-left is better."
            if metric in HIGHER_IS_BETTER
            else "What to look for: lower-left is better."
        )
        + " Where the dashed frontier is made of quantized points, quantization beats eviction at that "
        "memory; eviction curves bend sharply once the budget drops below the tokens that hold the mass. "
        "Budgets: " + ", ".join(f"{f:.0%}" for f in DEFAULT_FRACTIONS) + " of the tokens the query sees."
    )


def pareto_table(best: list[dict], metric: str) -> None:
    """The frontier's settings, one row each, in columns short enough for a 1024 px screen."""
    if not best:
        return
    column, label = METRICS[metric][1], METRICS[metric][0]
    st.markdown("**Pareto-optimal settings** (real policies)")
    config = {
        k: st.column_config.Column(name, help=about)
        if k not in TABLE_FORMATS
        else st.column_config.NumberColumn(name, help=about, format=TABLE_FORMATS[k])
        for k, (name, about) in TABLE_COLUMNS.items()
    }
    config[column] = st.column_config.NumberColumn(label, format="%.4f")
    st.dataframe(
        [{**{k: r[k] for k in TABLE_COLUMNS}, column: r[column]} for r in best],
        hide_index=True,
        key="pareto_table",
        column_config=config,
    )


def downloads(rows: list[dict], fig, source) -> None:
    d1, d2 = st.columns(2)
    d1.download_button(
        "Download sweep (CSV)",
        data=lambda: to_csv(rows),
        file_name=f"kvviz-sweep-{source.key[0]}.csv",
        mime="text/csv",
        on_click="ignore",
        icon=":material/download:",
    )
    d2.download_button(
        "Download chart (standalone HTML)",
        data=lambda: export.figures_html([fig], "kvviz trade-offs"),
        file_name=f"kvviz-tradeoffs-{source.key[0]}.html",
        mime="text/html",
        on_click="ignore",
        icon=":material/download:",
    )


run_page(main)
