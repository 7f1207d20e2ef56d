"""Decode timeline: what each eviction policy holds at every decode step, and what it threw away too early."""

import streamlit as st

from kvviz.app.charts import chart, chart_step
from kvviz.app.compression import compression_section, w_setting
from kvviz.app.labels import ALLOCATION_LABELS, SCORER_SHORT
from kvviz.app.layout import page_setup
from kvviz.app.router import run_page
from kvviz.app.sidebar import layer_picker, source_section
from kvviz.app.store import clamp, show_notices, state, w_choice, w_number, w_pills
from kvviz.plots.timeline import timeline_animation
from kvviz.policies import POLICIES
from kvviz.policies.registry import BOUND
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.spec import Spec, SpecError
from kvviz.analysis.timeline import TIMELINE_POLICIES, timeline
from kvviz.trace import Trace, TraceError

# Shown while the chosen source has no decode steps (the handbook example): a topic shift
# halfway through the decode steps, where history-based eviction visibly fails.
DEMO = SyntheticSpec(context=256, steps=48, topic_shift=12.0)
# every scorer, named as each names itself (kvviz.policies), the history-based ones first
POLICY_LABELS = {name: SCORER_SHORT[name] for name in (*TIMELINE_POLICIES, *POLICIES)}
MAX_STEPS = 256
STEP_REPORT = "_tl_step_report"  # the chart's step slider, as the browser reports it


@st.cache_resource(max_entries=2, show_spinner=False)
def _demo_trace() -> Trace:
    return make_synthetic(DEMO)


@st.cache_resource(max_entries=16, show_spinner="Replaying every policy step by step…")
def _timeline(
    source_key: tuple,
    budget: tuple,
    layer: int,
    kv_head: int,
    need: float,
    policies: tuple,
    _trace: Trace,
    every: int = 0,
):
    sink, recent, heavy, allocation = budget
    return timeline(
        _trace,
        Spec(sink=sink, recent=recent, heavy=heavy, scorer=BOUND, allocation=allocation),
        layer=layer,
        kv_head=kv_head,
        policies=policies,
        need=need,
        max_steps=MAX_STEPS,
        compress_every=every,
    )


@st.cache_resource(max_entries=16, show_spinner=False)
def _animation(timeline_key: tuple, shift_step, step: int, present: bool, _tl):
    """The whole timeline as one figure with a frame per step, drawn at `step` (built once per setting)."""
    return timeline_animation(_tl, step, shift_step=shift_step, labels=POLICY_LABELS, present=present)


def _chart_stepped() -> None:
    """The chart's step slider came to rest on another step (or ▶ Play paused there): the table and the
    link follow it."""
    report = st.session_state.get(STEP_REPORT) or {}
    step = report.get("step") if hasattr(report, "get") else getattr(report, "step", None)
    if step is not None:
        state()["tl_step"] = int(step)


def _chart_start(chart_key: tuple, step: int) -> int:
    """The step the chart is drawn at: the linked step when its settings first appear, then kept, so that
    the run its own slider's report starts sends the same chart (Streamlit keeps it on screen, where the
    slider rests) instead of a new one."""
    ss = st.session_state
    if ss.get("_tl_chart_for") != chart_key:
        ss["_tl_chart_for"], ss["_tl_chart_step"] = chart_key, step
    return ss["_tl_chart_step"]


def _step_view(tl, step: int) -> None:
    """That step's table, below the chart whose step slider and ▶ Play choose the step: the browser reports
    where the slider rests (kvviz.app.charts.chart_step), and the run that starts writes it in the link.
    (Not a fragment: a fragment's id is its place on the page, which the notes above it move, and a report
    sent for a fragment a full run has since renamed is dropped.)"""
    chart_step("tl_animation", step, STEP_REPORT, _chart_stepped)
    p = int(tl.positions[step])
    rows = tl.step_rows(step, POLICY_LABELS)
    st.markdown(f"**Step {step}**: query at position {p}, layer {tl.model_layer}, KV head {tl.kv_head}")
    st.dataframe(rows, hide_index=True, width="stretch")


