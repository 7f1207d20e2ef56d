"""The sidebar: the Source picker and its knobs, then Compression (kvviz.app.compression), then View.

`sidebar()` renders them in that fixed order and returns the `Settings` a page computes with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import streamlit as st

from kvviz.app import guard
from kvviz.app.compression import compression_section
from kvviz.app.compute import Source
from kvviz.app.labels import SOURCE_LABELS
from kvviz.app.params import ENSEMBLE_OPTIONS
from kvviz.app.store import in_link, show_notices, state, w_choice, w_number, w_slider, w_step
from kvviz.sources import handbook
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import Trace, TraceError

# --- sources ---------------------------------------------------------------------------------


# room for every seed of the largest ensemble (32, the Ensemble size slider's top) and a few more: an
# LRU smaller than the ensemble rebuilt every seed's trace on every move
@st.cache_resource(max_entries=40, show_spinner=False)
def _handbook(seed: int = 0) -> Trace:
    return handbook.handbook_trace(seed=seed)


@st.cache_resource(max_entries=16, show_spinner="Generating the synthetic pattern…")
def _synthetic(items: tuple) -> Trace:
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

    return make_synthetic(SyntheticSpec(**dict(items)))


def _external_sources() -> dict[str, Callable | None]:
    """The Real model and Trace file pickers (kvviz.app.sources, kvviz.app.tracefiles); None for one whose
    module cannot be imported here (torch missing, say): the app keeps the other sources."""
    found: dict[str, Callable | None] = {"real": None, "file": None}
    try:
        from kvviz.app.tracefiles import trace_file_source  # noqa: PLC0415

        found["file"] = trace_file_source
        from kvviz.app.sources import real_model_source  # noqa: PLC0415

        found["real"] = real_model_source
    except Exception:  # a broken import must not take the app down
        pass
    return found


def _fingerprint(trace: Trace) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in (trace.q, trace.k, trace.v, trace.logits):
        # read from its file as shown: its identity
        if a is not None and getattr(a, "lazy", False):
            h.update(a.fingerprint().encode())
        elif a is not None:
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
    choice = w_choice(
        where,
        "source",
        "Attention source",
        options,
        widget="radio",
        format_func=SOURCE_LABELS.get,
        help="Where the attention comes from: the handbook's worked example, a tunable "
        "synthetic pattern, or (when available) a real model or a saved trace.",
    )
    missing = [SOURCE_LABELS[k] for k in ("real", "file") if external[k] is None]
    if missing:
        where.caption(f"{' and '.join(missing)}: coming soon.")
    if choice == "handbook":
        where.caption("One query over 64 tokens: sinks 0-3, heavy hitters 15 and 28, a local window of 8.")
        return Source(
            ("handbook",),
            _handbook(0),
            "handbook example",
            seed_fn=_handbook,
            quant_note_kv="real K/V quantization of keys realised from the handbook's logits (exact at 16 bits)",
        )
    if choice == "synthetic":
        return _synthetic_section(where)
    fn = external[choice]
    try:
        trace = fn(where)
    except (TraceError, SpecError, ValueError, OSError) as e:
        st.error(f"The {SOURCE_LABELS[choice]} source failed: {e}")
        return None
    if trace is None:
        st.info(
            "Press **Capture** above to run the model, or change the model and prompt in the sidebar."
            if choice == "real" and st.session_state.get("_rm_waiting")
            else f"Choose a {SOURCE_LABELS[choice].lower()} in the sidebar to start."
        )
        return None
    return Source(("external", choice, _fingerprint(trace)), trace, SOURCE_LABELS[choice].lower())


SYNTHETIC_PRESET_HELP = {
    "realistic": "Concentrated like a real model (the default): a strong first-token sink and a few heavy hitters; "
    "the top 10% of tokens hold ~87% of the attention (SmolLM2-135M measured: 84%).",
    "diffuse": "The hard case: a weak sink and a flat background, so eviction must keep most tokens for 95% "
    "of the mass.",
    "topic shift": "Late anchor tokens that no context query looked at, needed after the shift halfway through 48 "
    "decode steps: where history-based eviction (H2O, TOVA) fails.",
}
SYNTHETIC_KNOBS = (
    "sink_strength",
    "local_strength",
    "local_width",
    "n_anchors",
    "anchor_strength",
    "sparsity",
    "topic_shift",
    "outlier_channels",
    "outlier_scale",
    "steps",
)


def _apply_synthetic_preset(name: str) -> None:
    from kvviz.sources.synthetic import PRESETS

    preset = PRESETS[name].as_dict()
    for knob in SYNTHETIC_KNOBS:
        state()[knob] = preset[knob]
        st.session_state[knob] = preset[knob]


def _pattern_knobs() -> dict:
    """The synthetic pattern's shape: sink, locality, anchors, background, topic shift, outliers, head dim."""
    return dict(
        sink_strength=w_number(st, "sink_strength", "Sink strength (logit)", 0.0, 30.0, step=0.5),
        local_strength=w_number(st, "local_strength", "Locality strength (logit)", 0.0, 30.0, step=0.5),
        local_width=w_number(st, "local_width", "Locality width (tokens)", 0.5, 512.0, step=1.0),
        n_anchors=w_number(st, "n_anchors", "Anchor tokens (heavy hitters)", 0, 64),
        anchor_strength=w_number(st, "anchor_strength", "Anchor strength (logit)", 0.0, 30.0, step=0.5),
        sparsity=w_number(st, "sparsity", "Background sparsity (logit std)", 0.0, 10.0, step=0.1),
        topic_shift=w_number(
            st,
            "topic_shift",
            "Topic shift (logit; 0 = off)",
            0.0,
            30.0,
            step=0.5,
            help="Late anchors that only the later queries need: where history-based eviction fails.",
        ),
        outlier_channels=w_number(st, "outlier_channels", "Key outlier channels", 0, 16),
        outlier_scale=w_number(st, "outlier_scale", "Outlier scale", 0.0, 100.0, step=1.0),
        head_dim=w_choice(st, "head_dim", "Head dim", (32, 64, 128)),
        seed=w_number(st, "syn_seed", "Pattern seed", 0, 1_000_000),
    )


