"""Shared Streamlit widgets for the kvviz app: sidebar controls, presets, URL state, cached compute.

Every control is a `Param` with a default and a valid range. Its value lives in one
session-wide store, mirrored into `st.query_params` (non-default values only), so a link
reproduces the view; a value in a link that is unknown, unparsable or out of range is
clamped or ignored with a visible notice, never a crash. Widgets read the store before
they render and write it back, so values survive page switches and widgets that are
hidden for a while (the Advanced bits, a source's knobs).

Numerics stay in the core (kvviz.engine, kvviz.analysis.sweep, kvviz.analysis.frames); this module only
reads widgets, calls them through Streamlit's caches and draws cards and notices.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import streamlit as st

from kvviz.plots import figures
from kvviz.engine import REASONS, Comparison, compare
from kvviz.spec import FORMATS, FP8_SCALES, FULL_BITS, RESIDUAL_MODES, ROTATIONS, SCORERS, Spec, SpecError, View
from kvviz.sources import handbook
from kvviz.trace import Trace, TraceError

STORE = "_kvviz_state"
NOTICES = "_kvviz_notices"

BITS_OPTIONS = (1, 2, 3, 4, 5, 6, 7, 8, FULL_BITS)
GROUP_OPTIONS = (8, 16, 32, 64, 128)
ENSEMBLE_OPTIONS = ("auto", "none", "heads", "layers", "steps", "seeds")
MAX_TOKENS = 32768 + 512
SOURCE_LABELS = {"handbook": "Handbook example", "synthetic": "Synthetic pattern",
                 "real": "Real model", "file": "Trace file"}
PAGES: dict = {}   # app.py registers its st.Page objects here, so a page can switch to another


class _Labels(dict):
    """Scorer labels; a plug-in (not listed) is labelled by its name and the start of its description."""

    def get(self, key, default=None):
        if key in self:
            return self[key]
        from kvviz.policies import POLICIES
        p = POLICIES.get(key)
        if p is None:
            return default if default is not None else str(key)
        return f"{key} (plug-in)" if self is SCORER_SHORT else f"{key} (plug-in: {p.description[:60]})"

    def __missing__(self, key):
        return self.get(key)


SCORER_SHORT = _Labels({"h2o": "H2O", "tova": "TOVA", "snapkv": "SnapKV", "streaming": "StreamingLLM",
                        "oracle": "oracle (bound)", "knorm": "K-norm", "random": "random",
                        "expected_attention": "Expected Attention", "keydiff": "KeyDiff", "chunkkv": "ChunkKV",
                        "quest": "Quest (reads)"})
SCORER_LABELS = _Labels({"h2o": "H2O (accumulated attention)", "tova": "TOVA (last query)",
                         "snapkv": "SnapKV (observation window vote)", "streaming": "StreamingLLM (position only)",
                         "oracle": "Oracle (this query's attention, per KV head; the bound)",
                         "knorm": "K-norm (smallest key norm)", "random": "Random (seeded baseline)",
                         "expected_attention": "Expected Attention (future queries' expected attention × ‖v‖)",
                         "keydiff": "KeyDiff (least similar to the mean key)",
                         "chunkkv": "ChunkKV (whole chunks of C tokens)",
                         "quest": "Quest (reads top pages per query; stores everything)"})
ALLOCATION_LABELS = {"uniform": "uniform (every head the same)",
                     "adakv": "AdaKV (per layer, across heads)", "pyramid": "PyramidKV (per layer, linear)"}


class _ScorerChoices:
    """The scorer choices, live: built-ins, then installed plug-ins (entry-point group kvviz.policies)."""

    def _names(self) -> tuple:
        from kvviz.policies.registry import load_entry_points
        from kvviz.spec import scorer_names
        load_entry_points()
        return scorer_names()

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, x):
        return x in self._names()

    def __len__(self):
        return len(self._names())

    def __getitem__(self, i):
        return self._names()[i]


SCORER_CHOICES = _ScorerChoices()


# --- parameters ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """One control: its URL name, kind, default and the widest range any source allows."""

    name: str
    kind: str                      # int | float | choice | bool | list | text
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()

    def parse(self, raw: str) -> tuple[Any, str | None]:
        """(value, notice) for a raw query-parameter string; the notice says what was changed."""
        label = f"`{self.name}={raw}`"
        if self.kind == "text":
            text = raw.strip()
            if len(text) > 600:
                return self.default, f"`{self.name}` is longer than 600 characters; ignored."
            return text, None
        if self.kind == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True, None
            if low in ("0", "false", "no", "off"):
                return False, None
            return self.default, f"{label} is not true/false; using {self.default}."
        if self.kind == "choice":
            for c in self.choices:
                if str(c) == raw.strip():
                    return c, None
            return self.default, (f"{label} is not one of {', '.join(map(str, self.choices))}; "
                                  f"using {self.default}.")
        if self.kind == "list":
            items = [s for s in raw.split(",") if s.strip()]
            known = [c for c in self.choices if str(c) in {s.strip() for s in items}]
            bad = [s for s in items if s.strip() not in {str(c) for c in self.choices}]
            note = f"{label}: ignored {', '.join(bad)} (not one of {', '.join(map(str, self.choices))})." if bad else None
            return (tuple(known) if known else self.default), note
        try:
            x = float(raw)
        except ValueError:
            return self.default, f"{label} is not a number; using {self.default}."
        if not math.isfinite(x):
            return self.default, f"{label} is not a finite number; using {self.default}."
        if self.kind == "int":
            x = int(round(x))
        clamped = min(max(x, self.lo), self.hi) if self.lo is not None else x
        if clamped != x:
            return clamped, f"{label} is out of range ({_num(self.lo)}-{_num(self.hi)}); clamped to {_num(clamped)}."
        return x, None

    def encode(self, value: Any) -> str:
        if self.kind == "bool":
            return "1" if value else "0"
        if self.kind == "list":
            return ",".join(map(str, value))
        if self.kind == "text":
            return str(value)
        return _num(value) if self.kind == "float" else str(value)


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


_PARAMS = [
    Param("source", "choice", "handbook", choices=tuple(SOURCE_LABELS)),
    # synthetic pattern knobs (kvviz.sources.synthetic.SyntheticSpec)
    Param("context", "int", 512, 8, 32768), Param("steps", "int", 32, 0, 512),
    Param("layers", "int", 2, 1, 32), Param("q_heads", "int", 4, 1, 32), Param("kv_heads", "int", 2, 1, 32),
    Param("head_dim", "choice", 64, choices=(32, 64, 128)), Param("syn_seed", "int", 0, 0, 1_000_000),
    Param("sink_strength", "float", 11.0, 0.0, 30.0), Param("local_strength", "float", 5.0, 0.0, 30.0),
    Param("local_width", "float", 8.0, 0.5, 512.0), Param("n_anchors", "int", 6, 0, 64),
    Param("anchor_strength", "float", 4.0, 0.0, 30.0), Param("sparsity", "float", 2.0, 0.0, 10.0),
    Param("topic_shift", "float", 0.0, 0.0, 30.0), Param("outlier_channels", "int", 4, 0, 16),
    Param("outlier_scale", "float", 12.0, 0.0, 100.0),
    # compression (defaults: the handbook's example)
    Param("sink", "int", handbook.SINK, 0, MAX_TOKENS), Param("recent", "int", handbook.RECENT, 0, MAX_TOKENS),
    Param("heavy", "int", handbook.HEAVY, 0, MAX_TOKENS),
    Param("budget_unit", "choice", "tokens", choices=("tokens", "%")),
    Param("bits", "choice", FULL_BITS, choices=BITS_OPTIONS),
    Param("scorer", "choice", "h2o", choices=SCORER_CHOICES),
    Param("allocation", "choice", "uniform", choices=("uniform", "adakv", "pyramid")),
    Param("ada_alpha", "float", 0.2, 0.0, 1.0), Param("pyr_beta", "float", 20.0, 1.0, 1000.0),
    Param("ea_horizon", "int", 512, 1, 100_000), Param("ea_cov", "bool", True),
    Param("chunk", "int", 20, 1, 4096),
    Param("chunk_scorer", "choice", "snapkv", choices=("snapkv", "expected_attention", "keydiff", "knorm", "h2o",
                                                       "random")),
    Param("page", "int", 16, 1, 4096),
    Param("split", "bool", False),
    Param("key_bits", "choice", FULL_BITS, choices=BITS_OPTIONS),
    Param("value_bits", "choice", FULL_BITS, choices=BITS_OPTIONS),
    Param("key_axis", "choice", "channel", choices=("channel", "token")),
    Param("value_axis", "choice", "token", choices=("channel", "token")),
    Param("group", "choice", 32, choices=GROUP_OPTIONS),
    Param("residual", "int", 0, 0, MAX_TOKENS),
    Param("symmetric", "bool", False),
    Param("zero_point", "choice", "float", choices=("float", "int")),
    Param("partial", "choice", "full", choices=("full", "quantize")),
    Param("snap_window", "int", 0, 0, 4096),
    Param("h2o_norm", "bool", False),
    Param("key_fmt", "choice", "int", choices=FORMATS), Param("value_fmt", "choice", "int", choices=FORMATS),
    Param("fp8_scale", "choice", "head", choices=FP8_SCALES), Param("rotate", "choice", "none", choices=ROTATIONS),
    Param("res_mode", "choice", "kivi", choices=RESIDUAL_MODES),
    Param("qmodel", "choice", "kv", choices=("kv", "noise")),
    Param("sigma", "float", handbook.SIGMA, 0.0, 100.0),
    # view
    Param("layer", "int", 0, 0, 1023), Param("head", "int", 0, 0, 1023), Param("step", "int", -1, -1, 1_000_000),
    Param("ensemble", "choice", "auto", choices=ENSEMBLE_OPTIONS),
    Param("ens_size", "int", 8, 2, 32),
    Param("bars", "choice", "std", choices=("std", "ci95", "range")),
    # explorer: a pinned setting A, a locked y-axis, the target solver, presentation mode
    Param("pin", "text", ""), Param("ylock", "float", 0.0, 0.0, 1.0),
    Param("solve_kind", "choice", "mass", choices=("mass", "tv")), Param("solve_target", "float", 0.95, 0.001, 1.0),
    Param("present", "bool", False), Param("grid_shade", "choice", "reason", choices=("reason", "attention", "error")),
    # trade-offs page
    Param("metric", "choice", "tv", choices=("tv", "kl", "js", "mass", "output_error")),
    Param("logx", "bool", False),
    Param("methods", "list", ("streaming", "h2o", "tova", "snapkv", "oracle"), choices=SCORER_CHOICES),
    Param("sweep_bits", "list", (16, 4, 2), choices=(16, 8, 4, 3, 2)),
    Param("sweep_formats", "list", (), choices=("e4m3", "e5m2", "nvfp4", "mxfp4")),
    # concentration page
    Param("window", "int", 16, 1, 4096),
    # decode timeline page
    Param("tl_layer", "int", 0, 0, 1023), Param("tl_kv_head", "int", 0, 0, 1023),
    Param("tl_policies", "list", ("h2o", "tova", "streaming", "oracle"), choices=SCORERS),
    Param("tl_need", "float", 0.02, 0.001, 1.0), Param("tl_step", "int", 0, 0, 1_000_000),
    # model lab page
    Param("lab_text", "choice", "sample", choices=("sample", "bakery", "custom")),
    Param("lab_prompt", "int", 206, 8, 512), Param("lab_cont", "int", 57, 2, 128),
    Param("lab_greedy", "int", 32, 0, 64), Param("lab_rerotate", "bool", False),
    # needle test page: the open cell ("scorer:length:depth", empty = the classic failure) and
    # its layer / KV head (-1 = where the full model wanted the needle most)
    Param("nd_cell", "text", ""), Param("nd_layer", "int", -1, -1, 1023), Param("nd_head", "int", -1, -1, 1023),
    # real model source
    Param("rm_text", "choice", "bakery", choices=("bakery", "sample", "custom")),
    Param("rm_new", "int", 16, 0, 64), Param("rm_max", "int", 1024, 16, 4096),
]
PARAMS: dict[str, Param] = {p.name: p for p in _PARAMS}


# --- the store ----------------------------------------------------------------------------

def _store() -> dict:
    """The session's settings, read from the URL on the session's first run."""
    ss = st.session_state
    if STORE not in ss:
        store = {name: p.default for name, p in PARAMS.items()}
        notes = []
        for name in st.query_params:
            raw = st.query_params.get_all(name)
            raw = raw[-1] if raw else ""
            if name not in PARAMS:
                notes.append(f"The link's `{name}` is not a kvviz setting; ignored.")
                continue
            value, note = PARAMS[name].parse(raw)
            store[name] = value
            if note:
                notes.append(note)
        ss[STORE] = store
        ss[NOTICES] = notes
    return ss[STORE]


def settings_dict() -> dict:
    return dict(_store())


def notice(text: str) -> None:
    """Queue a visible notice (shown by `show_notices`)."""
    _store()
    if text not in st.session_state[NOTICES]:
        st.session_state[NOTICES].append(text)


def show_notices() -> None:
    notes = st.session_state.get(NOTICES) or []
    if notes:
        st.warning("**Some settings were adjusted:**\n\n" + "\n".join(f"- {n}" for n in notes), icon=":material/warning:")
        st.button("Dismiss", key="_dismiss_notices", on_click=lambda: st.session_state[NOTICES].clear())


def sync_url() -> None:
    """Mirror the store into st.query_params (non-default values only); no-op if unchanged."""
    store = _store()
    wanted = {name: PARAMS[name].encode(v) for name, v in store.items() if v != PARAMS[name].default}
    current = {k: st.query_params.get(k) for k in st.query_params}
    if current != wanted:
        st.query_params.from_dict(wanted)


def _bind(name: str, lo=None, hi=None, label: str = "", to_widget=None, from_widget=None, scope=None) -> None:
    """Before a widget renders: take its last value into the store, clamp to [lo, hi], seed it.

    `scope` is what the widget's raw value is relative to (the query step widget counts
    steps of one source): a widget last shown in another scope is not read back, so the
    stored setting, not a number from another source, decides the value after a switch.
    """
    store, ss = _store(), st.session_state
    scope_key = f"_scope_{name}"
    same_scope = scope is None or ss.get(scope_key) == scope
    if name in ss and same_scope:
        store[name] = from_widget(ss[name]) if from_widget else ss[name]
    if scope is not None:
        ss[scope_key] = scope
    v = store[name]
    if lo is not None and hi is not None and not lo <= v <= hi:
        c = min(max(v, lo), hi)
        notice(f"{label or name} {v} is outside this source's range {lo}-{hi}; set to {c}.")
        store[name] = v = c
    # Always re-seed: after a page switch the widget is a new element whose state would
    # otherwise start from its default, not from the value the user chose on another page.
    ss[name] = to_widget(v) if to_widget else v


def _after(name: str, value, from_widget=None) -> Any:
    store = _store()
    store[name] = from_widget(value) if from_widget else value
    return store[name]


def w_slider(where, name: str, label: str, lo: int, hi: int, help: str | None = None) -> int:
    _bind(name, lo, hi, label)
    if hi <= lo:  # a slider needs a range; a single possible value is shown as text
        where.caption(f"{label}: {lo}")
        return _after(name, lo)
    return _after(name, where.slider(label, lo, hi, key=name, help=help))


def w_budget(where, name: str, label: str, n: int, unit: str, help: str | None = None) -> int:
    """A token budget: a slider (counts) and a number box beside it (counts or % of the n tokens).

    Typing a target beats slider hunting on long traces (a 0-544 slider is 2.4 tokens a
    pixel); both widgets edit the one stored count.
    """
    _bind(name, 0, n, label)
    ss, box = st.session_state, f"_box_{name}"
    value = _store()[name]
    ss[box] = value if unit == "tokens" else round(100.0 * value / max(n, 1), 1)

    def typed() -> None:
        count = ss[box] if unit == "tokens" else round(ss[box] * n / 100.0)
        _store()[name] = ss[name] = int(min(max(count, 0), n))

    def slid() -> None:
        _store()[name] = ss[name]

    left, right = where.columns([3, 2], vertical_alignment="bottom")
    if n > 0:
        left.slider(label, 0, n, key=name, help=help, on_change=slid)
    else:
        left.caption(f"{label}: 0")
    right.number_input(f"{label} ({'tokens' if unit == 'tokens' else '%'})", min_value=0 if unit == "tokens" else 0.0,
                       max_value=n if unit == "tokens" else 100.0, step=1 if unit == "tokens" else 0.5, key=box,
                       on_change=typed, label_visibility="collapsed",
                       help=f"Type the {label.lower()} in {'tokens' if unit == 'tokens' else '% of the tokens'}.")
    return _after(name, int(ss.get(name, value)) if n > 0 else 0)


def w_number(where, name: str, label: str, lo, hi, step=None, help: str | None = None, fmt: str | None = None,
             disabled: bool = False):
    _bind(name, lo, hi, label)
    kwargs = dict(min_value=lo, max_value=hi, key=name, help=help, disabled=disabled)
    if step is not None:
        kwargs["step"] = step
    if fmt:
        kwargs["format"] = fmt
    return _after(name, where.number_input(label, **kwargs))


def w_choice(where, name: str, label: str, options: Sequence, widget: str = "selectbox",
             format_func: Callable = str, help: str | None = None, disabled: bool = False):
    _bind(name)
    if _store()[name] not in options:
        notice(f"{label} {_store()[name]} is not available here; using {options[0]}.")
        _store()[name] = options[0]
        st.session_state[name] = options[0]
    fn = {"selectbox": where.selectbox, "radio": where.radio, "select_slider": where.select_slider}[widget]
    kwargs = dict(options=list(options), key=name, format_func=format_func, help=help, disabled=disabled)
    if widget == "radio":
        kwargs["horizontal"] = True
    return _after(name, fn(label, **kwargs))


def w_check(where, name: str, label: str, help: str | None = None) -> bool:
    _bind(name)
    return _after(name, where.checkbox(label, key=name, help=help))


def w_pills(where, name: str, label: str, options: Sequence, format_func: Callable = str,
            help: str | None = None) -> tuple:
    """A multi-choice as pills: every option visible, nothing truncated to '1…' at 1024 px."""
    _bind(name, to_widget=list, from_widget=tuple)
    chosen = where.pills(label, list(options), selection_mode="multi", key=name, format_func=format_func, help=help)
    return _after(name, tuple(chosen or ()), from_widget=tuple)


def w_multi(where, name: str, label: str, options: Sequence, format_func: Callable = str,
            help: str | None = None) -> tuple:
    _bind(name, to_widget=list, from_widget=tuple)
    return _after(name, where.multiselect(label, list(options), key=name, format_func=format_func, help=help),
                  from_widget=tuple)


# --- sources ---------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Source:
    key: tuple                   # hashable identity for the caches
    trace: Trace
    label: str
    seed_fn: Callable[[int], Trace] | None = None
    quant_note_kv: str = "real K/V quantization of the cached keys and values"


@st.cache_resource(max_entries=4, show_spinner=False)
def _handbook(seed: int = 0) -> Trace:
    return handbook.handbook_trace(seed=seed)


@st.cache_resource(max_entries=16, show_spinner="Generating the synthetic pattern…")
def _synthetic(items: tuple) -> Trace:
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
    return make_synthetic(SyntheticSpec(**dict(items)))


def _external_sources() -> dict[str, Callable | None]:
    """The Real model / Trace file pickers, if kvviz.app.sources provides them."""
    try:
        from kvviz.app import sources as ui_sources  # noqa: PLC0415 (optional: another issue builds it)
    except Exception:  # missing module or a broken import must not take the app down
        return {"real": None, "file": None}
    return {"real": getattr(ui_sources, "real_model_source", None),
            "file": getattr(ui_sources, "trace_file_source", None)}


def _fingerprint(trace: Trace) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in (trace.q, trace.k, trace.v, trace.logits):
        if a is not None:
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a.reshape(-1)[:: max(1, a.size // 65536)]).tobytes())
    h.update(repr(trace.tokens[:64]).encode() + str(trace.context_len).encode())
    return h.hexdigest()


def source_section(where=None) -> Source | None:
    """Sidebar: the Source picker and its own knobs. None (with a message shown) if unusable."""
    where = where or st.sidebar
    where.header("Source")
    external = _external_sources()
    options = ["handbook", "synthetic"] + [k for k in ("real", "file") if external[k] is not None]
    choice = w_choice(where, "source", "Attention source", options, widget="radio",
                      format_func=SOURCE_LABELS.get,
                      help="Where the attention comes from: the handbook's worked example, a tunable "
                           "synthetic pattern, or (when available) a real model or a saved trace.")
    missing = [SOURCE_LABELS[k] for k in ("real", "file") if external[k] is None]
    if missing:
        where.caption(f"{' and '.join(missing)}: coming soon.")
    if choice == "handbook":
        where.caption("One query over 64 tokens: sinks 0-3, heavy hitters 15 and 28, a local window of 8.")
        return Source(("handbook",), _handbook(0), "handbook example", seed_fn=_handbook,
                      quant_note_kv="real K/V quantization of keys realised from the handbook's logits "
                                    "(exact at 16 bits)")
    if choice == "synthetic":
        return _synthetic_section(where)
    fn = external[choice]
    try:
        trace = fn(where)
    except (TraceError, SpecError, ValueError, OSError) as e:
        st.error(f"The {SOURCE_LABELS[choice]} source failed: {e}")
        return None
    if trace is None:
        st.info(f"Choose a {SOURCE_LABELS[choice].lower()} in the sidebar to start.")
        return None
    return Source(("external", choice, _fingerprint(trace)), trace, SOURCE_LABELS[choice].lower())


SYNTHETIC_PRESET_HELP = {
    "realistic": "Concentrated like a real model (the default): a strong first-token sink and a few heavy hitters; "
                 "the top 10% of tokens hold ~87% of the attention (SmolLM2-135M measured: 84%).",
    "diffuse": "The hard case: a weak sink and a flat background, so eviction must keep most tokens for 95% of the mass.",
    "topic shift": "Late anchor tokens that no context query looked at, needed after the shift halfway through 48 "
                   "decode steps: where history-based eviction (H2O, TOVA) fails.",
}
SYNTHETIC_KNOBS = ("sink_strength", "local_strength", "local_width", "n_anchors", "anchor_strength", "sparsity",
                   "topic_shift", "outlier_channels", "outlier_scale", "steps")


def _apply_synthetic_preset(name: str) -> None:
    from kvviz.sources.synthetic import PRESETS
    preset = PRESETS[name].as_dict()
    for knob in SYNTHETIC_KNOBS:
        _store()[knob] = preset[knob]
        st.session_state[knob] = preset[knob]


def _synthetic_section(where) -> Source | None:
    from kvviz.sources.synthetic import PRESETS, SyntheticSpec
    with where.container(horizontal=True, gap="small"):
        for name in PRESETS:
            st.button(name.capitalize(), key=f"synthetic_{name}", on_click=_apply_synthetic_preset, args=(name,),
                      help=SYNTHETIC_PRESET_HELP[name])
    knobs = dict(
        context=w_number(where, "context", "Context tokens", 8, 32768, step=64,
                         help="Prompt length: the compression point. Past 256 tokens the charts switch to bins."),
        steps=w_number(where, "steps", "Later queries (decode steps)", 0, 512, step=8),
        layers=w_number(where, "layers", "Layers", 1, 32),
        q_heads=w_number(where, "q_heads", "Query heads", 1, 32),
        kv_heads=w_number(where, "kv_heads", "KV heads", 1, 32, help="Query heads must be a multiple of KV heads (GQA)."),
    )
    with where.expander("Pattern knobs"):
        knobs.update(
            sink_strength=w_number(st, "sink_strength", "Sink strength (logit)", 0.0, 30.0, step=0.5),
            local_strength=w_number(st, "local_strength", "Locality strength (logit)", 0.0, 30.0, step=0.5),
            local_width=w_number(st, "local_width", "Locality width (tokens)", 0.5, 512.0, step=1.0),
            n_anchors=w_number(st, "n_anchors", "Anchor tokens (heavy hitters)", 0, 64),
            anchor_strength=w_number(st, "anchor_strength", "Anchor strength (logit)", 0.0, 30.0, step=0.5),
            sparsity=w_number(st, "sparsity", "Background sparsity (logit std)", 0.0, 10.0, step=0.1),
            topic_shift=w_number(st, "topic_shift", "Topic shift (logit; 0 = off)", 0.0, 30.0, step=0.5,
                                 help="Late anchors that only the later queries need: where history-based eviction fails."),
            outlier_channels=w_number(st, "outlier_channels", "Key outlier channels", 0, 16),
            outlier_scale=w_number(st, "outlier_scale", "Outlier scale", 0.0, 100.0, step=1.0),
            head_dim=w_choice(st, "head_dim", "Head dim", (32, 64, 128)),
            seed=w_number(st, "syn_seed", "Pattern seed", 0, 1_000_000),
        )
    try:
        spec = SyntheticSpec(**knobs)
    except SpecError as e:
        st.error(f"The synthetic pattern cannot be built: {e}. Change the pattern knobs in the sidebar.")
        return None
    items = tuple(sorted(spec.as_dict().items()))

    def seed_fn(r: int, _spec=spec) -> Trace:
        return _synthetic(tuple(sorted(_spec.with_(seed=_spec.seed + r).as_dict().items())))

    return Source(("synthetic", items), _synthetic(items), f"synthetic pattern ({spec.context} tokens)",
                  seed_fn=seed_fn)


# --- compression and view --------------------------------------------------------------------

def bits_label(b: int) -> str:
    return "16 (off)" if b == FULL_BITS else str(b)


def compression_section(trace: Trace, where=None, budget_only: bool = False) -> Spec | None:
    """Sidebar: the four headline sliders and the Advanced expander. None if the combination is impossible.

    budget_only: only the eviction budget (a page that draws each policy itself and never
    quantizes); the other controls are hidden and the page says so.
    """
    where = where or st.sidebar
    where.header("Compression")
    n = trace.n_positions
    unit = w_choice(where, "budget_unit", "Budgets in", ("tokens", "%"), widget="radio",
                    format_func={"tokens": "tokens", "%": f"% of the {n} tokens"}.get,
                    help="Type budgets as token counts or as a share of the tokens; the sliders always show counts.")
    sink = w_budget(where, "sink", "Sink tokens", n, unit,
                    help="The first tokens, always kept: attention sinks (StreamingLLM keeps 4).")
    recent = w_budget(where, "recent", "Recent window", n, unit,
                      help="The last tokens the query sees (its own included), always kept.")
    heavy = w_budget(where, "heavy", "Heavy-hitter budget", n, unit,
                     help="How many more tokens the scorer may keep among the rest (H2O's heavy hitters).")
    if budget_only:
        where.caption("This page compares eviction policies side by side: the scorer is picked per chart and "
                      "nothing is quantized, so only the budget sliders are shown.")
        return Spec(sink=sink, recent=recent, heavy=heavy)
    split = bool(_store()["split"])
    bits = w_choice(where, "bits", "Quantization bits", BITS_OPTIONS, widget="select_slider",
                    format_func=bits_label, disabled=split,
                    help="Bits per cached key and value (16 = not quantized). "
                         + ("Advanced sets keys and values separately now." if split else ""))
    adv = where.expander("Advanced")
    with adv:
        scorer = w_choice(st, "scorer", "Heavy-hitter scorer", tuple(SCORER_CHOICES), format_func=SCORER_LABELS.get,
                          help=scorer_help())
        allocation_widgets(st, scorer, n)
        if scorer == "snapkv":
            w_number(st, "snap_window", "SnapKV observation window (queries; 0 = auto)", 0, 4096,
                                   help="The last context queries that vote. 0 = the recent window, capped at 64 "
                                        "(SnapKV's default). The window is kept, so it must fit inside the recent "
                                        "window.")
        if scorer == "h2o":
            w_check(st, "h2o_norm", "H2O: divide by the queries that saw each token",
                               help="Off: accumulated attention (H2O as published). On: accumulated attention / "
                                    "number of queries that could see the token, so early tokens are not favoured "
                                    "for having been seen more often (kvpress's observed-attention press).")
        split = w_check(st, "split", "Separate key and value bits")
        if split:
            key_bits = w_choice(st, "key_bits", "Key bits", BITS_OPTIONS, widget="select_slider", format_func=bits_label)
            value_bits = w_choice(st, "value_bits", "Value bits", BITS_OPTIONS, widget="select_slider",
                                  format_func=bits_label)
        else:
            key_bits = value_bits = bits
        w_choice(st, "key_axis", "Key groups run along", ("channel", "token"), widget="radio",
                            help="KIVI quantizes keys per channel (keys have outlier channels).")
        w_choice(st, "value_axis", "Value groups run along", ("channel", "token"), widget="radio",
                              help="KIVI quantizes values per token.")
        w_choice(st, "group", "Group size (values per scale)", GROUP_OPTIONS)
        w_number(st, "residual", "Residual (last tokens kept at 16 bits)", 0, n)
        symmetric = w_check(st, "symmetric", "Symmetric quantization (no zero point; needs ≥ 2 bits)")
        w_choice(st, "zero_point", "Asymmetric zero", ("float", "int"), widget="radio",
                              format_func={"float": "float offset (KIVI)", "int": "integer zero point"}.get,
                              disabled=symmetric,
                              help="KIVI dequantizes x̂ = q·s + min with min kept as a 16-bit float. Integer "
                                   "kernels round a zero point z = round(−min/s) and store it in b bits: "
                                   "x̂ = s·(q − z), slightly larger error, and at 1 bit x̂ can leave [min, max].")
        w_choice(st, "partial", "Partial groups (shorter than G)", ("full", "quantize"), widget="radio",
                           format_func={"full": "16-bit (KIVI)", "quantize": "quantize"}.get,
                           help="Tokens after the last full group of G (per-channel keys) or channels after the "
                                "last full group (per-token): KIVI keeps them at full precision until a group "
                                "fills; counted as 16-bit in the memory. Or quantize them as a short group.")
        cache_format_controls()
        qmodel = w_choice(st, "qmodel", "Quantization model", ("kv", "noise"), widget="radio",
                          format_func={"kv": "real K/V quantization", "noise": "handbook logit noise"}.get)
        w_number(st, "sigma", "Noise σ (logit noise model)", 0.0, 100.0, step=0.005, fmt="%.3f",
                         disabled=qmodel != "noise")
    try:
        return spec_from_values(_store())
    except SpecError as e:
        hint = (" Turn off symmetric quantization or raise the bits to 2 or more."
                if symmetric and 1 in (key_bits, value_bits) else "")
        st.error(f"These compression settings are impossible: {e}.{hint}")
        return None


COMPRESSION_PARAMS = ("sink", "recent", "heavy", "bits", "scorer", "split", "key_bits", "value_bits", "key_axis",
                      "value_axis", "group", "residual", "symmetric", "zero_point", "partial", "qmodel", "sigma",
                      "snap_window", "h2o_norm", "key_fmt", "value_fmt", "fp8_scale", "rotate", "res_mode",
                      "allocation", "ada_alpha", "pyr_beta", "ea_horizon", "ea_cov", "chunk", "chunk_scorer",
                      "page")
FORMAT_LABELS = {"int": "integer groups (bits above)", "e4m3": "FP8 E4M3", "e5m2": "FP8 E5M2",
                 "nvfp4": "NVFP4 (E2M1, blocks of 16)", "mxfp4": "MXFP4 (E2M1, blocks of 32)"}


def cache_format_controls() -> None:
    """Advanced: the cache format of keys and values, FP8 scales, rotation, the residual's mode."""
    st.markdown("**Cache format**")
    key_fmt = w_choice(st, "key_fmt", "Key format", FORMATS, format_func=FORMAT_LABELS.get,
                       help="Integer min-max groups (KIVI) at the bits above, or a serving format: FP8 (vLLM, "
                            "SGLang) with FP32 scales, NVFP4 (E2M1 values, E4M3 scale per 16, FP32 per tensor) or "
                            "MXFP4 (E2M1, power-of-two scale per 32). FP8/FP4 fix their own width.")
    value_fmt = w_choice(st, "value_fmt", "Value format", FORMATS, format_func=FORMAT_LABELS.get)
    fp8 = {"e4m3", "e5m2"} & {key_fmt, value_fmt}
    w_choice(st, "fp8_scale", "FP8 scale per", FP8_SCALES, widget="radio", disabled=not fp8,
             format_func={"tensor": "tensor (layer)", "head": "KV head", "token": "token"}.get,
             help="One FP32 scale s = amax / format max for the layer's whole K (or V), for each KV head, or "
                  "for each token of each head.")
    w_choice(st, "rotate", "Hadamard rotation before quantizing", ROTATIONS, widget="radio",
             format_func={"none": "off", "keys": "keys (+ queries)", "keys-values": "keys and values"}.get,
             help="An orthonormal Hadamard rotation of the head dimension spreads outlier channels over all "
                  "channels (QuaRot / SpinQuant). Queries get the same rotation, so q·k is unchanged before "
                  "quantization; rotated values are rotated back on the output. Works with every format and axis.")
    w_choice(st, "res_mode", "Residual window", RESIDUAL_MODES, widget="radio",
             format_func={"kivi": "sliding (KIVI)", "hf": "flushed (HF QuantizedCache)"}.get,
             help="Sliding: the last `Residual` tokens are always exact. Flushed: transformers' QuantizedCache "
                  "quantizes the prompt whole, then collects new tokens at full precision and quantizes them "
                  "together once `Residual` of them have arrived.")
    if key_fmt != "int" or value_fmt != "int":
        st.caption("The bits slider sets the integer format only: FP8 stores 8 bits a value, NVFP4 / MXFP4 4 "
                   "(plus their scales, all counted in the memory).")


