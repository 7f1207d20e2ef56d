"""The URL-backed settings store and the widgets that read and write it.

Every control's value lives in one session-wide store (`state()`), read from the link on the
session's first run and written to the address bar (non-default values only) by `sync_url`, so a
link reproduces the view; a value in a link that is unknown, unparsable or out of range is clamped
or ignored with a visible notice, never a crash. Widgets read the store before they render and
write it back, so values survive page switches and widgets that are hidden for a while (the
Advanced bits, a source's knobs).

When the link is written. Every settings widget hands its new value to the store in its on_change
callback (`_take`), and buttons change the store in theirs; Streamlit runs callbacks before the
script, so `sync_url()` as the run's first act (app.py, a fragment's first line) puts the new link
in the address bar before any computing starts, and the run's last act writes it again (a page may
clamp a value on the way). Written only at the end, as it was, the link lagged the screen by a whole
run -- 3 s on a first move -- and a copied link held the view before.

Why not Streamlit's own `bind="query-params"` (1.67): it writes a widget's *shown* value, so every
link of ours would change meaning -- select boxes, radios and select sliders put their labels in the
URL ("TOVA (last query)", not `scorer=tova`), checkboxes true/false (not `present=1`), multi-choices
repeated parameters (not `methods=h2o,tova`) -- and old links would be dropped as invalid. It also
resets an out-of-range value to the widget's default without a word (we clamp, with a notice, to a
range that depends on the source), keeps a link's values only for the page it opens on (a page
switch drops the others from the address bar), and refuses writes to a bound parameter (presets,
the solver, a chart click set them). What is left for it to do here -- plain numbers on one page
with a fixed range -- would make a second writer of the same address bar, so nothing binds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import streamlit as st

from kvviz.app.params import PARAMS, read_settings
from kvviz.links import number_text

STORE = "_kvviz_state"
NOTICES = "_kvviz_notices"
# a budget slider moved in this round of callbacks (see w_budget)
MOVED = "_kvviz_budget_slider_moved"
LINKED = "_kvviz_linked"


def state() -> dict:
    """The session's settings (the live dict the widgets read and write), read from the URL on the
    session's first run."""
    ss = st.session_state
    if STORE not in ss:
        pairs = [(name, (st.query_params.get_all(name) or [""])[-1]) for name in st.query_params]
        read, notes = read_settings(pairs, unknown="The link's `{name}` is not a kvviz setting; ignored.")
        ss[STORE] = {**{name: p.default for name, p in PARAMS.items()}, **read}
        ss[NOTICES] = notes
        ss[LINKED] = frozenset(name for name in st.query_params if name in PARAMS)
    return ss[STORE]


def in_link(name: str) -> bool:
    """Whether the link the session opened with set this setting (the address bar is rewritten since)."""
    state()
    return name in st.session_state[LINKED]


def settings_dict() -> dict:
    return dict(state())


# this run's place for notices that come after show_notices (a page's own boxes)
SLOT = "_kvviz_notice_slot"


def notice(text: str) -> None:
    """Queue a visible notice (shown by `show_notices`; one that comes later in the run is shown below them)."""
    state()
    if text not in st.session_state[NOTICES]:
        st.session_state[NOTICES].append(text)
        slot = st.session_state.get(SLOT)
        if slot is not None:
            slot.warning(f"**Setting adjusted:** {text}", icon=":material/warning:")


def show_notices() -> None:
    notes = st.session_state.get(NOTICES) or []
    if notes:
        st.warning(
            "**Some settings were adjusted:**\n\n" + "\n".join(f"- {n}" for n in notes), icon=":material/warning:"
        )
        st.button("Dismiss", key="_dismiss_notices", on_click=lambda: st.session_state[NOTICES].clear())
    st.session_state[SLOT] = st.container()


def link_params() -> dict[str, str]:
    """The link's query parameters: every setting that differs from its default, encoded."""
    return {name: PARAMS[name].encode(v) for name, v in state().items() if v != PARAMS[name].default}


