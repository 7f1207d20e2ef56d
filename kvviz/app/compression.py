"""The sidebar's Compression section: budgets, bits and the Advanced expander, and the Spec they describe."""

from __future__ import annotations

import streamlit as st

from kvviz.app.charts import folded
from kvviz.app.labels import SCORER_LABELS, SCORER_SHORT, bits_label, scorer_help
from kvviz.app.params import BITS_OPTIONS, PARAMS, SCORER_CHOICES
from kvviz.app.store import clamp, state, w_budget, w_check, w_choice, w_number
from kvviz.links import spec_from_values
from kvviz.settings import SETTINGS, Setting, shown
from kvviz.spec import MAX_BUDGET, Spec, SpecError
from kvviz.trace import Trace

ADVANCED = "_advanced_open"  # the Advanced expander's state (open or folded)
HEADLINE_BUDGETS = ("sink", "recent", "heavy")  # token counts whose sliders are always drawn


def compression_section(
    trace: Trace, where=None, budget_only: bool = False, headline=None, percent_of: tuple[int, str] | None = None
) -> Spec | None:
    """Sidebar: the four headline sliders and the Advanced expander. None if the combination is impossible.

    budget_only: only the eviction budget (a page that draws each policy itself and never
    quantizes); the other controls are hidden and the page says so. headline: a container in the
    main area that takes the four headline sliders instead of the sidebar (Presentation mode: one
    widget a setting, so the sliders there are the ones the store and the link follow). percent_of:
    (count, what) a budget typed in % is a share of, where that is not the trace's tokens (the Model
    lab's prompt).
    """
    where = where or st.sidebar
    where.header("Compression")
    n = trace.n_positions
    sink, recent, heavy, bits_slot = budget_sliders(where, headline, n, percent_of)
    if budget_only:
        where.caption(
            "This page compares eviction policies side by side: the scorer is picked per chart and "
            "nothing is quantized, so only the budget sliders are shown."
        )
        return Spec(sink=sink, recent=recent, heavy=heavy)
    split = bool(state()["split"])
    w_choice(
        bits_slot,
        "bits",
        "Quantization bits",
        BITS_OPTIONS,
        widget="select_slider",
        format_func=bits_label,
        disabled=split,
        help="Bits per cached key and value (16 = not quantized). "
        + ("Advanced sets keys and values separately now." if split else ""),
    )
    advanced = folded("Advanced", key=ADVANCED, where=where)
    with advanced:
        if advanced.open:
            advanced_controls(n)
        else:  # its settings keep their stored values (a link's, a preset's), within this trace's range
            clamp_to_trace(n)
    return _spec_or_error(state())


def budget_sliders(where, headline, n: int, percent_of) -> tuple:
    """The sink, recent and heavy-hitter sliders, each with a number box in the sidebar that takes a count or
    a % of the tokens (percent_of: (count, what) a % is a share of, default the trace's n); in the sidebar,
    or in Presentation mode in the `headline` container's first three of four columns. Returns the three
    budgets and the place of the fourth slider (the bits)."""
    projector = headline is not None
    base, of_what = percent_of or (n, "tokens")
    unit = w_choice(
        where,
        "budget_unit",
        "Budgets in",
        ("tokens", "%"),
        widget="radio",
        format_func={"tokens": "tokens", "%": f"% of the {base} {of_what}"}.get,
        help="Type budgets as token counts or as a share of the tokens; the sliders always show counts.",
    )
    if projector:
        where.caption("Presentation mode: the four headline sliders are above the charts.")
    slots = headline.columns(4, gap="medium") if projector else [where] * 4
    budgets = (
        ("sink", "Sink tokens", "The first tokens, always kept: attention sinks (StreamingLLM keeps 4)."),
        ("recent", "Recent window", "The last tokens the query sees (its own included), always kept."),
        # a projector's quarter-width column: the long label wrapped and pushed its slider below the others
        (
            "heavy",
            "Heavy hitters" if projector else "Heavy-hitter budget",
            "How many more tokens the scorer may keep among the rest (H2O's heavy hitters).",
        ),
    )
    sink, recent, heavy = (
        w_budget(slot, name, label, n, unit, box=not projector, base=base, help=about)
        for slot, (name, label, about) in zip(slots, budgets)
    )
    return sink, recent, heavy, slots[3]


def _spec_or_error(values: dict) -> Spec | None:
    """The Spec of the stored values, or None with one line that says why the combination is impossible."""
    try:
        return spec_from_values(values)
    except SpecError as e:
        bits_used = (values["key_bits"], values["value_bits"]) if values["split"] else (values["bits"],)
        hint = (
            " Turn off symmetric quantization or raise the bits to 2 or more."
            if values["symmetric"] and 1 in bits_used
            else ""
        )
        st.error(f"These compression settings are impossible: {e}.{hint}")
        return None