def allocation_widgets(where, scorer: str, n: int) -> None:
    """Advanced: the budget allocation over heads / layers, and the new scorers' own settings."""
    allocation = w_choice(where, "allocation", "Budget allocation", ("uniform", "adakv", "pyramid"),
                          format_func=ALLOCATION_LABELS.get,
                          help="Uniform: every KV head of every layer keeps `heavy` heavy hitters. AdaKV (Feng et "
                               "al. 2024; kvpress AdaKVPress): one budget per layer, given to the top scores across "
                               "all its KV heads, each head keeping at least α × heavy — heads end up with different "
                               "cache lengths. PyramidKV (Cai et al. 2024; kvpress PyramidKVPress): layer budgets "
                               "falling linearly from the lowest layer to the highest, the same total.")
    if allocation == "adakv":
        w_number(where, "ada_alpha", "AdaKV safeguard α (share of heavy each head keeps)", 0.0, 1.0, step=0.05,
                 fmt="%.2f", help="kvpress alpha_safeguard, 0.2 by default.")
    if allocation == "pyramid":
        w_number(where, "pyr_beta", "PyramidKV β (slope; 1 = flat)", 1.0, 1000.0, step=1.0,
                 help="Top layer heavy/β, bottom layer 2·heavy − heavy/β (kvpress β = 20).")
    if scorer == "expected_attention":
        w_number(where, "ea_horizon", "Expected Attention horizon (future positions)", 1, 100_000, step=64,
                 help="The query statistics are rotated by the RoPE rotation averaged over this many positions "
                      "after the context (kvpress n_future_positions 512). No effect on traces without RoPE.")
        w_check(where, "ea_cov", "Use the queries' covariance (not only their mean)")
    if scorer == "chunkkv":
        w_number(where, "chunk", "ChunkKV chunk size (tokens)", 1, 4096, help="kvpress chunk_length 20.")
        w_choice(where, "chunk_scorer", "ChunkKV token scorer", ("snapkv", "expected_attention", "keydiff", "knorm",
                                                                "h2o", "random"), format_func=SCORER_SHORT.get)
    if scorer == "quest":
        w_number(where, "page", "Quest page size (tokens)", 1, 4096, help="Quest's default is 16.")


