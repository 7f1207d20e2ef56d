"""What the sliders set: a compression spec, and which rows to look at.

A `Spec` is made of settings (kvviz.settings), each declared by the file that owns it: the
budgets and the scorer's name here, a scorer's own settings in its file under kvviz/policies/,
a quantization format's in its file under kvviz/quant/. `Spec(sink=4, page_size=8)` takes
any declared setting as a keyword, checks every value and every rule between them, and is
frozen and hashable (the engine's caches are keyed by it).
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass
from typing import Any

from kvviz.settings import LABELS, RULES, SETTINGS, Setting, declare

# built-in scorers, in menu order (filled by kvviz.policies.registry)
SCORERS: list[str] = []
# names registered by plug-ins (kvviz.policies.registry), appended at load time
PLUGIN_SCORERS: list[str] = []
# scorers that decide again at every step (filled by the registry)
STREAMING_SCORERS: list[str] = []
ENSEMBLES = ("heads", "layers", "steps", "seeds")
FULL_BITS = 16  # 16 bits = not quantized (the fp16 baseline)
MAX_ENSEMBLE = 256
# tokens (the work budget bounds what a request may do with them)
MAX_BUDGET = 1_000_000


class SpecError(ValueError):
    """An impossible setting; the message says what to change."""


def _scorer_problem(name: str) -> str | None:
    if name in SCORERS or name in PLUGIN_SCORERS or name in installed_plugin_names():
        return None
    return f"unknown scorer {name!r}; choose one of {', '.join(scorer_names())}"


declare(
    Setting(
        "sink",
        "int",
        0,
        0,
        MAX_BUDGET,
        label="Sink tokens",
        help="The first tokens, always kept: attention sinks (StreamingLLM keeps 4).",
    ),
    Setting(
        "recent",
        "int",
        0,
        0,
        MAX_BUDGET,
        label="Recent window",
        help="The last tokens the query sees (its own included), always kept.",
    ),
    Setting(
        "heavy",
        "int",
        0,
        0,
        MAX_BUDGET,
        label="Heavy-hitter budget",
        help="How many more tokens the scorer may keep among the rest (H2O's heavy hitters).",
    ),
    # any name: the registry's scorers and plug-ins are checked by _scorer_problem (a plug-in may load later)
    Setting(
        "scorer",
        "choice",
        "h2o",
        choices=lambda: scorer_names(),
        label="Heavy-hitter scorer",
        help="How heavy hitters are ranked.",
    ),
    Setting("seed", "int", 0, 0, 2**32 - 1, label="Seed", help="random draws (noise, random scorer)"),
    Setting(
        "positions",
        "choice",
        "true",
        choices=("true", "cache"),
        cli="-",
        help="real-model decode only: keys at their true positions, or re-rotated to their cache slots",
    ),
    Setting(
        "quant_model",
        "choice",
        "kv",
        choices=("kv", "noise"),
        url="qmodel",
        quantizes=True,
        label="Quantization model",
        option_labels={"kv": "real K/V quantization", "noise": "handbook logit noise"},
        help="kv = real K/V quantization; noise = the handbook's logit-noise model",
    ),
    Setting(
        "noise_sigma",
        "float",
        0.01,
        0.0,
        100.0,
        url="sigma",
        quantizes=True,
        label="Noise σ (logit noise model)",
        help="noise model: logit noise std",
        step=0.005,
        fmt="%.3f",
    ),
)


class Spec:
    """A compression configuration: eviction budgets, scorer and quantization.

    Eviction is off when sink, recent and heavy are all zero. Bits of 16 mean the
    keys / values are kept at full precision. Every declared setting is a keyword and an
    attribute; the value is checked when the Spec is made (SpecError says what to change).
    """

    # the settings live in __dict__ (so `spec.__dict__` is exactly them); the identity below, in a slot
    __slots__ = ("_key", "__dict__")

    def __init__(self, **values: Any) -> None:
        for name in values:
            if name not in SETTINGS:
                raise TypeError(f"Spec() got an unexpected keyword argument {name!r}")
        values = {name: SETTINGS[name].coerce(v) for name, v in values.items()}
        for name, setting in SETTINGS.items():
            object.__setattr__(self, name, values.get(name, setting.default))
        # identity: the settings that differ from their defaults (a setting declared later, by a plug-in,
        # is at its default in every Spec made before it, so equal Specs stay equal)
        object.__setattr__(self, "_key", tuple(sorted((n, v) for n, v in values.items() if v != SETTINGS[n].default)))
        check_spec(self)

    def __getattr__(self, name: str) -> Any:
        setting = SETTINGS.get(name)  # declared after this Spec was made: at its default
        if setting is None:
            raise AttributeError(f"Spec has no setting {name!r}")
        return setting.default

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return "Spec(" + ", ".join(f"{n}={v!r}" for n, v in self._key) + ")"

    def __reduce__(self):
        # (class, no arguments, state): pickles (process pools, Ray) and Streamlit's cache keys alike see
        # only the class's name and the settings that differ from their defaults
        return (Spec, (), dict(self._key))

    def __setstate__(self, values: dict) -> None:
        self.__init__(**values)

    def as_dict(self) -> dict[str, Any]:
        """Every declared setting's value (JSON-ready: the types are int, float, bool, str or None)."""
        return {name: getattr(self, name) for name in SETTINGS}

    @property
    def evicts(self) -> bool:
        return self.sink + self.recent + self.heavy > 0

    @property
    def eviction_key(self) -> tuple:
        """What decides what is kept: every setting but those that only quantize (eviction comes first, so
        quantization never changes it). Derived, not listed: a new eviction setting is in it by default."""
        if not self.evicts:
            return ()
        return tuple(getattr(self, s.name) for s in SETTINGS.values() if not s.quantizes)

    @property
    def budget(self) -> int:
        return self.sink + self.recent + self.heavy

    @property
    def quantizes(self) -> bool:
        if self.quant_model == "noise":
            return self.noise_sigma > 0
        return self.quantizes_keys or self.quantizes_values

    @property
    def quantizes_keys(self) -> bool:
        return self.key_format != "int" or self.key_bits < FULL_BITS

    @property
    def quantizes_values(self) -> bool:
        return self.value_format != "int" or self.value_bits < FULL_BITS

    def with_(self, **changes) -> "Spec":
        return Spec(**{**dict(self._key), **changes})

    def label(self) -> str:
        parts = []
        if self.evicts:
            scorer = LABELS[self.scorer](self) if self.scorer in LABELS else self.scorer
            if self.allocation != "uniform":
                scorer = LABELS["allocation:" + self.allocation](self, scorer)
            parts.append(f"{scorer} sink {self.sink} recent {self.recent} heavy {self.heavy}")
            # what a setting adds to the eviction's label, declared with it (LABELS["+name"])
            parts[-1] += "".join(f(self) for key, f in LABELS.items() if key.startswith("+"))
        if self.quant_model == "noise" and self.noise_sigma > 0:
            parts.append(f"logit noise sigma {self.noise_sigma:g}")
        elif self.quant_model == "kv" and self.quantizes:
            parts.append(LABELS["quantization"](self))
        if self.positions == "cache":
            parts.append("keys re-rotated to cache slots")
        return ", ".join(parts) or "no compression"