def main() -> None:
    present = page_setup(
        "Decode timeline: what eviction throws away too early",
        "Each row is a decode step, each column a token. H2O and TOVA decide step by step from "
        "the attention they have seen; StreamingLLM by position; the oracle sees the step's own "
        "attention (the bound). Regret is the attention the full model put on tokens a policy "
        "had already evicted.",
    )
    source = source_section()
    if source is None:
        show_notices()
        return
    trace, key, demo = source.trace, source.key, not source.trace.has_later_queries
    if demo:  # the sidebar's budget runs on the demo, so every control shown is used
        trace, key = _demo_trace(), ("demo",)
    spec = compression_section(trace, budget_only=True)
    show_notices()
    if spec is None:
        return
    if demo and not present:  # presenting, one line under the chart says it
        demo_note(source)
    if not spec.evicts:
        st.warning(
            "Eviction is off (sink, recent and heavy are all 0): every policy keeps everything. "
            "Set a budget in the sidebar.",
            icon=":material/warning:",
        )
        return
    layer, kv_head, need, policies, allocation, every = controls(trace, present)
    if not policies:
        st.warning("Pick at least one policy.", icon=":material/warning:")
        return
    n_later = len(trace.later_queries)
    if n_later > MAX_STEPS:
        st.caption(f"Showing the first {MAX_STEPS} of {n_later} decode steps (the cap that keeps this page quick).")
    budget = (spec.sink, spec.recent, spec.heavy)
    try:
        tl = _timeline(key, (*budget, allocation), layer, kv_head, need, tuple(policies), trace, every)
    except (SpecError, TraceError) as e:
        st.error(f"The timeline cannot be computed: {e}")
        return
    chart_slot = st.container() if present else None  # presenting, the chart first: the notes below it
    if not timeline_notes(tl, every):
        return
    shift_step = topic_shift(trace)
    regret_cards(tl, present)
    tkey = (key, budget, layer, kv_head, need, tuple(policies), every)
    # built once per setting, at the linked step; ▶ Play and the step slider under it run in the browser
    step = int(clamp("tl_step", 0, tl.n_steps - 1, "Decode step"))
    start = _chart_start((tkey, shift_step, present), step)  # a new chart (any setting of it) opens at the step
    chart(_animation(tkey, shift_step, start, present, tl), key="tl_animation", where=chart_slot)
    _step_view(tl, step)
    token_history(tl)
    st.caption(
        "What to look for: orange cells are tokens the full model needed at that step (attention ≥ "
        f"{tl.need:g}) that the policy had already evicted. The oracle has none by construction; after a "
        "topic shift H2O and TOVA have many, because nothing before the shift had looked at those tokens."
        + (" (Demo data: choose a source with decode steps in the sidebar.)" if demo else "")
    )


def demo_note(source) -> None:
    st.info(
        f"The {source.label} has no decode steps, so this page runs the sidebar's budget on a built-in "
        f"demo: a synthetic pattern of {DEMO.context} context tokens and {DEMO.steps} decode steps whose "
        "topic shifts halfway (the sliders now range over its tokens). Choose **Synthetic pattern** in the "
        "sidebar (its *Topic shift* knob is under Pattern knobs), or a real trace with decode steps, to "
        "explore your own.",
        icon=":material/info:",
    )