def spec_from_values(v: dict) -> Spec:
    """The Spec the compression controls describe, from their stored values (URL names)."""
    key_bits, value_bits = (v["key_bits"], v["value_bits"]) if v["split"] else (v["bits"], v["bits"])
    return Spec(sink=int(v["sink"]), recent=int(v["recent"]), heavy=int(v["heavy"]), scorer=v["scorer"],
                key_bits=key_bits, value_bits=value_bits, key_axis=v["key_axis"], value_axis=v["value_axis"],
                group_size=v["group"], residual=int(v["residual"]), symmetric=bool(v["symmetric"]),
                quant_model=v["qmodel"], noise_sigma=float(v["sigma"]), zero_point=v["zero_point"],
                partial=v["partial"], snapkv_window=int(v["snap_window"]) or None, h2o_normalized=bool(v["h2o_norm"]),
                key_format=v.get("key_fmt", "int"), value_format=v.get("value_fmt", "int"),
                fp8_scale=v.get("fp8_scale", "head"), rotate=v.get("rotate", "none"),
                residual_mode=v.get("res_mode", "kivi"),
                allocation=v.get("allocation", "uniform"), adakv_alpha=float(v.get("ada_alpha", 0.2)),
                pyramid_beta=float(v.get("pyr_beta", 20.0)), ea_horizon=int(v.get("ea_horizon", 512)),
                ea_covariance=bool(v.get("ea_cov", True)), chunk_size=int(v.get("chunk", 20)),
                chunk_scorer=v.get("chunk_scorer", "snapkv"), page_size=int(v.get("page", 16)))


