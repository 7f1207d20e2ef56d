"""What the sliders set: a compression spec, and which rows to look at."""

from __future__ import annotations

from dataclasses import dataclass, replace

SCORERS = ("h2o", "tova", "snapkv", "streaming", "oracle", "knorm", "random")
AXES = ("channel", "token")
QUANT_MODELS = ("kv", "noise")
ENSEMBLES = ("heads", "layers", "steps", "seeds")
FULL_BITS = 16  # 16 bits = not quantized (the fp16 baseline)
MAX_ENSEMBLE = 256


class SpecError(ValueError):
    """An impossible setting; the message says what to change."""


@dataclass(frozen=True)
class Spec:
    """A compression configuration: eviction budgets, scorer and quantization.

    Eviction is off when sink, recent and heavy are all zero. Bits of 16 mean the
    keys / values are kept at full precision.
    """

    sink: int = 0
    recent: int = 0
    heavy: int = 0
    scorer: str = "h2o"
    key_bits: int = FULL_BITS
    value_bits: int = FULL_BITS
    key_axis: str = "channel"      # KIVI: keys per channel
    value_axis: str = "token"      # KIVI: values per token
    group_size: int = 32
    residual: int = 0              # last tokens kept at full precision (KIVI: 128)
    symmetric: bool = False
    quant_model: str = "kv"        # "kv" = real K/V quantization, "noise" = logit noise
    noise_sigma: float = 0.01     # the handbook's sigma; used only by the noise model
    seed: int = 0                  # random scorer and noise draws
    snapkv_window: int = 64
    snapkv_kernel: int = 5

    def __post_init__(self) -> None:
        check_spec(self)

    @property
    def evicts(self) -> bool:
        return self.sink + self.recent + self.heavy > 0

    @property
    def eviction_key(self) -> tuple:
        """The fields that decide what is kept (quantization never changes it)."""
        return (self.sink, self.recent, self.heavy, self.scorer, self.seed, self.snapkv_window,
                self.snapkv_kernel) if self.evicts else ()

    @property
    def budget(self) -> int:
        return self.sink + self.recent + self.heavy

    @property
    def quantizes(self) -> bool:
        if self.quant_model == "noise":
            return self.noise_sigma > 0
        return self.key_bits < FULL_BITS or self.value_bits < FULL_BITS

    def with_(self, **changes) -> "Spec":
        return replace(self, **changes)

    def label(self) -> str:
        parts = []
        if self.evicts:
            parts.append(f"{self.scorer} sink {self.sink} recent {self.recent} heavy {self.heavy}")
        if self.quant_model == "noise" and self.noise_sigma > 0:
            parts.append(f"logit noise sigma {self.noise_sigma:g}")
        elif self.quant_model == "kv" and self.quantizes:
            parts.append(f"K{self.key_bits}/V{self.value_bits}-bit")
        return ", ".join(parts) or "no compression"


def check_bits(bits: int, symmetric: bool, what: str) -> None:
    if bits == FULL_BITS:
        return
    low = 2 if symmetric else 1
    if not low <= bits <= 8:
        raise SpecError(f"{what} bits must be {low}-8 (or 16 for no quantization), got {bits}"
                        + (" — symmetric quantization needs at least 2 bits" if symmetric and bits == 1 else ""))


def check_spec(s: Spec) -> None:
    for name in ("sink", "recent", "heavy", "residual"):
        if getattr(s, name) < 0:
            raise SpecError(f"{name} must be 0 or more, got {getattr(s, name)}")
    if s.scorer not in SCORERS:
        raise SpecError(f"unknown scorer {s.scorer!r}; choose one of {', '.join(SCORERS)}")
    check_bits(s.key_bits, s.symmetric, "key")
    check_bits(s.value_bits, s.symmetric, "value")
    for name in ("key_axis", "value_axis"):
        if getattr(s, name) not in AXES:
            raise SpecError(f"{name} must be 'channel' or 'token', got {getattr(s, name)!r}")
    if s.group_size < 1:
        raise SpecError(f"group size must be at least 1, got {s.group_size}")
    if s.quant_model not in QUANT_MODELS:
        raise SpecError(f"quantization model must be 'kv' or 'noise', got {s.quant_model!r}")
    if not (s.noise_sigma >= 0) or s.noise_sigma != s.noise_sigma or s.noise_sigma > 100:
        raise SpecError(f"noise sigma must be between 0 and 100, got {s.noise_sigma}")
    if s.snapkv_window < 1 or s.snapkv_kernel < 1 or s.snapkv_kernel % 2 == 0:
        raise SpecError("snapkv window must be >= 1 and its pooling kernel an odd number >= 1")


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
