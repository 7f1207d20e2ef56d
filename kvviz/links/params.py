"""The one table of settings a link may carry: `PARAMS`, every setting's URL name, kind, default and
widest range (the app's own controls, then one per Spec setting, read from kvviz.settings).
`Param.parse` turns a raw query-parameter string into a value (clamped or replaced by the default, with
a notice), `Param.encode` back; `compression_params` are the settings a pinned setting A records."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvviz.policies.registry import featured, followed_while_decoding
from kvviz.sources import handbook
from kvviz.quant.formats import SERVING_FORMATS
from kvviz.quant.integer import BITS_OPTIONS  # the bits slider offers what the integer format does
from kvviz.settings import SETTINGS, Setting
from kvviz.spec import MAX_BUDGET, FULL_BITS, SCORERS


# kvviz.app.labels.SOURCE_LABELS names them
SOURCE_NAMES = ("handbook", "synthetic", "real", "file")
ENSEMBLE_OPTIONS = ("auto", "none", "heads", "layers", "steps", "seeds")
MAX_TOKENS = 32768 + 512
# an upper bound this large (the budgets' own, and the seeds' and steps') only keeps absurd links out:
# a notice gives no such range, only "at least"
OPEN_ENDED = MAX_BUDGET


class LiveChoices:
    """Choices known only when asked (a sequence): the scorers grow when plug-ins load, ChunkKV's inner
    scorers are the registry's chunkable ones."""

    def __init__(self, names: Callable[[], tuple]):
        self._fn = names

    def _names(self) -> tuple:
        return tuple(self._fn())

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, x):
        return x in self._names()

    def __len__(self):
        return len(self._names())

    def __getitem__(self, i):
        return self._names()[i]


def _scorer_names() -> tuple:
    """Built-ins, then installed plug-ins (entry-point group kvviz.policies), loaded first."""
    from kvviz.policies.registry import load_entry_points
    from kvviz.spec import scorer_names

    load_entry_points()
    return scorer_names()


SCORER_CHOICES = LiveChoices(_scorer_names)


# --- parameters ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One control: its URL name, kind, default and the widest range any source allows."""

    name: str
    kind: str  # int | float | choice | bool | list | text
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    setting: str = ""  # the Spec setting it carries (kvviz.settings), if any

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
            return self.default, (f"{label} is not one of {', '.join(map(str, self.choices))}; using {self.default}.")
        if self.kind == "list":
            items = [s for s in raw.split(",") if s.strip()]
            by_text = {str(c): c for c in self.choices}
            # in the link's order, as the widget had them (so the link reads back as it was written)
            known = list(dict.fromkeys(by_text[s.strip()] for s in items if s.strip() in by_text))
            bad = [s for s in items if s.strip() not in by_text]
            note = (
                f"{label}: ignored {', '.join(bad)} (not one of {', '.join(map(str, self.choices))})." if bad else None
            )
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
            allowed = (
                f"at least {number_text(self.lo)}"
                if x < self.lo and self.hi >= OPEN_ENDED
                else f"{number_text(self.lo)}-{number_text(self.hi)}"
            )
            return (clamped, f"{label} is out of range ({allowed}); clamped to {number_text(clamped)}.")
        return x, None

    def encode(self, value: Any) -> str:
        if self.kind == "bool":
            return "1" if value else "0"
        if self.kind == "list":
            return ",".join(map(str, value))
        if self.kind == "text":
            return str(value)
        return number_text(value) if self.kind == "float" else str(value)


def number_text(x) -> str:
    """A number as a link and a notice write it: 0.35, 1e+06, 42 (the app's notices use it too)."""
    return f"{x:g}" if isinstance(x, float) else str(x)