@dataclass(frozen=True)
class ViewSettings:
    view: View
    bars: str
    ensemble_choice: str


def view_section(source: Source, where=None, ensemble: bool = True, layer_head: bool = True,
                 head: bool = True) -> ViewSettings:
    """Sidebar: layer, query head, query step and (optionally) the ensemble behind the error bars.

    A page shows only the controls it uses: `layer_head=False` hides layer and head (the
    page shows every one), `head=False` only the head (the page averages over the heads).
    """
    where = where or st.sidebar
    where.header("View")
    t = source.trace
    n_eval = len(t.evaluated_queries)
    layer = head_index = 0
    if layer_head:
        representative_head(source)
        layer = w_number(where, "layer", "Layer", 0, t.n_layers - 1, disabled=t.n_layers == 1)
        if head:
            head_index = w_number(where, "head", "Query head", 0, t.n_q_heads - 1, disabled=t.n_q_heads == 1)

    def to_w(v):
        return n_eval - 1 if v < 0 else min(v, n_eval - 1)

    def from_w(v):
        return -1 if v >= n_eval - 1 else int(v)

    _bind("step", to_widget=to_w, from_widget=from_w, scope=(source.key, n_eval))
    step = _after("step", where.number_input("Query step", 0, n_eval - 1, key="step", disabled=n_eval == 1,
                                             help="Which evaluated query (decode step) to show; the last by default."),
                  from_widget=from_w)
    choice, bars, size = "none", "std", 1
    if ensemble:
        choice = w_choice(where, "ensemble", "Error bars over", ENSEMBLE_OPTIONS,
                          format_func=lambda c: {"auto": "auto (seeds for the handbook, heads otherwise)",
                                                 "none": "none (one row)"}.get(c, c),
                          help="The ensemble behind the error bars: query heads of this layer, layers, "
                               "recent decode steps, or repeated random draws (seeds).")
        size = w_slider(where, "ens_size", "Ensemble size", 2, 32)
        bars = w_choice(where, "bars", "Error bars show", ("std", "ci95", "range"), widget="radio",
                        format_func={"std": "± 1 sample std", "ci95": "95% CI of the mean",
                                     "range": "min–max"}.get,
                        help="± 1 sample standard deviation of the members (n − 1); a 95% t-interval for the "
                             "mean error (mean ± t·s/√N, members taken as independent draws); or the range of "
                             "the N members themselves.")
    ens = resolve_ensemble(choice, source)
    return ViewSettings(View(layer=int(layer), head=int(head_index), step=None if step < 0 else int(step),
                             ensemble=ens, ensemble_size=int(size)), bars, choice)