def setting_names() -> tuple[str, ...]:
    """Every Spec keyword, in declaration order."""
    return tuple(SETTINGS)


def check_spec(s: Spec) -> None:
    """Every setting's own range, then every rule between settings (kvviz.settings.rule)."""
    problem = _scorer_problem(s.scorer)
    if problem:
        raise SpecError(problem)
    for name, setting in SETTINGS.items():
        if name == "scorer":
            continue
        problem = setting.problem(getattr(s, name))
        if problem:
            raise SpecError(problem)
    for check in RULES:
        check(s)


def installed_plugin_names() -> frozenset[str]:
    """Names of the installed plug-in scorers (entry-point group `kvviz.policies`), read from the
    package metadata without loading their code: the registry (kvviz.policies.registry) loads
    them when one is first used, so a spec can name a plug-in kvviz has not loaded yet."""
    from importlib.metadata import entry_points

    return frozenset(ep.name for ep in entry_points(group="kvviz.policies"))


def scorer_names() -> tuple[str, ...]:
    """Built-in scorers, then the ones plug-ins registered."""
    return tuple(SCORERS) + tuple(n for n in PLUGIN_SCORERS if n not in SCORERS)


@dataclass(frozen=True)
class View:
    """Which attention rows to evaluate: one (layer, query head, query) plus an ensemble.

    `step` indexes the trace's evaluated queries (later queries, or the last context
    query when there are none); None means the last. The ensemble gives the error bars:
    `heads` (query heads of the layer), `layers` (the same head in every layer),
    `steps` (the last evaluated queries up to this one), `seeds` (repeated random draws).
    """

    layer: int = 0
    head: int = 0
    step: int | None = None
    ensemble: str | None = None
    ensemble_size: int = 8

    def __post_init__(self) -> None:
        if self.ensemble is not None and self.ensemble not in ENSEMBLES:
            raise SpecError(f"ensemble must be one of {', '.join(ENSEMBLES)}, got {self.ensemble!r}")
        if not 1 <= self.ensemble_size <= MAX_ENSEMBLE:
            raise SpecError(f"ensemble size must be 1-{MAX_ENSEMBLE}, got {self.ensemble_size}")