def sync_url() -> None:
    """Write the store into the address bar (non-default values only).

    Always sent, even when the server's copy of the query already matches: that copy is what the
    browser sent with this run's request, and a message from an earlier, interrupted run may have
    changed the address bar since; the browser ignores a query it already shows. The last run
    therefore has the last word."""
    st.session_state.pop(MOVED, None)  # this round's callbacks are over (the run's first act)
    st.session_state.pop(SLOT, None)  # the last run's notice slot is not this run's
    relink()


def relink() -> None:
    """Write the store into the address bar now, mid-run: for a section that chose a setting on the way (a
    default the data decides, a clamp) before it draws, so that no chart reaches the browser ahead of the
    link that describes it (the run's last `sync_url` would come after the chart)."""
    st.query_params.from_dict(link_params())


def _take(name: str, from_widget: Callable | None = None, scope=None) -> None:
    """A settings widget's on_change: its new value into the store before the script runs (so the
    run's first `sync_url` links to it). `scope`: what the raw value counts in (see `_bind`)."""
    ss = st.session_state
    if name not in ss or (scope is not None and ss.get(f"_scope_{name}") != scope):
        return
    state()[name] = from_widget(ss[name]) if from_widget else ss[name]


def _bind(name: str, lo=None, hi=None, label: str = "", to_widget=None, from_widget=None, scope=None) -> None:
    """Before a widget renders: take its last value into the store, clamp to [lo, hi], seed it.

    `scope` is what the widget's raw value is relative to (the query step widget counts
    steps of one source): a widget last shown in another scope is not read back, so the
    stored setting, not a number from another source, decides the value after a switch.
    """
    store, ss = state(), st.session_state
    scope_key = f"_scope_{name}"
    same_scope = scope is None or ss.get(scope_key) == scope
    if name in ss and same_scope:
        store[name] = from_widget(ss[name]) if from_widget else ss[name]
    if scope is not None:
        ss[scope_key] = scope
    v = clamp(name, lo, hi, label)
    # Always re-seed: after a page switch the widget is a new element whose state would
    # otherwise start from its default, not from the value the user chose on another page.
    ss[name] = to_widget(v) if to_widget else v


def clamp(name: str, lo=None, hi=None, label: str = ""):
    """The stored setting clamped to [lo, hi], with a notice when it was outside; returns it. What a
    widget does before it renders, and what a setting whose widget is folded away still needs (a
    range that depends on the source)."""
    store = state()
    v = store[name]
    if lo is not None and hi is not None and not lo <= v <= hi:
        c = min(max(v, lo), hi)
        notice(
            f"{label or name} {number_text(v)} is out of range ({number_text(lo)}-{number_text(hi)}); "
            f"clamped to {number_text(c)}."
        )
        store[name] = v = c
        relink()
    return v


def _after(name: str, value, from_widget=None) -> Any:
    store = state()
    store[name] = from_widget(value) if from_widget else value
    return store[name]


def w_slider(where, name: str, label: str, lo: int, hi: int, help: str | None = None) -> int:
    _bind(name, lo, hi, label)
    if hi <= lo:  # a slider needs a range; a single possible value is shown as text
        where.caption(f"{label}: {lo}")
        return _after(name, lo)
    return _after(name, where.slider(label, lo, hi, key=name, help=help, on_change=_take, args=(name,)))