def typical_head(trace: Trace) -> tuple[int, int, str]:
    """(layer, head, why): the head whose attention concentration (top-10% mass at the last
    query) is the median over every layer and head - typical, neither the best nor the worst."""
    from kvviz.analysis.frames import concentration
    top10 = concentration(trace, fractions=np.array([0.1])).top10          # (layers, heads)
    order = np.argsort(top10, axis=None, kind="stable")
    layer, head = np.unravel_index(order[len(order) // 2], top10.shape)
    why = (f"Opened on layer {layer}, head {head}: the head whose attention concentration (top-10% mass "
           f"{top10[layer, head]:.0%}) is the median of all {top10.size} heads — typical, neither the best nor the "
           "worst (layer 0, head 0 is often the most diffuse). Change it under View.")
    return int(layer), int(head), why


def representative_head(source: Source) -> None:
    """On a real model's trace, open on a typical head instead of layer 0 / head 0, and say so.

    Only on the first view of that trace in a session, and only if the link did not ask
    for a layer or head.
    """
    ss = st.session_state
    if source.key[0] != "external" or ss.get("_typical_for") == source.key:
        return
    ss["_typical_for"] = source.key
    store = _store()
    if "layer" in st.query_params or "head" in st.query_params or (store["layer"], store["head"]) != (0, 0):
        return
    if source.trace.n_layers * source.trace.n_q_heads <= 1:
        return
    layer, head, why = typical_head(source.trace)
    for name, value in (("layer", layer), ("head", head)):
        store[name] = value
        ss.pop(name, None)
    ss["_typical_note"] = why


def resolve_ensemble(choice: str, source: Source) -> str | None:
    if choice == "none":
        return None
    if choice == "auto":
        return "seeds" if source.key[0] == "handbook" else "heads"
    return choice


@dataclass(frozen=True, eq=False)
class Settings:
    source: Source
    spec: Spec | None
    view: ViewSettings


def sidebar(compression: bool = True, ensemble: bool = True, head: bool = True) -> Settings | None:
    """Render the sidebar in the fixed order: Source, its knobs, Compression, Advanced, View."""
    _store()
    source = source_section()
    if source is None:
        show_notices()
        return None
    spec = compression_section(source.trace) if compression else None
    # without compression controls the page shows every layer and head (Concentration)
    view = view_section(source, ensemble=ensemble, layer_head=compression, head=head)
    show_notices()
    return Settings(source, spec, view)


# --- presets ---------------------------------------------------------------------------------

PRESETS = ("Handbook example", "StreamingLLM", "H2O 10%+10%", "KIVI 2-bit", "Aggressive 25% + 2-bit",
           "HF QuantizedCache 4-bit")
_NO_QUANT = dict(bits=FULL_BITS, split=False, key_bits=FULL_BITS, value_bits=FULL_BITS, qmodel="kv",
                 symmetric=False, residual=0, key_axis="channel", value_axis="token", group=32,
                 zero_point="float", partial="full", key_fmt="int", value_fmt="int", rotate="none", res_mode="kivi")


PRESET_HELP = {
    "Handbook example": "Sink 4, recent 8, heavy 2 (H2O), no quantization: the handbook's worked example.",
    "StreamingLLM": "4 attention sinks + a recent window of ~20% of the tokens; position only.",
    "H2O 10%+10%": "H2O: 10% heavy hitters + 10% recent window, as in the H2O paper's experiments.",
    "KIVI 2-bit": ("No eviction; KIVI as published: 2-bit keys per channel, values per token, groups of 32, float "
                   "offset, the last 128 tokens at 16 bits (fewer on a short text, so one group is quantized)."),
    "Aggressive 25% + 2-bit": "Keep 25% of the tokens (sinks, recent, H2O heavy hitters) and quantize them to 2 bits.",
    "HF QuantizedCache 4-bit": ("No eviction; transformers' QuantizedCache defaults (quanto): 4-bit keys AND values per "
                                "token in groups of 64 channels, float offset, the prompt quantized whole and a "
                                "full-precision window flushed every 128 tokens. Unlike KIVI, keys are per token."),
}


def preset_values(name: str, n_tokens: int) -> dict:
    """Slider values of a preset for a query that sees n_tokens tokens."""
    tenth = max(1, math.ceil(0.1 * n_tokens))
    if name == "Handbook example":
        return dict(_NO_QUANT, sink=handbook.SINK, recent=handbook.RECENT, heavy=handbook.HEAVY, scorer="h2o")
    if name == "StreamingLLM":  # 4 attention sinks + a recent window (~20% of the tokens)
        return dict(_NO_QUANT, sink=4, recent=max(8, 2 * tenth - 4), heavy=0, scorer="streaming")
    if name == "H2O 10%+10%":
        return dict(_NO_QUANT, sink=0, recent=tenth, heavy=tenth, scorer="h2o")
    if name == "KIVI 2-bit":  # keys per channel, values per token, G=32; residual 128 (less on short traces)
        from kvviz.quant import kivi_residual
        return dict(_NO_QUANT, sink=0, recent=0, heavy=0, bits=2, key_bits=2, value_bits=2,
                    residual=kivi_residual(n_tokens))
    if name == "Aggressive 25% + 2-bit":
        budget = max(3, math.ceil(0.25 * n_tokens))
        sink = min(4, budget // 3)
        recent = (budget - sink) // 2
        return dict(_NO_QUANT, sink=sink, recent=recent, heavy=budget - sink - recent, scorer="h2o",
                    bits=2, key_bits=2, value_bits=2)
    if name == "HF QuantizedCache 4-bit":   # kvviz.quant.formats.hf_quantized_cache(4)
        return dict(_NO_QUANT, sink=0, recent=0, heavy=0, bits=4, key_bits=4, value_bits=4, key_axis="token",
                    value_axis="token", group=64, residual=min(128, n_tokens), partial="quantize", res_mode="hf")
    raise ValueError(f"unknown preset {name!r}")


def apply_preset(name: str, n_tokens: int) -> None:
    store = _store()
    for k, v in preset_values(name, n_tokens).items():
        store[k] = v
        st.session_state[k] = v


def preset_buttons(n_tokens: int) -> None:
    with st.container(horizontal=True, vertical_alignment="center", gap="small"):
        st.markdown("**Presets**", width="content")
        for name in PRESETS:
            st.button(name, key=f"preset_{name}", on_click=apply_preset, args=(name, n_tokens),
                      help=PRESET_HELP[name])


# --- cached compute --------------------------------------------------------------------------

def _items(obj) -> tuple:
    return tuple(sorted(asdict(obj).items()))


@st.cache_data(max_entries=64, show_spinner=False)
def _compare_cached(source_key: tuple, spec_items: tuple, view_items: tuple,
                    _trace: Trace, _seed_fn) -> Comparison:
    return compare(_trace, Spec(**dict(spec_items)), View(**dict(view_items)), trace_for_seed=_seed_fn)


@st.cache_resource(show_spinner="Compiling the quantization kernel (once after an install)…")
def _quantization_kernel() -> bool:
    from kvviz.quant import compile_kernel
    compile_kernel()
    return True


def run_compare(source: Source, spec: Spec, view: View) -> Comparison | None:
    """kvviz.compare through the cache; impossible settings show an error and give None."""
    if spec.quantizes and spec.quant_model == "kv":
        _quantization_kernel()
    try:
        return _compare_cached(source.key, _items(spec), _items(view), source.trace, source.seed_fn)
    except (SpecError, TraceError, ValueError) as e:
        st.error(f"Cannot compare with these settings: {e}. Change the View or Compression settings in the sidebar.")
        return None


@st.cache_resource
def _sweep_results() -> dict:
    """Sweeps shared across sessions. Not st.cache_data: the sweep drives a progress bar,
    and Streamlit cannot replay elements created outside a cached function."""
    return {}


def run_sweep(source: Source, scorers: tuple, bits: tuple, view: View, base: Spec,
              max_entries: int = 16, formats: tuple = ()) -> list[dict] | None:
    """kvviz.analysis.sweep with a progress bar, cached by (source, methods, bits, formats, view, base spec)."""
    from kvviz.analysis.sweep import sweep
    key = (source.key, tuple(scorers), tuple(bits), _items(view), _items(base)) + ((tuple(formats),) if formats else ())
    results = _sweep_results()
    if key in results:
        return results[key]
    bar = st.progress(0.0, text="Sweeping budgets and bit widths…")
    try:
        rows = sweep(source.trace, scorers=scorers, bits=bits, view=view, base=base,
                     progress=lambda f, text: bar.progress(min(1.0, f), text=f"Sweeping: {text}"), formats=formats)
    except (SpecError, TraceError, ValueError) as e:
        st.error(f"The sweep failed: {e}. Change the methods, bits or View settings.")
        return None
    finally:
        bar.empty()
    while len(results) >= max_entries:
        results.pop(next(iter(results)))
    results[key] = rows
    return rows


@st.cache_data(max_entries=16, show_spinner=False)
def _concentration_cached(source_key: tuple, step: int | None, sink: int, window: int, _trace: Trace):
    from kvviz.analysis.frames import concentration
    return concentration(_trace, step=step, sink=sink, window=window)


def run_concentration(source: Source, step: int | None, sink: int, window: int):
    return _concentration_cached(source.key, step, sink, window, source.trace)


# --- cards and notes -------------------------------------------------------------------------

def fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def card_values(metrics: dict) -> dict[str, str]:
    """The text of each metric card, from Comparison.metrics."""
    return {
        "Attention mass retained": fmt_pct(metrics["mass_retained"]),
        "TV distance": f"{metrics['tv_distance']:.4f}",
        "TV from quantization": f"{metrics['tv_quantization']:.4f}",
        "KL divergence": f"{metrics['kl']:.4f}",
        "Output error": fmt_pct(metrics["output_rel_error"], 1),
        "KV memory": fmt_bytes(metrics["kv_bytes"]),
        "Memory vs 16-bit": fmt_pct(metrics["memory_ratio"]),
        "Tokens kept": f"{metrics['kept_tokens']} / {metrics['total_tokens']}",
    }


CARD_HELP = {
    "Attention mass retained": "Share of the original attention that falls on tokens the compressed cache keeps.",
    "TV distance": ("Total variation distance ½·Σ|a − â| between original and compressed attention (0 = identical, "
                    "1 = disjoint). With eviction on it is at least the evicted mass, whatever the bits."),
    "TV from quantization": ("What quantization adds on top of eviction: ½·Σ|â − a_evict|, where a_evict is the "
                             "attention with the same tokens evicted but nothing quantized (a / mass on the kept "
                             "tokens). The error chart splits every token's error the same way."),
    "KL divergence": ("In nats: KL(compressed ‖ original) = Σ over kept tokens of â·log(â / a). Always finite; for "
                      "eviction alone it equals −log(mass retained). The other direction, KL(original ‖ compressed), "
                      "is infinite as soon as any attended token is evicted. Not the same quantity as the Model "
                      "lab's KL between next-token distributions."),
    "Output error": ("How far the attention output o = a·V moved: ‖ô − o‖ / ‖o‖, as a share of the output's own "
                     "length. Above 100% the compressed output is further from the original than the original is "
                     "from zero (kept values that point elsewhere); the cosine under it, between −1 and 1, says "
                     "whether ô still points the same way (1 = same direction; it shows the difference from A "
                     "instead when a setting is pinned)."),
    "KV memory": "Bytes of the compressed K and V cache, all layers and KV heads, incl. scales and zero points.",
    "Memory vs 16-bit": "Compressed bytes as a share of a full 16-bit cache of the same tokens.",
    "Tokens kept": "Tokens in the compressed cache of the tokens this query sees.",
}
# For comparing against a pinned setting: is a rise good (normal), bad (inverse) or neither (off)?
CARD_DIRECTION = {"Attention mass retained": ("mass_retained", "normal"), "TV distance": ("tv_distance", "inverse"),
                  "TV from quantization": ("tv_quantization", "inverse"), "KL divergence": ("kl", "inverse"),
                  "Output error": ("output_rel_error", "inverse"), "KV memory": ("kv_bytes", "inverse"),
                  "Memory vs 16-bit": ("memory_ratio", "inverse"), "Tokens kept": ("kept_tokens", "off")}


def card_delta(label: str, now: dict, pinned: dict) -> str | None:
    """'+0.0123' style difference of a card's number against the pinned setting A."""
    key = CARD_DIRECTION[label][0]
    a, b = pinned.get(key), now.get(key)
    if a is None or b is None:
        return None
    d = b - a
    if key in ("mass_retained", "output_rel_error", "memory_ratio"):
        return f"{100 * d:+.1f} pts"
    if key == "kv_bytes":
        return ("+" if d >= 0 else "−") + fmt_bytes(abs(d))
    if key == "kept_tokens":
        return f"{int(d):+d}"
    return f"{d:+.4f}"


def metric_cards(comp: Comparison, pinned: Comparison | None = None) -> None:
    """Eight cards in two rows; with a pinned setting A each shows its difference from A."""
    values = card_values(comp.metrics)
    ratio = comp.metrics["compression_ratio"]
    cols = st.columns(4) + st.columns(4)
    for col, (label, value) in zip(cols, values.items()):
        extra = f" ({ratio:.1f}× smaller)" if label == "Memory vs 16-bit" and math.isfinite(ratio) else ""
        kwargs = {}
        cosine = comp.metrics["output_cosine"]
        if label == "Output error" and cosine is not None:   # the bounded measure beside it
            kwargs = dict(delta=f"cos {cosine:.2f}", delta_color="off", delta_arrow="off")
        if pinned is not None:
            kwargs = dict(delta=card_delta(label, comp.metrics, pinned.metrics), delta_color=CARD_DIRECTION[label][1],
                          delta_description="vs pinned A")
        col.metric(label, value, help=CARD_HELP[label] + extra, border=True, **kwargs)


def metrics_table(comp: Comparison):
    """Every metric of the primary row next to its ensemble mean (the 'All numbers' table)."""
    import pandas as pd
    from kvviz.metrics import DEFINITIONS
    mean = comp.metrics_mean
    rows = [{"metric": k, "value": fmt_exact(v), "ensemble mean": fmt_exact(mean.get(k)),
             "definition": DEFINITIONS.get(k, "")} for k, v in comp.metrics.items()]
    return pd.DataFrame(rows)


def fmt_exact(x) -> str:
    """A number in full (repr) precision for the 'All numbers' table; ∞ for infinity, blank for none."""
    if x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "−∞"
    return repr(float(x)) if isinstance(x, float) else str(x)


def quant_model_note(source: Source, spec: Spec) -> str:
    if spec.quant_model == "noise":
        return (f"Quantization model: the handbook's logit-noise stand-in (logits + σ·ε, σ = {spec.noise_sigma:g}); "
                "the bits set the memory only.")
    state = "off (16 bits)" if not spec.quantizes else f"K {spec.key_bits}-bit / V {spec.value_bits}-bit"
    if spec.quantizes and (spec.key_format != "int" or spec.value_format != "int" or spec.rotate != "none"):
        from kvviz.spec import _format_label
        state = (f"K {_format_label(spec.key_format, spec.key_bits)} / V {_format_label(spec.value_format, spec.value_bits)}"
                 + ("" if spec.rotate == "none" else ", Hadamard-rotated " + spec.rotate.replace("-", " and ")))
    return f"Quantization model: {source.quant_note_kv}; now {state}."


def budget_warnings(spec: Spec, n_seen: int) -> list[str]:
    """What to change when the budgets do not mean what the sliders suggest."""
    out = []
    left = n_seen - min(n_seen, spec.sink + spec.recent)
    if spec.evicts and spec.heavy > left:
        out.append(f"Heavy-hitter budget {spec.heavy} is larger than the {left} tokens left after the sinks and "
                   f"the recent window, so every token is kept. Lower the Heavy-hitter budget below {left} "
                   "(or the other sliders).")
    elif spec.evicts and spec.budget >= n_seen:
        out.append(f"Sink + recent + heavy = {spec.budget} covers all {n_seen} tokens this query sees, so nothing "
                   "is evicted. Lower the sliders (or pick a later query) to see eviction.")
    return out


def quant_warnings(spec: Spec, kept: int) -> list[str]:
    """Where the bits slider cannot change anything: the kept tokens do not fill one group."""
    if spec.quant_model != "kv" or spec.partial != "full":
        return []
    out = []
    for what, bits, axis, fmt in (("keys", spec.key_bits, spec.key_axis, spec.key_format),
                                  ("values", spec.value_bits, spec.value_axis, spec.value_format)):
        outside = max(0, kept - spec.residual)
        if fmt == "int" and spec.residual_mode == "kivi" and bits < FULL_BITS and axis == "channel" \
                and outside < spec.group_size:
            out.append(f"The {what} are not quantized: the {outside} kept tokens outside the residual window do not "
                       f"fill one per-channel group of {spec.group_size}, and KIVI keeps a partial group at 16 bits. "
                       "Lower the group size under Advanced, or quantize partial groups too.")
    return out


def _quantize_partial_groups() -> None:
    _store()["partial"] = st.session_state["partial"] = "quantize"


def quant_warning_box(spec: Spec, kept: int) -> None:
    """The warnings above, with a one-click way out."""
    for w in quant_warnings(spec, kept):
        st.warning(w, icon=":material/warning:")
    if quant_warnings(spec, kept):
        st.button("Quantize the partial groups too", key="_fix_partial", on_click=_quantize_partial_groups)


def scorer_help() -> str:
    from kvviz.policies import POLICIES
    from kvviz.policies.registry import load_entry_points
    load_entry_points()

    def line(name, p):
        extra = "; ".join(x for x in (p.paper, f"kvpress: {p.kvpress}" if p.kvpress else "") if x)
        return f"- **{SCORER_LABELS.get(name)}**: {p.description}." + (f" ({extra})" if extra else "")
    return "How heavy hitters are ranked:\n\n" + "\n".join(line(name, p) for name, p in POLICIES.items())


def scorer_note(spec: Spec, trace: Trace | None = None) -> str | None:
    """What the chosen scorer keeps and why, where the sliders alone do not say it."""
    if not spec.evicts:
        return None
    if spec.heavy > 0 and spec.scorer == "streaming":
        return ("StreamingLLM ranks tokens by position only, so the heavy-hitter budget simply widens the recent "
                "window; pick another scorer under Advanced to keep heavy hitters.")
    if spec.scorer == "snapkv" and trace is not None:
        c, w = trace.context_len, min(spec.observation_window, trace.context_len)
        return (f"SnapKV: the last {w} context queries (positions {c - w}–{c - 1}) are the observation window; "
                f"they vote with their attention, averaged and smoothed (pooling kernel {spec.snapkv_kernel}). "
                f"The window is kept as part of the recent window ({spec.recent} tokens); the {spec.heavy} heavy "
                f"hitters are the top-voted tokens before position {c - w}.")
    if spec.scorer == "oracle" and trace is not None and trace.group_size > 1:
        return (f"The oracle keeps one cache per KV head, chosen by the attention of all {trace.group_size} query "
                "heads that share it: it is the bound for the group's total attention mass, not for each query "
                "head on its own, so another policy can keep slightly more of this one head's mass.")
    if spec.scorer in ("h2o", "tova") and trace is not None and trace.has_later_queries:
        form = " divided by the queries that saw each token" if spec.h2o_normalized and spec.scorer == "h2o" else ""
        return (f"{'H2O' if spec.scorer == 'h2o' else 'TOVA'} decides again at every decode step{form}: the new "
                f"token arrives inside the budget, so each query attends over exactly {spec.budget} tokens "
                "(sink + recent + heavy), itself among them.")
    return new_scorer_note(spec, trace)


def new_scorer_note(spec: Spec, trace: Trace | None = None) -> str | None:
    """Issue #12: what Quest saves, what an allocation does, how the new scorers decide."""
    alloc = {"adakv": f" AdaKV: this layer's {spec.heavy} × KV-heads heavy slots go to the top scores across its "
                      f"heads (each head at least {int(spec.adakv_alpha * spec.heavy)}), so heads hold different "
                      "numbers of tokens — the Budget ledger below lists each head.",
             "pyramid": f" PyramidKV: each layer has its own heavy budget, falling linearly with depth (β "
                        f"{spec.pyramid_beta:g}), the same total as {spec.heavy} per layer — see the Budget ledger."
             }.get(spec.allocation, "")
    what = {"quest": f"Quest keeps the whole cache plus each page's min / max keys (pages of {spec.page_size}); "
                     "this query reads only its top pages by the bound q·k ≤ Σ max(q·min, q·max), so it saves "
                     "memory read per step, not memory stored (the memory card counts what is stored).",
            "expected_attention": f"Expected Attention: the context queries' mean and covariance (before RoPE) "
                                  f"rotated over the next {spec.ea_horizon} positions give each key its expected "
                                  "attention, times its value norm; the first 4 tokens always rank first (kvpress).",
            "keydiff": "KeyDiff: keys least similar (cosine) to the mean of the context's normalised keys are kept; "
                       "no attention is needed.",
            "chunkkv": f"ChunkKV: chunks of {spec.chunk_size} tokens, ranked by the mean {spec.chunk_scorer} score "
                       "of their tokens summed over heads, are kept whole (one decision for every head)."}.get(
        spec.scorer, "")
    text = (what + alloc).strip()
    return text or None


def page_setup(title: str, intro: str) -> bool:
    """Every page's head: the app-wide layout styles, the Presentation mode switch (sidebar,
    in the URL), the title and its one-line intro (a smaller title and no intro when
    presenting). Returns whether presentation mode is on."""
    from kvviz.app.explorer import LAYOUT_CSS, PRESENT_CSS
    from kvviz.app.sources import warm_up
    warm_up()   # the bundled model starts loading in the background on the first page view
    present = bool(w_check(st.sidebar, "present", "Presentation mode",
                           help="For a projector: larger text, the main chart first, the extras (tables, downloads, "
                                "explanations) folded away. Kept in the link."))
    st.html(LAYOUT_CSS + (PRESENT_CSS if present else ""))
    if present:
        st.subheader(title)
    else:
        st.title(title)
        st.caption(intro)
    return present


__all__ = ["BITS_OPTIONS", "PARAMS", "PRESETS", "Param", "Settings", "Source", "apply_preset", "budget_warnings",
           "card_values", "fmt_bytes", "fmt_pct", "metric_cards", "notice", "page_setup", "preset_buttons",
           "preset_values", "quant_model_note", "run_compare", "run_concentration", "run_sweep", "show_notices",
           "sidebar", "sync_url"]


# --- layer x head overview and token grid ---------------------------------------------------------

OVERVIEW_MAX_CELLS = 1024   # layers x heads
OVERVIEW_MAX_TOKENS = 8192
GRID_MAX_TOKENS = 1500


@st.cache_data(max_entries=32, show_spinner="Computing every layer and head…")
def _head_grid_cached(source_key: tuple, spec_items: tuple, step: int | None, metric: str,
                      _trace: Trace) -> np.ndarray:
    from kvviz.engine import head_grid
    return head_grid(_trace, Spec(**dict(spec_items)), step, metric)


def _jump(layer: int, head: int) -> None:
    for name, value in (("layer", layer), ("head", head)):
        _store()[name] = value
        st.session_state[name] = value


def head_overview(source: Source, spec: Spec, view: View) -> None:
    """A layers x heads heatmap of the error at this query, and a jump to the worst head."""
    t = source.trace
    if t.n_layers * t.n_q_heads <= 1:
        return
    with st.expander("Layer × head overview: where does compression hurt most?"):
        n = int(t.query_positions[t.evaluated_queries[-1 if view.step is None else view.step]]) + 1
        if t.n_layers * t.n_q_heads > OVERVIEW_MAX_CELLS or n > OVERVIEW_MAX_TOKENS:
            st.info(f"The overview covers up to {OVERVIEW_MAX_CELLS} layer × head cells and "
                    f"{OVERVIEW_MAX_TOKENS} tokens; this trace is larger. Pick a layer and head in View.")
            return
        metric = st.radio("Colour by", ("tv_distance", "mass_retained"), horizontal=True, key="_overview_metric",
                          format_func={"tv_distance": "TV distance (error)",
                                       "mass_retained": "attention mass retained"}.get)
        try:
            grid = _head_grid_cached(source.key, _items(spec), view.step, metric, t)
        except (SpecError, TraceError, ValueError) as e:
            st.error(f"Cannot compute the overview: {e}")
            return
        label = "TV distance" if metric == "tv_distance" else "mass retained"
        st.plotly_chart(figures.heatmap_figure(grid, f"{label} per layer and query head at this query", label),
                        key="overview_chart")
        worst = np.unravel_index(np.argmax(grid) if metric == "tv_distance" else np.argmin(grid), grid.shape)
        st.button(f"Jump to the head that loses most: layer {worst[0]}, head {worst[1]}", key="_jump_worst",
                  on_click=_jump, args=(int(worst[0]), int(worst[1])))
        st.caption("What to look for: bright cells (TV) or dark cells (mass) are the heads this setting hurts; "
                   "early layers and local heads usually suffer most from heavy eviction.")


def has_text_tokens(trace: Trace) -> bool:
    """True for real text (a model capture), not the t0, t1, ... labels of synthetic sources."""
    return trace.meta.get("source") not in ("handbook", "synthetic")


def token_grid(comp: Comparison, source: Source) -> None:
    """The real text as chips: sink / recent / heavy hitter / evicted / the newest token."""
    if not has_text_tokens(source.trace):
        return
    p = comp.primary
    n = len(comp.tokens)
    c1, c2 = st.columns([2, 3], vertical_alignment="bottom")
    c1.markdown("**The text, as the compressed cache holds it**")
    shade = w_choice(c2, "grid_shade", "Colour the chips by", ("reason", "attention", "error"), widget="radio",
                     format_func={"reason": "why kept", "attention": "original attention",
                                  "error": "attention error"}.get)
    if n > GRID_MAX_TOKENS:
        st.caption(f"Showing the last {GRID_MAX_TOKENS} of {n} tokens.")
    start = max(0, n - GRID_MAX_TOKENS)
    reasons = [REASONS[int(r)] for r in p.reason[start:]]
    context = source.trace.context_len - start if source.trace.context_len < n else None
    st.html(figures.token_grid_html(comp.tokens[start:], reasons, p.original[start:], newest=n - 1 - start,
                                    shade=shade, error=p.error[start:], context_len=context))
    st.caption("What to look for: which words survive. Sinks and the recent window are kept by position; "
               "heavy hitters by score; struck-through tokens are gone for this query. Hover a token for its "
               "attention and error.")
