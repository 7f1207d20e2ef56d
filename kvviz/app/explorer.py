"""Explorer widgets for a class: pin and compare (A/B), a locked y-axis, the target solver and
downloads named by their settings.

Streamlit glue over the core: the pinned setting is the compression controls' values
encoded in the URL (`pin=sink:4,heavy:8,...`), the solver is kvviz.analysis.solve, the files are
kvviz.plots.figures / kvviz.analysis.frames output.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlencode

import streamlit as st

from kvviz.analysis.frames import row_text
from kvviz.app.cards import fmt_pct
from kvviz.app.charts import folded
from kvviz.app.compression import spec_from_values
from kvviz.app.notes import quant_model_note
from kvviz.app.params import PARAMS, compression_params, read_settings
from kvviz.app.store import STORE, link_params, notice, settings_dict, w_choice, w_number
from kvviz.engine import Comparison
from kvviz.plots import figures, style
from kvviz.spec import Spec, SpecError, View

PIN_NONE = "default"  # a pin of the all-default compression settings


@dataclass
class Shown:
    """What the Explorer shows: the source, the settings, the comparison (and the pinned setting A's), and
    once the places are laid out the tokens first..last of the row as the charts draw them. Declared here,
    not in the page script, which runs on every move: a dataclass is made by compiling its methods (~0.6 ms
    a run)."""

    source: object
    spec: object
    vs: object
    comp: object
    pinned_spec: object
    pinned: object
    present: bool
    frame: object = None
    binned: bool = False
    pinned_frame: object = None
    first: int = 0
    last: int = 0

    @property
    def n_seen(self) -> int:
        return len(self.comp.tokens)

    @property
    def about(self) -> str:  # under the cards: where the numbers come from
        source, spec = self.source, self.spec
        return f"{source.label} · {row_text(self.comp)} · {spec.label()} · {quant_model_note(source, spec)}"

    def look(self, fig, y_title: str):  # Presentation mode: text >= 18 px, a y title that fits
        return style.projector(fig, height=470, y_title=y_title) if self.present else fig


# --- pin and compare -------------------------------------------------------------------------


def pin_encode(values: dict) -> str:
    """The compression settings that differ from their defaults, as 'name:value,...'."""
    parts = [f"{k}:{PARAMS[k].encode(values[k])}" for k in compression_params() if values[k] != PARAMS[k].default]
    return ",".join(parts) or PIN_NONE


def pin_decode(text: str) -> tuple[dict, list[str]]:
    """(compression values, notices) of a pin; unknown or bad entries are dropped with a notice."""
    values = {k: PARAMS[k].default for k in compression_params()}
    if text == PIN_NONE:
        return values, []
    pairs = [item.partition(":")[::2] for item in filter(None, text.split(","))]
    read, notes = read_settings(
        pairs,
        compression_params(),
        prefix="Pinned setting: ",
        unknown="The pinned setting's `{name}` is not a compression setting; ignored.",
    )
    return {**values, **read}, notes


def _pin() -> None:
    store = settings_dict()
    st.session_state[STORE]["pin"] = pin_encode(store)


def _unpin() -> None:
    st.session_state[STORE]["pin"] = ""


def pinned_spec() -> Spec | None:
    """The pinned setting A (None if nothing is pinned or it cannot be built: a notice says why)."""
    text = settings_dict()["pin"]
    if not text:
        return None
    values, notes = pin_decode(text)
    for n in notes:
        notice(n)
    try:
        return spec_from_values(values)
    except SpecError as e:
        notice(f"The pinned setting cannot be used ({e}); pin again.")
        return None


def pin_controls(spec: Spec, pinned: Spec | None) -> None:
    with st.container(horizontal=True, vertical_alignment="center", gap="small"):
        st.button(
            "Pin this setting as A",
            key="_pin",
            on_click=_pin,
            icon=":material/push_pin:",
            help="Keep the current compression settings as A; change the sliders and see A next to them "
            "(open diamonds on the charts, differences on the cards). The pin is in the link.",
        )
        if pinned is not None:
            st.button("Unpin A", key="_unpin", on_click=_unpin)
            st.markdown(f"**A:** {pinned.label()} · **now:** {spec.label()}", width="content")


# --- a y-axis that does not jump ------------------------------------------------------------------


def nice_ceiling(x: float) -> float:
    """The next 1, 2 or 5 x 10^k at or above x (0.043 -> 0.05)."""
    if not x > 0 or not math.isfinite(x):
        return 0.1
    k = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * 10**k >= x * (1 - 1e-12):
            return float(m * 10**k)
    return float(10 ** (k + 1))


def y_lock(extent: float, top: float, present: bool = False, where=None) -> tuple[float | None, float | None]:
    """A toggle that freezes the charts' y-axes (in the URL): the error chart at ±range, the attention
    chart at [0, top]. Returns (±range, top), None where automatic.

    Presentation mode locks them at its first view (a move then changes the bars, not the scale);
    turned off there, the link says so (ylock=-1), so it is not locked again on the next run."""
    store, ss = ss_store(), st.session_state
    where = where or st

    def lock() -> None:
        store["ylock"] = ss["ylock"] = min(1.0, nice_ceiling(extent))
        store["alock"] = min(1.0, nice_ceiling(top))

    if present and store["ylock"] == 0:
        lock()

    def toggled() -> None:
        if ss["_ylock_on"]:
            lock()
        else:
            store["ylock"] = ss["ylock"] = -1.0 if present else 0.0
            store["alock"] = 0.0

    ss["_ylock_on"] = locked = store["ylock"] > 0
    # the range box beside the toggle only while locked (unlocked, the toggle alone: fewer elements a run)
    c1, c2 = where.columns([2, 1], vertical_alignment="center") if locked else (where, None)
    c1.toggle(
        "Lock the charts' y-axes",
        key="_ylock_on",
        on_change=toggled,
        help="Moving a slider then changes the bars, not the scale: compare settings by eye.",
    )
    if not locked:
        return None, None
    y = (
        float(store["ylock"])
        if present
        else float(w_number(c2, "ylock", "± range", 0.0001, 1.0, step=0.005, fmt="%.4f"))
    )
    return y, (float(store["alock"]) or None)


# --- a long row: the charts' token range -----------------------------------------------------------


def _set_range(first: int, last: int, n: int) -> None:
    """A range button's on_click: the boxes' new values (what the next run's boxes read)."""
    store, ss = ss_store(), st.session_state
    store["zoom_from"] = ss["zoom_from"] = int(first)
    ss["zoom_to"] = int(last)
    store["zoom_to"] = -1 if last >= n - 1 else int(last)


def token_range(n: int, scope, where=None) -> tuple[int, int]:
    """The tokens [first, last] the charts show of a row of n (in the link: zoom_from, zoom_to): two number
    boxes, buttons that page by the range's width, and one back to the whole row. Drawn only for a row of
    more than BIN_THRESHOLD tokens (a shorter one shows every token); a range of more than that many tokens
    is drawn in bins (kvviz.analysis.frames.zoom_frame), so a single token is a range of one."""
    from kvviz.analysis.frames import BIN_THRESHOLD
    from kvviz.app.store import w_last_is_minus_one

    if n <= BIN_THRESHOLD:
        return 0, n - 1
    where = where or st
    c1, c2, c3 = where.columns([1, 1, 1.2], vertical_alignment="bottom")
    first = int(
        w_number(
            c1,
            "zoom_from",
            "Charts from token",
            0,
            n - 1,
            help="Zoom the charts into a range of the row, down to one token.",
        )
    )
    last = w_last_is_minus_one(
        c2, "zoom_to", "to token", n, scope, help=f"Ranges of more than {BIN_THRESHOLD} tokens are drawn in bins."
    )
    lo, hi = sorted((first, last))
    width = hi - lo + 1
    with c3.container(horizontal=True, gap="small"):
        back, ahead = max(0, lo - width), min(n - 1, hi + width)
        st.button(
            "◀",
            key="_zoom_back",
            disabled=lo == 0,
            help=f"The {width} tokens before",
            on_click=_set_range,
            args=(back, back + width - 1, n),
        )
        st.button(
            "▶",
            key="_zoom_ahead",
            disabled=hi == n - 1,
            help=f"The {width} tokens after",
            on_click=_set_range,
            args=(ahead - width + 1, ahead, n),
        )
        st.button(
            "Whole row", key="_zoom_all", disabled=(lo, hi) == (0, n - 1), on_click=_set_range, args=(0, n - 1, n)
        )
    return lo, hi


# --- ask for a target ------------------------------------------------------------------------------


def _solve(trace, base: Spec, view: View) -> None:
    from kvviz.analysis.solve import solve

    store, ss = ss_store(), st.session_state
    target = float(store["solve_target"])
    try:
        sol = solve(
            trace, base, view, **({"target_mass": target} if store["solve_kind"] == "mass" else {"target_tv": target})
        )
    except SpecError as e:
        ss["_solve_msg"] = ("error", f"No cache meets that target: {e}.")
        return
    for name in ("sink", "recent", "heavy"):
        store[name] = ss[name] = getattr(sol.spec, name)
    what = (
        "keeps ≥ " + fmt_pct(target) + " of the attention" if sol.metric == "mass_retained" else f"has TV ≤ {target:g}"
    )
    below = "" if sol.below is None else f"; one token less gives {sol.below:.4f}"
    ss["_solve_msg"] = (
        "success",
        f"Smallest cache that {what} with {base.scorer} at {base.key_bits}/{base.value_bits} "
        f"bits: **{sol.budget} of {sol.tokens} tokens** (sink {sol.spec.sink} + recent "
        f"{sol.spec.recent} + heavy {sol.spec.heavy}), reaching {sol.value:.4f}{below}. "
        "Applied to the sliders.",
    )


def ss_store() -> dict:
    return st.session_state[STORE]


def solver_panel(trace, spec: Spec, view: View) -> None:
    from kvviz.analysis.solve import SPLIT_RULE

    box = folded("Find the smallest cache for a target", key="_solver_open", icon=":material/target:")
    with box:
        if not box.open:
            return
        c1, c2, c3 = st.columns([2, 1, 1], vertical_alignment="bottom")
        kind = w_choice(
            c1,
            "solve_kind",
            "Target",
            ("mass", "tv"),
            widget="radio",
            format_func={"mass": "attention mass ≥", "tv": "TV distance ≤"}.get,
        )
        w_number(c2, "solve_target", "value (0-1)", 0.001, 1.0, step=0.01, fmt="%.3f")
        c3.button(
            "Find and apply",
            key="_solve",
            type="primary",
            on_click=_solve,
            args=(trace, spec.with_(sink=0, recent=0, heavy=0), View(layer=view.layer, head=view.head, step=view.step)),
        )
        st.caption(
            f"For the row shown, with the current scorer and quantizer. Split rule: {SPLIT_RULE}. "
            "Smallest means one token less misses the target"
            + (" (attention mass: the exact smallest for one-shot policies)." if kind == "mass" else ".")
        )
        msg = st.session_state.pop("_solve_msg", None)
        if msg:
            (st.success if msg[0] == "success" else st.error)(msg[1])


# --- take-aways ----------------------------------------------------------------------------------


def slug(spec: Spec, source_label: str) -> str:
    """A file-name stem naming the settings: 'kvviz-handbook-h2o-s4-r8-h2-16bit'."""
    bits = "16bit" if not spec.quantizes else f"k{spec.key_bits}v{spec.value_bits}bit"
    if spec.quantizes and (spec.key_format != "int" or spec.value_format != "int"):
        name = lambda fmt, b: f"{b}bit" if fmt == "int" else fmt  # noqa: E731
        bits = f"k-{name(spec.key_format, spec.key_bits)}-v-{name(spec.value_format, spec.value_bits)}"
    if spec.quantizes and spec.rotate != "none":
        bits += "-rotated"
    evict = f"{spec.scorer}-s{spec.sink}-r{spec.recent}-h{spec.heavy}" if spec.evicts else "no-eviction"
    text = f"kvviz-{source_label}-{evict}-{bits}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower()


def settings_header(comp: Comparison, source_label: str, link: str, bars: str) -> str:
    """'# key: value' lines that open the CSV: what was computed, and what each band column holds."""
    lines = [
        f"kvviz per-token data: {source_label}",
        f"settings: {comp.spec.label()}",
        f"row: {row_text(comp)}",
        f"ensemble: {comp.ensemble or 'none'}, N = {len(comp.members)} rows",
        "error = compressed - original attention of that row; error_eviction + error_quantization = error",
        "error_mean: ensemble mean; error_std_sample: sample std (n - 1); error_ci95_lo/hi: 95% t-interval "
        "for the mean; error_min/max: range of the members",
        f"the chart draws: {figures.BAND_TEXT[bars]}",
        f"link: {link}",
    ]
    return "".join(f"# {line}\n" for line in lines)


def page_link() -> str:
    """This view's address, query string included (what reproduces it)."""
    try:
        url = st.context.url or ""
    except AttributeError:  # older Streamlit
        url = ""
    query = urlencode(link_params())
    base = url.split("?")[0]
    return f"{base}?{query}" if query else base