def w_budget(
    where, name: str, label: str, n: int, unit: str, help: str | None = None, box: bool = True, base: int | None = None
) -> int:
    """A token budget: a slider (counts, 0..n) and a number box beside it (counts or % of `base`
    tokens, n by default: the Model lab's budgets are shares of its prompt, not of its slider's range).

    Typing a target beats slider hunting on long traces (a 0-544 slider is 2.4 tokens a
    pixel); both widgets edit the one stored count. box=False: the slider alone (Presentation
    mode's narrow columns).
    """
    _bind(name, 0, n, label)
    base = max(base or n, 1)
    percent_range = f"0-{number_text(round(100.0 * n / base, 1))}%"
    if not box:
        if n <= 0:
            where.caption(f"{label}: 0")
            return _after(name, 0)
        return _after(name, where.slider(label, 0, n, key=name, help=help, on_change=_take, args=(name,)))
    ss, box = st.session_state, f"_box_{name}"
    value = state()[name]
    ss[box] = value if unit == "tokens" else round(100.0 * value / base, 1)

    def clamped(count, typed_value) -> int:
        """The typed count within 0..n; out of range: clamped with the notice a link gets."""
        c = int(min(max(count, 0), n))
        if c != count:
            notice(
                f"{label} {number_text(typed_value)}{'' if unit == 'tokens' else '%'} is out of range "
                f"({'0-' + str(n) if unit == 'tokens' else percent_range}); clamped to {c} tokens."
            )
        return c

    # Each run sets the box to the slider's count. A run that a quick second key press supersedes can
    # leave that value unseen by the browser, which then sends the box's old value with the slider's
    # next move, as if typed (measured: sink 4 -> 5 -> 6 by two presses ended at 4). One interaction
    # moves one widget, so when the slider moved in this round, the box's "change" is that echo.
    def typed() -> None:
        if ss.get(MOVED) == name:
            return
        count = ss[box] if unit == "tokens" else round(ss[box] * base / 100.0)
        state()[name] = ss[name] = clamped(count, ss[box])

    def slid() -> None:
        ss[MOVED] = name
        state()[name] = ss[name]

    left, right = where.columns([3, 2], vertical_alignment="bottom")
    if n > 0:
        left.slider(label, 0, n, key=name, help=help, on_change=slid)
    else:
        left.caption(f"{label}: 0")
    # no min / max on the box: the browser would keep an out-of-range number in a red box and send nothing;
    # typed() clamps it with a notice instead
    right.number_input(
        f"{label} ({'tokens' if unit == 'tokens' else '%'})",
        step=1 if unit == "tokens" else 0.5,
        key=box,
        on_change=typed,
        label_visibility="collapsed",
        help=f"Type the {label.lower()} in {'tokens' if unit == 'tokens' else f'% of {base} tokens'} "
        f"({'0-' + str(n) if unit == 'tokens' else percent_range}).",
    )
    return _after(name, int(ss.get(name, value)) if n > 0 else 0)


def w_number(
    where,
    name: str,
    label: str,
    lo,
    hi,
    step=None,
    help: str | None = None,
    fmt: str | None = None,
    disabled: bool = False,
):
    # a typed number out of [lo, hi] is clamped here, with a notice
    _bind(name, lo, hi, label)
    # no min / max on the widget: the browser would keep an out-of-range number in a red box, send nothing,
    # and show the range only on hover; the range goes in the help instead
    span = f"Range {number_text(lo)}-{number_text(hi)}; a number outside it is clamped."
    kwargs = dict(
        key=name,
        help=f"{help} {span}" if help else span,
        disabled=disabled,
        on_change=_take,
        args=(name,),
        step=step if step is not None else (1 if isinstance(lo, int) else 0.01),
    )
    if fmt:
        kwargs["format"] = fmt
    return _after(name, where.number_input(label, **kwargs))


def w_choice(
    where,
    name: str,
    label: str,
    options: Sequence,
    widget: str = "selectbox",
    format_func: Callable = str,
    help: str | None = None,
    disabled: bool = False,
):
    _bind(name)
    if state()[name] not in options:
        notice(f"{label} {state()[name]} is not available here; using {options[0]}.")
        state()[name] = options[0]
        st.session_state[name] = options[0]
    fn = {"selectbox": where.selectbox, "radio": where.radio, "select_slider": where.select_slider}[widget]
    kwargs = dict(
        options=list(options),
        key=name,
        format_func=format_func,
        help=help,
        disabled=disabled,
        on_change=_take,
        args=(name,),
    )
    if widget == "radio":
        kwargs["horizontal"] = True
    return _after(name, fn(label, **kwargs))