def _synthetic_section(where) -> Source | None:
    from kvviz.sources.synthetic import PRESETS, SyntheticSpec

    with where.container(horizontal=True, gap="small"):
        for name in PRESETS:
            st.button(
                name.capitalize(),
                key=f"synthetic_{name}",
                on_click=_apply_synthetic_preset,
                args=(name,),
                help=SYNTHETIC_PRESET_HELP[name],
            )
    knobs = dict(
        context=w_number(
            where,
            "context",
            "Context tokens",
            8,
            32768,
            step=64,
            help="Prompt length: the compression point. Past 256 tokens the charts switch to bins.",
        ),
        steps=w_number(where, "steps", "Later queries (decode steps)", 0, 512, step=8),
        layers=w_number(where, "layers", "Layers", 1, 32),
        q_heads=w_number(where, "q_heads", "Query heads", 1, 32),
        kv_heads=w_number(
            where, "kv_heads", "KV heads", 1, 32, help="Query heads must be a multiple of KV heads (GQA)."
        ),
    )
    with where.expander("Pattern knobs"):
        knobs.update(_pattern_knobs())
    try:  # past the work budget: a notice, and the previous (or default) pattern
        spec = guard.within_budget("synthetic", lambda: SyntheticSpec(**knobs), SyntheticSpec)
    except SpecError as e:
        st.error(f"The synthetic pattern cannot be built: {e}. Change the pattern knobs in the sidebar.")
        return None
    items = tuple(sorted(spec.as_dict().items()))

    def seed_fn(r: int, _spec=spec) -> Trace:
        return _synthetic(tuple(sorted(_spec.with_(seed=_spec.seed + r).as_dict().items())))

    return Source(
        ("synthetic", items), _synthetic(items), f"synthetic pattern ({spec.context} tokens)", seed_fn=seed_fn
    )


# --- view ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViewSettings:
    view: View
    bars: str
    ensemble_choice: str


def view_section(
    source: Source, where=None, ensemble: bool = True, layer_head: bool = True, head: bool = True
) -> ViewSettings:
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
        layer = layer_picker(where, t)
        if head:
            head_index = w_number(where, "head", "Query head", 0, t.n_q_heads - 1, disabled=t.n_q_heads == 1)
    step = w_step(where, n_eval, scope=(source.key, n_eval))
    choice, bars, size = "none", "std", 1
    if ensemble:
        choice = w_choice(
            where,
            "ensemble",
            "Error bars over",
            ENSEMBLE_OPTIONS,
            format_func=lambda c: {
                "auto": "auto (seeds for the handbook, heads otherwise)",
                "none": "none (one row)",
            }.get(c, c),
            help="The ensemble behind the error bars: query heads of this layer, layers, "
            "recent decode steps, or repeated random draws (seeds).",
        )
        size = w_slider(where, "ens_size", "Ensemble size", 2, 32)
        bars = w_choice(
            where,
            "bars",
            "Error bars show",
            ("std", "ci95", "range"),
            widget="radio",
            format_func={"std": "± 1 sample std", "ci95": "95% CI of the mean", "range": "min–max"}.get,
            help="± 1 sample standard deviation of the members (n − 1); a 95% t-interval for the "
            "mean error (mean ± t·s/√N, members taken as independent draws); or the range of "
            "the N members themselves.",
        )
    ens = resolve_ensemble(choice, source)
    return ViewSettings(
        View(
            layer=int(layer),
            head=int(head_index),
            step=None if step < 0 else int(step),
            ensemble=ens,
            ensemble_size=int(size),
        ),
        bars,
        choice,
    )