def controls(trace, present: bool) -> tuple:
    """The layer, KV head, the 'needed' share, the policies, the allocation and compress-every: above the
    chart, or presenting, in the sidebar (the chart first on the screen)."""
    where = st.sidebar if present else st
    if present:
        where.header("Timeline")
    c1, c2, c4 = (where,) * 3 if present else st.columns(3)
    layer = layer_picker(c1, trace, "tl_layer")  # the model's own number in the box and the link; a position
    kv_head = w_number(
        c2,
        "tl_kv_head",
        "KV head",
        0,
        trace.n_kv_heads - 1,
        disabled=trace.n_kv_heads == 1,
        help="Eviction is decided per KV head; the attention shown is the mean over the query heads that share it.",
    )
    need = w_number(
        c4,
        "tl_need",
        "Needed at ≥ (attention share)",
        0.001,
        1.0,
        step=0.005,
        fmt="%.3f",
        help="A token counts as needed at a step when the full model gives it at "
        "least this share of that step's attention.",
    )
    # pills, a row of their own: every policy's name whole (a select box's chips were cut to "Str…" at 1024 px)
    policies = w_pills(where, "tl_policies", "Policies", tuple(POLICY_LABELS), format_func=POLICY_LABELS.get)
    allocation = w_choice(
        where,
        "allocation",
        "Budget allocation",
        ("uniform", "adakv", "pyramid"),
        format_func=ALLOCATION_LABELS.get,
        widget="radio",
        help="AdaKV: this layer's budget goes to the top scores across its KV heads (heads "
        "differ in length); PyramidKV: each layer its own budget, falling with depth.",
    )
    every = int(w_setting(where, "compress_every", trace.n_positions))
    return layer, int(kv_head), float(need), policies, allocation, every


def timeline_notes(tl, every: int) -> bool:
    """Which policies are not drawn and why, and when the one-shot ones compressed again; False when no
    chosen policy runs."""
    for name, why in tl.skipped.items():
        st.info(f"{POLICY_LABELS.get(name, name)} is not drawn: {why}", icon=":material/info:")
    if every and any(len(pt.compressed_after) for pt in tl.policies.values()):
        steady = ", ".join(POLICY_LABELS.get(n, n) for n in tl.decides_every_step)
        st.caption(
            f"The one-shot scorers compress again every {every} decode steps (the purple lines "
            "between two steps): between those moments their cache grows; then it is scored again over "
            "everything it holds and cut back to the budget."
            + (f" {steady} decide at every step anyway and run as always." if steady else "")
        )
    if not tl.policies:
        st.warning("None of the chosen policies runs with this allocation; pick another.", icon=":material/warning:")
        return False
    return True


def topic_shift(trace) -> int | None:
    """The synthetic pattern's topic shift, said under the controls: its decode step (None: no shift)."""
    if trace.meta.get("source") != "synthetic" or trace.meta.get("synthetic", {}).get("topic_shift", 0) <= 0:
        return None
    shift = trace.meta.get("shift_position")
    st.caption(
        f"Topic shift at position {shift} (decode step {shift - trace.context_len}); the late "
        f"anchor tokens {trace.meta.get('shift_tokens')} are what the queries after it need."
    )
    return int(shift) - trace.context_len


def regret_cards(tl, present: bool) -> None:
    """One card per policy: its mean regret, and how many tokens it evicted that a later step needed."""
    per_row = 2 if present else len(tl.policies)  # presenting, wider cards: the larger text wraps by words
    cols = [c for _ in range(0, len(tl.policies), per_row) for c in st.columns(per_row)]
    for col, (name, pt) in zip(cols, tl.policies.items()):
        col.metric(
            f"{POLICY_LABELS[name]} mean regret",
            f"{pt.regret_mean:.3f}",
            border=True,
            help="Mean over the decode steps of the attention mass on evicted tokens.",
        )
        col.caption(f"{int(pt.evicted_needed.sum())} tokens evicted, then needed")


def token_history(tl) -> None:
    """A token some policy evicted and a later step needed: what each policy did with it, step by step."""
    needed = tl.needed_tokens()
    if not needed:
        return
    pick = st.selectbox(
        "A token's history (tokens some policy evicted and a later step needed)",
        needed,
        format_func=lambda i: f"{i}: {tl.tokens[i]!r}",
        key="tl_token",
    )
    st.markdown(
        "\n".join(
            f"- **{POLICY_LABELS[name]}**: {pt.history(int(pick), tl.positions, tl.context_len)}"
            for name, pt in tl.policies.items()
        )
    )


run_page(main)
