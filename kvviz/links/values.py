"""A link's values: read from a query string (or the app's address bar, or a pin) and written back, and
the Spec, View and source they describe. The values are keyed by URL name, each parsed by its Param in
kvviz.links.params."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit

from kvviz.links.params import NOT_IN_LINKS, PARAMS
from kvviz.sources import handbook
from kvviz.settings import SETTINGS
from kvviz.spec import FULL_BITS, Spec, SpecError, View
from kvviz.trace import Trace


def spec_from_values(v: dict) -> Spec:
    """The Spec the compression controls describe, from their stored values (URL names); a setting the values
    do not name keeps its link default."""
    values = {}
    for s in SETTINGS.values():
        if s.name in NOT_IN_LINKS:
            continue
        raw = v.get(s.url_name, PARAMS[s.url_name].default)
        values[s.name] = None if s.default is None and raw == s.none_as else raw
    if not v.get("split", False):
        values["key_bits"] = values["value_bits"] = v.get("bits", FULL_BITS)
    return Spec(**values)


# --- reading a link outside the app ------------------------------------------------------------


def defaults() -> dict:
    """Every setting at its default: what a link without a query string opens."""
    return {name: p.default for name, p in PARAMS.items()}


def read_settings(
    pairs, names=None, unknown: str = "`{name}` is not a kvviz setting", prefix: str = ""
) -> tuple[dict, list[str]]:
    """(values, notices) of (name, raw text) pairs: what a link's query string, the app's address bar and
    a pin all carry. Each known name is parsed by its Param (clamped or replaced with a notice); a name
    outside `names` (default: every setting) gives the `unknown` notice; `prefix` starts each Param
    notice. Only the named settings are in `values` (the caller starts from the defaults)."""
    names = PARAMS if names is None else names
    values, notes = {}, []
    for name, raw in pairs:
        if name not in names:
            notes.append(unknown.format(name=name))
            continue
        values[name], note = PARAMS[name].parse(raw)
        if note:
            notes.append(prefix + note)
    return values, notes


def parse_query(link: str) -> tuple[dict, list[str]]:
    """(values, notices) of a link: a whole URL or only its query string ('sink=2&bits=4').

    Every setting the link does not name keeps its default; a name that is not a setting, or a
    value the app would clamp or replace, gives a notice (the app shows the same ones).
    """
    text = link.strip()
    query = urlsplit(text).query if "?" in text or "://" in text else text.lstrip("?")
    read, notes = read_settings(parse_qsl(query, keep_blank_values=True))
    return {**defaults(), **read}, notes


def encode_query(values: dict) -> str:
    """The query string the app writes for these values: the settings that differ from their defaults."""
    return urlencode(
        {name: PARAMS[name].encode(v) for name, v in values.items() if name in PARAMS and v != PARAMS[name].default}
    )


# URL name -> kvviz.sources.synthetic.SyntheticSpec field: the synthetic source's knobs
SYNTHETIC_PARAMS = {
    "context": "context",
    "steps": "steps",
    "layers": "layers",
    "q_heads": "q_heads",
    "kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "syn_seed": "seed",
    "sink_strength": "sink_strength",
    "local_strength": "local_strength",
    "local_width": "local_width",
    "n_anchors": "n_anchors",
    "anchor_strength": "anchor_strength",
    "sparsity": "sparsity",
    "topic_shift": "topic_shift",
    "outlier_channels": "outlier_channels",
    "outlier_scale": "outlier_scale",
}


def synthetic_from_values(v: dict):
    """The SyntheticSpec a link's synthetic knobs describe (SpecError if they cannot be built)."""
    from kvviz.sources.synthetic import SyntheticSpec

    return SyntheticSpec(**{field: v[name] for name, field in SYNTHETIC_PARAMS.items()})


def synthetic_preset_values(name: str) -> dict:
    """The settings a synthetic preset opens with: kvviz.sources.synthetic.PRESETS[name] as link values."""
    from kvviz.sources.synthetic import PRESETS

    preset = PRESETS[name].as_dict()
    return {**defaults(), "source": "synthetic", **{k: preset[field] for k, field in SYNTHETIC_PARAMS.items()}}


def resolve_ensemble(choice: str, source: str) -> str | None:
    """What 'Error bars over' means for a source: auto = seeds for the handbook, query heads otherwise."""
    if choice == "none":
        return None
    if choice == "auto":
        return "seeds" if source == "handbook" else "heads"
    return choice


def view_from_values(v: dict) -> View:
    """The View a link's layer, head, step and ensemble settings describe."""
    step = int(v["step"])
    return View(
        layer=int(v["layer"]),
        head=int(v["head"]),
        step=None if step < 0 else step,
        ensemble=resolve_ensemble(v["ensemble"], v["source"]),
        ensemble_size=int(v["ens_size"]),
    )


# --- the source a link names ---------------------------------------------------------------------

HANDBOOK_QUANT_NOTE = "real K/V quantization of keys realised from the handbook's logits (exact at 16 bits)"


@dataclass(frozen=True, eq=False)
class LinkedSource:
    """The attention source of a link: its trace, the traces of other random seeds, and its names."""

    name: str  # one of SOURCE_NAMES
    trace: Trace
    label: str  # as the app's caption names it
    trace_for_seed: Callable[[int], Trace] | None = None
    quant_note: str = "real K/V quantization of the cached keys and values"


def source_from_values(v: dict, trace: Trace | None = None) -> LinkedSource:
    """The handbook or synthetic source a link describes; a real model's or a file's trace must be given
    (a link names only how it was captured). SpecError if the link's knobs cannot build it."""
    from kvviz.sources import make_synthetic

    name = v["source"]
    if name == "handbook":
        return LinkedSource(
            name,
            handbook.handbook_trace(),
            "handbook example",
            lambda r: handbook.handbook_trace(seed=r),
            HANDBOOK_QUANT_NOTE,
        )
    if name == "synthetic":
        syn = synthetic_from_values(v)
        return LinkedSource(
            name,
            make_synthetic(syn),
            f"synthetic pattern ({syn.context} tokens)",
            lambda r: make_synthetic(syn.with_(seed=syn.seed + r)),
        )
    if trace is None:
        raise SpecError(
            f"the link's source is {'a real model' if name == 'real' else 'a trace file'}, whose trace "
            "is not in the link: give the trace file"
        )
    m = trace.meta
    label = (
        f"{m['model']}: {m.get('prompt_tokens', trace.context_len)} prompt tokens + {m.get('new_tokens', 0)} generated"
        if m.get("model")
        else f"trace ({trace.n_positions} tokens)"
    )
    return LinkedSource(name, trace, label)