# Past this many bytes of keys (every layer's), the typical head is chosen within one layer: a big trace
# opens lazily, a layer at a time, and reading all of it to pick where to open would cost more than the view
TYPICAL_ALL_LAYERS_BYTES = 256 * 10**6


def typical_head(trace: Trace) -> tuple[int, int, str]:
    """(layer's position in the trace, head, why): the head whose attention concentration (top-10% mass at the
    last query) is the median over every layer and head - typical, neither the best nor the worst. On a
    trace whose keys pass TYPICAL_ALL_LAYERS_BYTES, the median head of its middle layer (one layer read)."""
    from kvviz.analysis.frames import concentration
    from kvviz.attention import logit_rows, softmax
    from kvviz.metrics import concentration_curve

    if trace.k is not None and trace.k.nbytes > TYPICAL_ALL_LAYERS_BYTES:
        middle = trace.n_layers // 2
        rows = softmax(logit_rows(trace, middle, np.arange(trace.n_q_heads), int(trace.evaluated_queries[-1])))
        top10 = np.zeros((trace.n_layers, trace.n_q_heads))
        top10[middle] = [concentration_curve(a, np.array([0.1]))[1][0] for a in rows]
        order = middle * trace.n_q_heads + np.argsort(top10[middle], kind="stable")
        among = f"the {trace.n_q_heads} heads of layer {trace.layer_numbers[middle]} (a big trace: one layer read)"
    else:
        top10 = concentration(trace, fractions=np.array([0.1])).top10  # (layers, heads)
        order = np.argsort(top10, axis=None, kind="stable")
        among = f"all {top10.size} heads"
    layer, head = np.unravel_index(order[len(order) // 2], top10.shape)
    why = (
        f"Opened on layer {trace.layer_numbers[layer]}, head {head}: the head whose attention concentration "
        f"(top-10% mass {top10[layer, head]:.0%}) is the median of {among} — typical, neither the best nor the "
        "worst (layer 0, head 0 is often the most diffuse). Change it under View."
    )
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
    store = state()
    if in_link("layer") or in_link("head") or (store["layer"], store["head"]) != (0, 0):
        return
    if source.trace.n_layers * source.trace.n_q_heads <= 1:
        return
    layer, head, why = typical_head(source.trace)
    for name, value in (("layer", source.trace.layer_numbers[layer]), ("head", head)):  # the link's number
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


def sidebar(compression: bool = True, ensemble: bool = True, head: bool = True, headline=None) -> Settings | None:
    """Render the sidebar in the fixed order: Source, its knobs, Compression, Advanced, View.
    headline: a main-area container for the four headline sliders (Presentation mode)."""
    state()
    source = source_section()
    if source is None:
        show_notices()
        return None
    spec = compression_section(source.trace, headline=headline) if compression else None
    # without compression controls the page shows every layer and head (Concentration)
    view = view_section(source, ensemble=ensemble, layer_head=compression, head=head)
    show_notices()
    return Settings(source, spec, view)


def layer_picker(where, t, name: str = "layer") -> int:
    """The Layer box: the model's own layer numbers (a capture of `--layers 0-3,15,29` offers those six), the
    link's `name` (`layer`, the timeline's `tl_layer`) being that number too; returns the layer's position
    in the trace."""
    numbers = t.layer_numbers
    if numbers == tuple(range(t.n_layers)):
        return int(w_number(where, name, "Layer", 0, t.n_layers - 1, disabled=t.n_layers == 1))
    number = w_choice(
        where,
        name,
        "Layer (the model's number)",
        numbers,
        help="This trace holds some of the model's layers; each is named by its number in the model.",
    )
    return t.layer_index(number)
