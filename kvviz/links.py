"""What a link to the app carries: every setting's URL name, kind, default and widest range, and the
Spec, View and source they describe.

`PARAMS` is the one table of settings a link may carry; `Param.parse` turns a raw query-parameter
string into a value (clamped or replaced by the default, with a notice), `Param.encode` back.
The app (kvviz.app) keeps its controls in it and the command line reads links with it
(`kvviz lesson export --from-url`), so it sits below both and imports no Streamlit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from kvviz.sources import handbook
from kvviz.spec import FORMATS, FP8_SCALES, FULL_BITS, RESIDUAL_MODES, ROTATIONS, SCORERS, Spec, SpecError, View
from kvviz.trace import Trace

SOURCE_NAMES = ("handbook", "synthetic", "real", "file")   # kvviz.app.labels.SOURCE_LABELS names them
BITS_OPTIONS = (1, 2, 3, 4, 5, 6, 7, 8, FULL_BITS)
GROUP_OPTIONS = (8, 16, 32, 64, 128)
ENSEMBLE_OPTIONS = ("auto", "none", "heads", "layers", "steps", "seeds")
MAX_TOKENS = 32768 + 512


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
            by_text = {str(c): c for c in self.choices}
            # in the link's order, as the widget had them (so the link reads back as it was written)
            known = list(dict.fromkeys(by_text[s.strip()] for s in items if s.strip() in by_text))
            bad = [s for s in items if s.strip() not in by_text]
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
    Param("source", "choice", "handbook", choices=SOURCE_NAMES),
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
    # the app quantizes a short trailing group too (KIVI keeps it at 16 bits until it fills): on the handbook
    # example the 14 kept tokens fill no per-channel key group of 32, and the bits slider would reach nothing
    Param("partial", "choice", "quantize", choices=("full", "quantize")),
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
    Param("pin", "text", ""), Param("ylock", "float", 0.0, -1.0, 1.0),
    # the attention chart's locked top (0: automatic); ylock: the error chart's ±range, 0 automatic (locked at
    # the first view in Presentation mode), -1 unlocked by choice
    Param("alock", "float", 0.0, 0.0, 1.0),
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
    # studies page: the open study (a folder under the studies root) and its measure
    Param("study", "text", ""), Param("st_metric", "text", ""),
    # real model source
    Param("rm_text", "choice", "bakery", choices=("bakery", "sample", "custom")),
    Param("rm_new", "int", 16, 0, 64), Param("rm_max", "int", 1024, 16, 4096),
]
PARAMS: dict[str, Param] = {p.name: p for p in _PARAMS}

# the settings a pinned setting A records (the compression controls)
COMPRESSION_PARAMS = ("sink", "recent", "heavy", "bits", "scorer", "split", "key_bits", "value_bits", "key_axis",
                      "value_axis", "group", "residual", "symmetric", "zero_point", "partial", "qmodel", "sigma",
                      "snap_window", "h2o_norm", "key_fmt", "value_fmt", "fp8_scale", "rotate", "res_mode",
                      "allocation", "ada_alpha", "pyr_beta", "ea_horizon", "ea_cov", "chunk", "chunk_scorer",
                      "page")


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


# --- reading a link outside the app ------------------------------------------------------------

def defaults() -> dict:
    """Every setting at its default: what a link without a query string opens."""
    return {name: p.default for name, p in PARAMS.items()}


def read_settings(pairs, names=None, unknown: str = "`{name}` is not a kvviz setting",
                  prefix: str = "") -> tuple[dict, list[str]]:
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
    return urlencode({name: PARAMS[name].encode(v) for name, v in values.items()
                      if name in PARAMS and v != PARAMS[name].default})


# URL name -> kvviz.sources.synthetic.SyntheticSpec field: the synthetic source's knobs
SYNTHETIC_PARAMS = {"context": "context", "steps": "steps", "layers": "layers", "q_heads": "q_heads",
                    "kv_heads": "kv_heads", "head_dim": "head_dim", "syn_seed": "seed",
                    "sink_strength": "sink_strength", "local_strength": "local_strength",
                    "local_width": "local_width", "n_anchors": "n_anchors", "anchor_strength": "anchor_strength",
                    "sparsity": "sparsity", "topic_shift": "topic_shift", "outlier_channels": "outlier_channels",
                    "outlier_scale": "outlier_scale"}


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
    return View(layer=int(v["layer"]), head=int(v["head"]), step=None if step < 0 else step,
                ensemble=resolve_ensemble(v["ensemble"], v["source"]), ensemble_size=int(v["ens_size"]))


# --- the source a link names ---------------------------------------------------------------------

HANDBOOK_QUANT_NOTE = "real K/V quantization of keys realised from the handbook's logits (exact at 16 bits)"


@dataclass(frozen=True, eq=False)
class LinkedSource:
    """The attention source of a link: its trace, the traces of other random seeds, and its names."""

    name: str                                       # one of SOURCE_NAMES
    trace: Trace
    label: str                                      # as the app's caption names it
    trace_for_seed: Callable[[int], Trace] | None = None
    quant_note: str = "real K/V quantization of the cached keys and values"


def source_from_values(v: dict, trace: Trace | None = None) -> LinkedSource:
    """The handbook or synthetic source a link describes; a real model's or a file's trace must be given
    (a link names only how it was captured). SpecError if the link's knobs cannot build it."""
    from kvviz.sources import make_synthetic

    name = v["source"]
    if name == "handbook":
        return LinkedSource(name, handbook.handbook_trace(), "handbook example",
                            lambda r: handbook.handbook_trace(seed=r), HANDBOOK_QUANT_NOTE)
    if name == "synthetic":
        syn = synthetic_from_values(v)
        return LinkedSource(name, make_synthetic(syn), f"synthetic pattern ({syn.context} tokens)",
                            lambda r: make_synthetic(syn.with_(seed=syn.seed + r)))
    if trace is None:
        raise SpecError(f"the link's source is {'a real model' if name == 'real' else 'a trace file'}, whose trace "
                        "is not in the link: give the trace file")
    m = trace.meta
    label = (f"{m['model']}: {m.get('prompt_tokens', trace.context_len)} prompt tokens + {m.get('new_tokens', 0)} "
             "generated" if m.get("model") else f"trace ({trace.n_positions} tokens)")
    return LinkedSource(name, trace, label)