_PARAMS = [
    Param("source", "choice", "handbook", choices=SOURCE_NAMES),
    # synthetic pattern knobs (kvviz.sources.synthetic.SyntheticSpec)
    Param("context", "int", 512, 8, 32768),
    Param("steps", "int", 32, 0, 512),
    Param("layers", "int", 2, 1, 32),
    Param("q_heads", "int", 4, 1, 32),
    Param("kv_heads", "int", 2, 1, 32),
    Param("head_dim", "choice", 64, choices=(32, 64, 128)),
    Param("syn_seed", "int", 0, 0, OPEN_ENDED),
    Param("sink_strength", "float", 11.0, 0.0, 30.0),
    Param("local_strength", "float", 5.0, 0.0, 30.0),
    Param("local_width", "float", 8.0, 0.5, 512.0),
    Param("n_anchors", "int", 6, 0, 64),
    Param("anchor_strength", "float", 4.0, 0.0, 30.0),
    Param("sparsity", "float", 2.0, 0.0, 10.0),
    Param("topic_shift", "float", 0.0, 0.0, 30.0),
    Param("outlier_channels", "int", 4, 0, 16),
    Param("outlier_scale", "float", 12.0, 0.0, 100.0),
    # compression: the budget unit and the bits slider (the Spec settings follow, from kvviz.settings)
    Param("budget_unit", "choice", "tokens", choices=("tokens", "%")),
    Param("bits", "choice", FULL_BITS, choices=BITS_OPTIONS),
    Param("split", "bool", False),
    # view
    Param("layer", "int", 0, 0, 1023),
    Param("head", "int", 0, 0, 1023),
    Param("step", "int", -1, -1, OPEN_ENDED),
    Param("ensemble", "choice", "auto", choices=ENSEMBLE_OPTIONS),
    Param("ens_size", "int", 8, 2, 32),
    Param("bars", "choice", "std", choices=("std", "ci95", "range")),
    # explorer: a pinned setting A, a locked y-axis, the target solver, presentation mode
    Param("pin", "text", ""),
    Param("ylock", "float", 0.0, -1.0, 1.0),
    # the attention chart's locked top (0: automatic); ylock: the error chart's ±range, 0 automatic (locked at
    # the first view in Presentation mode), -1 unlocked by choice
    Param("alock", "float", 0.0, 0.0, 1.0),
    Param("solve_kind", "choice", "mass", choices=("mass", "tv")),
    Param("solve_target", "float", 0.95, 0.001, 1.0),
    Param("present", "bool", False),
    Param("grid_shade", "choice", "reason", choices=("reason", "attention", "error")),
    # the charts' token range (zoom_to -1: the row's last token) and the token grid's page (-1: the last)
    Param("zoom_from", "int", 0, 0, 10_000_000),
    Param("zoom_to", "int", -1, -1, 10_000_000),
    Param("grid_page", "int", -1, -1, 10_000_000),
    # trade-offs page
    Param("metric", "choice", "tv", choices=("tv", "kl", "js", "mass", "output_error")),
    Param("logx", "bool", True),  # a log memory axis: the bit widths' curves apart, not tangled at the left
    Param("methods", "list", featured(), choices=SCORER_CHOICES),
    Param("sweep_bits", "list", (16, 4, 2), choices=(16, 8, 4, 3, 2)),
    # the quantizers' serving formats (kvviz.quant.formats), a new one included
    Param("sweep_formats", "list", (), choices=SERVING_FORMATS),
    # concentration page
    Param("window", "int", 16, 1, 4096),
    # decode timeline page
    Param("tl_layer", "int", 0, 0, 1023),
    Param("tl_kv_head", "int", 0, 0, 1023),
    Param("tl_policies", "list", followed_while_decoding(), choices=SCORERS),
    Param("tl_need", "float", 0.02, 0.001, 1.0),
    Param("tl_step", "int", 0, 0, OPEN_ENDED),
    # model lab page
    Param("lab_text", "choice", "sample", choices=("sample", "bakery", "custom")),
    Param("lab_prompt", "int", 206, 8, 512),
    Param("lab_cont", "int", 57, 2, 128),
    Param("lab_greedy", "int", 32, 0, 64),
    Param("lab_rerotate", "bool", False),
    # the weights' dtype, which the cache keeps (the device is not in a link: another machine may lack it)
    Param("lab_dtype", "choice", "float32", choices=("float32", "bfloat16", "float16")),
    # a question after the prompt (empty = none) and where the cache is compressed around it
    # (kvviz.decode.quality.QUESTION_POINTS; before it is kvpress's pipeline default)
    Param("lab_question", "text", ""),
    Param("lab_point", "choice", "before-question", choices=("before-question", "after-question")),
    # needle test page: the open cell ("scorer:length:depth", empty = the classic failure) and
    # its layer / KV head (-1 = where the full model wanted the needle most)
    Param("nd_cell", "text", ""),
    Param("nd_layer", "int", -1, -1, 1023),
    Param("nd_head", "int", -1, -1, 1023),
    # studies page: the open study (a folder under the studies root) and its measure
    Param("study", "text", ""),
    Param("st_metric", "text", ""),
    # real model source
    Param("rm_text", "choice", "bakery", choices=("bakery", "sample", "custom")),
    Param("rm_new", "int", 16, 0, 64),
    Param("rm_max", "int", 1024, 16, 4096),
    Param("rm_kvzip", "bool", False),  # KVzip's reconstruction pass with the capture
]
# Where a link opens differently from Spec(): the handbook's budgets, and short trailing groups quantized (KIVI
# keeps them at 16 bits until they fill: on the handbook example the 14 kept tokens fill no per-channel key
# group of 32, and the bits slider would reach nothing)
LINK_DEFAULTS = {"sink": handbook.SINK, "recent": handbook.RECENT, "heavy": handbook.HEAVY, "partial": "quantize"}
# Spec settings a link never carries: the random draws' seed (the sources have their own), and the real-model
# decode's key positions (the Model lab's own `lab_rerotate`)
NOT_IN_LINKS = frozenset({"seed", "positions"})