def w_check(where, name: str, label: str, help: str | None = None) -> bool:
    _bind(name)
    return _after(name, where.checkbox(label, key=name, help=help, on_change=_take, args=(name,)))


def w_text(
    where, name: str, label: str, help: str | None = None, placeholder: str | None = None, max_chars: int = 600
) -> str:
    """A one-line text box (a link's text parameter, at most `max_chars`, as the link's parse allows)."""
    _bind(name)
    return _after(
        name,
        where.text_input(
            label, key=name, help=help, placeholder=placeholder, max_chars=max_chars, on_change=_take, args=(name,)
        ),
    )


def w_pills(
    where, name: str, label: str, options: Sequence, format_func: Callable = str, help: str | None = None
) -> tuple:
    """A multi-choice as pills: every option visible, nothing truncated to '1…' at 1024 px."""
    _bind(name, to_widget=list, from_widget=tuple)
    chosen = where.pills(
        label,
        list(options),
        selection_mode="multi",
        key=name,
        format_func=format_func,
        help=help,
        on_change=_take,
        args=(name, _as_tuple),
    )
    return _after(name, tuple(chosen or ()), from_widget=tuple)


def _as_tuple(value) -> tuple:
    return tuple(value or ())


def w_step(where, n_eval: int, scope) -> int:
    """The query step of `n_eval` evaluated queries; the last one is stored as -1, so it stays the last
    when the source grows. `scope` is the source the raw widget value counts steps of."""

    def to_w(v):
        return n_eval - 1 if v < 0 else min(v, n_eval - 1)

    from_w = functools.partial(_step_from_widget, n_eval)
    _bind("step", to_widget=to_w, from_widget=from_w, scope=scope)
    return _after(
        "step",
        where.number_input(
            "Query step",
            0,
            n_eval - 1,
            key="step",
            disabled=n_eval == 1,
            on_change=_take,
            args=("step", from_w, scope),
            help="Which evaluated query (decode step) to show; the last by default.",
        ),
        from_widget=from_w,
    )


def w_last_is_minus_one(where, name: str, label: str, n: int, scope, help: str | None = None) -> int:
    """A number box of 0..n-1 whose last value is stored as -1 (so it stays the last when the row grows:
    the charts' last token, the token grid's page). A typed number outside 0..n-1 is clamped, with a
    notice below 0; the box has no browser-side min / max. Returns 0..n-1."""
    store, ss = state(), st.session_state
    from_w = functools.partial(_step_from_widget, n)
    if name in ss and ss.get(f"_scope_{name}") == scope and int(ss[name]) < 0:
        notice(f"{label} {ss[name]} is out of range (0-{n - 1}); clamped to 0.")
        ss[name] = 0
    if store[name] > n - 1:  # a linked number past the end: the last, said in the box's own range
        notice(f"{label} {store[name]} is out of range (0-{n - 1}); clamped to {n - 1}.")
        store[name] = -1
    _bind(
        name, -1, n - 1, label, to_widget=lambda v: n - 1 if v < 0 else min(v, n - 1), from_widget=from_w, scope=scope
    )
    span = f"Range 0-{n - 1}; a number outside it is clamped."
    where.number_input(
        label,
        key=name,
        step=1,
        disabled=n == 1,
        on_change=_take,
        args=(name, from_w, scope),
        help=f"{help} {span}" if help else span,
    )
    v = store[name] = from_w(ss[name])
    return n - 1 if v < 0 else int(v)


def _step_from_widget(n_eval: int, v) -> int:
    """The stored query step of a step widget's value: the last of n_eval steps is -1."""
    return -1 if v >= n_eval - 1 else int(v)