def _trace_range(s: Setting, n: int | None) -> tuple:
    """(lo, hi) of a setting's widget: a token count's range ends at the trace's `n` tokens."""
    p = PARAMS[s.url_name]
    return p.lo, (min(p.hi, n) if n is not None and s.hi == MAX_BUDGET else p.hi)


def clamp_to_trace(n: int) -> None:
    """Advanced folded: its token counts (the residual, the chosen scorer's horizon) are still clamped to
    the trace's n tokens, with the notice their widget gives, so a link reads the same whether or not
    Advanced is open."""
    values = state()
    chosen = {"scorer": values["scorer"], "allocation": values["allocation"]}
    for s in SETTINGS.values():
        in_advanced = s.name not in HEADLINE_BUDGETS
        if s.hi == MAX_BUDGET and in_advanced and (not s.owner or shown(s, chosen)):
            clamp(PARAMS[s.url_name].name, *_trace_range(s, n), s.label or s.name)


def w_setting(where, name: str, n: int | None = None, disabled: bool = False, widget: str | None = None):
    """The widget of one Spec setting, made from its declaration (kvviz.settings): a checkbox, a choice or a
    number box with its label, help, range and option labels. `n`: the tokens of the trace, the top of a
    token count's range."""
    s: Setting = SETTINGS[name]
    p = PARAMS[s.url_name]
    if p.kind == "bool":
        return w_check(where, p.name, s.label or s.name, help=s.help or None)
    if p.kind == "choice":
        options = tuple(p.choices)
        fmt = (
            s.option_labels.get
            if s.option_labels
            else SCORER_SHORT.get
            if s.name == "chunk_scorer"
            else bits_label
            if options == BITS_OPTIONS
            else str
        )
        kind = widget or ("select_slider" if options == BITS_OPTIONS else "radio" if len(options) <= 3 else "selectbox")
        return w_choice(
            where,
            p.name,
            s.label or s.name,
            options,
            widget=kind,
            format_func=fmt,
            help=s.help or None,
            disabled=disabled,
        )
    lo, hi = _trace_range(s, n)  # a token count: at most the trace
    return w_number(
        where, p.name, s.label or s.name, lo, hi, step=s.step, help=s.help or None, fmt=s.fmt, disabled=disabled
    )


def advanced_controls(n: int) -> None:
    """Advanced: the scorer and its settings, the budget allocation, the quantizer and the cache format."""
    scorer = w_choice(
        st, "scorer", "Heavy-hitter scorer", tuple(SCORER_CHOICES), format_func=SCORER_LABELS.get, help=scorer_help()
    )
    allocation = w_setting(st, "allocation", widget="selectbox")
    owned_settings(st, {"scorer": scorer, "allocation": allocation}, n)
    if w_check(st, "split", "Separate key and value bits"):
        w_setting(st, "key_bits")
        w_setting(st, "value_bits")
    for name in ("key_axis", "value_axis"):
        w_setting(st, name)
    w_setting(st, "group_size", widget="selectbox")
    w_setting(st, "residual", n)
    symmetric = w_setting(st, "symmetric")
    w_setting(st, "zero_point", disabled=symmetric)
    w_setting(st, "partial")
    cache_format_controls()
    qmodel = w_setting(st, "quant_model")
    w_setting(st, "noise_sigma", disabled=qmodel != "noise")


def owned_settings(where, chosen: dict, n: int) -> None:
    """The widgets of the settings that belong to the chosen scorer or allocation (SnapKV's window when the
    scorer is SnapKV, AdaKV's α under AdaKV): whatever a scorer's file declares, a plug-in's too."""
    for s in list(SETTINGS.values()):
        if s.owner and s.owner[0] in chosen and shown(s, chosen):
            w_setting(where, s.name, n)


def cache_format_controls() -> None:
    """Advanced: the cache format of keys and values, FP8 scales, rotation, the residual's mode."""
    st.markdown("**Cache format**")
    key_fmt = w_setting(st, "key_format", widget="selectbox")
    value_fmt = w_setting(st, "value_format", widget="selectbox")
    fp8 = bool({"e4m3", "e5m2"} & {key_fmt, value_fmt})
    scale = w_setting(st, "fp8_scale", disabled=not fp8, widget="radio")
    static_fp8_control(fp8 and scale == "static")
    w_setting(st, "rotate")
    w_setting(st, "residual_mode")
    if key_fmt != "int" or value_fmt != "int":
        st.caption(
            "The bits slider sets the integer format only: FP8 stores 8 bits a value, NVFP4 / MXFP4 4, "
            "llama.cpp's q8_0 / q4_0 8.5 / 4.5 (plus their scales, all counted in the memory)."
        )


def static_fp8_control(static: bool) -> None:
    """vLLM's static FP8 scales: calibrated on the context, or 1.0. Off (and stored off) unless the scale is
    static, so a calibration left on never makes another scale impossible."""
    if not static and state()["fp8_cal"]:
        state()["fp8_cal"] = st.session_state["fp8_cal"] = False
    if static:
        w_setting(st, "fp8_calibrate")