def setting_param(s: Setting) -> Param:
    """The link parameter of a Spec setting: its link name, kind, default and range, from its declaration."""
    default = LINK_DEFAULTS.get(s.name, s.default)
    if s.options:
        return Param(s.url_name, "choice", default, choices=s.options, setting=s.name)
    if s.kind == "choice":
        choices = (
            SCORER_CHOICES
            if s.name == "scorer"
            else (LiveChoices(s.choices) if callable(s.choices) else tuple(s.choices))
        )
        return Param(s.url_name, "choice", default, choices=choices, setting=s.name)
    if s.kind == "bool":
        return Param(s.url_name, "bool", default, setting=s.name)
    if s.default is None:  # None is written as `none_as` (SnapKV's window: 0 = automatic)
        return Param(s.url_name, s.kind, s.none_as, s.none_as, s.hi, setting=s.name)
    return Param(s.url_name, s.kind, default, s.lo, s.hi, setting=s.name)


def _setting_params() -> list[Param]:
    return [setting_param(s) for s in SETTINGS.values() if s.name not in NOT_IN_LINKS]


def _synced(read):
    """A dict method of _Params that first brings the table up to date with SETTINGS (`_sync`)."""

    def method(self, *args):
        self._sync()
        return read(self, *args)

    method.__name__ = read.__name__
    return method


class _Params(dict):
    """Every link parameter by name: the app's own, then one per Spec setting (a setting declared later, by a
    plug-in, joins the next time the table is read)."""

    def __init__(self, own: dict):
        super().__init__(own)
        self._seen = -1

    def _sync(self) -> None:
        if self._seen == len(SETTINGS):
            return
        for name in [n for n, p in dict.items(self) if p.setting and p.setting not in SETTINGS]:
            dict.__delitem__(self, name)  # a setting withdrawn (a test's plug-in, unloaded)
        for p in _setting_params():
            taken = dict.get(self, p.name)
            if taken is not None and taken.setting != p.setting:
                raise ValueError(f"setting {p.setting!r}: link name {p.name!r} is already the app's {taken.name!r}")
            dict.__setitem__(self, p.name, p)
        self._seen = len(SETTINGS)

    # every read brings the table up to date first
    __getitem__ = _synced(dict.__getitem__)
    __contains__ = _synced(dict.__contains__)
    __iter__ = _synced(dict.__iter__)
    __len__ = _synced(dict.__len__)
    items = _synced(dict.items)
    values = _synced(dict.values)
    keys = _synced(dict.keys)
    get = _synced(dict.get)


PARAMS: dict[str, Param] = _Params({p.name: p for p in _PARAMS})


def compression_params() -> tuple[str, ...]:
    """The settings a pinned setting A records: the bits slider, then every Spec setting a link carries."""
    return ("bits", "split", *(s.url_name for s in SETTINGS.values() if s.name not in NOT_IN_LINKS))
