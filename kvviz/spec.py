"""What the sliders set: a compression spec, and which rows to look at."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

SCORERS = ("h2o", "tova", "snapkv", "streaming", "oracle", "knorm", "random",
           "expected_attention", "keydiff", "chunkkv", "quest")
PLUGIN_SCORERS: list[str] = []        # names registered by plug-ins (kvviz.policies.registry), appended at load time
ALLOCATIONS = ("uniform", "adakv", "pyramid")   # how the heavy budget is spread over KV heads and layers
ADAKV_FLOORS = ("all", "outside-window")   # AdaKV safeguard: over all of a head's ranked tokens (kvpress), or heavy only
PYRAMID_SCHEDULES = ("kvpress", "heavy")     # PyramidKV: kvpress's per-layer totals, or kvviz's heavy-only slope
CHUNK_RULES = ("chunks", "budget")           # ChunkKV: kvpress's whole-chunk count, or fill the heavy budget
QUEST_HEADS = ("query", "kv")                # Quest: pages per query head (the paper), or per KV head (group max)
CHUNK_INNER = ("snapkv", "expected_attention", "keydiff", "knorm", "h2o", "random")  # ChunkKV's token scorer
AXES = ("channel", "token")
QUANT_MODELS = ("kv", "noise")
ZERO_POINTS = ("float", "int")        # KIVI's float offset x_hat = q*s + min, or an integer zero point
PARTIAL_GROUPS = ("full", "quantize")  # a trailing group shorter than G: kept at 16 bits (KIVI) or quantized
POSITIONS = ("true", "cache")         # real-model decode: keys at their true positions, or re-rotated to slots
SNAPKV_MAX_WINDOW = 64                # SnapKV's observation window (Li et al. 2024; kvpress window_size)
ENSEMBLES = ("heads", "layers", "steps", "seeds")
FULL_BITS = 16  # 16 bits = not quantized (the fp16 baseline)
FORMATS = ("int", "e4m3", "e5m2", "nvfp4", "mxfp4")   # cache formats (kvviz.quant.formats)
FP8_SCALES = ("tensor", "head", "token")          # FP8 scale granularity
ROTATIONS = ("none", "keys", "keys-values")       # Hadamard rotation before quantization (queries follow keys)
RESIDUAL_MODES = ("kivi", "hf")                   # sliding full-precision window, or HF QuantizedCache's flush
MAX_ENSEMBLE = 256
# The Spec fields that only say how kept keys and values are quantized (never what is kept): the one list
# Spec.eviction_key leaves out. A field missing here costs a cache miss, never a stale kept set.
QUANT_FIELDS = frozenset({"key_bits", "value_bits", "key_axis", "value_axis", "group_size", "residual",
                          "symmetric", "zero_point", "partial", "quant_model", "noise_sigma", "key_format",
                          "value_format", "fp8_scale", "rotate", "residual_mode"})


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
    zero_point: str = "float"      # asymmetric: "float" offset (KIVI) or "int" zero point (integer kernels)
    partial: str = "full"          # trailing groups shorter than group_size: "full" precision (KIVI) or "quantize"
    quant_model: str = "kv"        # "kv" = real K/V quantization, "noise" = logit noise
    noise_sigma: float = 0.01     # the handbook's sigma; used only by the noise model
    seed: int = 0                  # random scorer and noise draws
    snapkv_window: int | None = None  # observation window; None = the recent window, capped at 64
    snapkv_kernel: int = 5
    h2o_normalized: bool = False   # H2O: accumulated attention / number of queries that saw the token
    positions: str = "true"        # real-model decode only: "cache" re-rotates keys to their cache slots
    key_format: str = "int"        # "int" = integer groups at key_bits; e4m3 / e5m2 (FP8), nvfp4, mxfp4
    value_format: str = "int"
    fp8_scale: str = "head"        # FP8 scales: one per "tensor" (layer), KV "head", or "token"
    rotate: str = "none"           # Hadamard-rotate "keys" (and queries) or "keys-values" before quantizing
    residual_mode: str = "kivi"    # "kivi": the last `residual` tokens exact; "hf": QuantizedCache's flush
    allocation: str = "uniform"    # heavy budget over heads / layers: uniform, adakv (per layer, across heads), pyramid
    adakv_alpha: float = 0.2       # AdaKV safeguard: each KV head keeps at least floor(alpha * budget) tokens
    adakv_floor: str = "all"       # "all": the safeguard is the head's top floor(alpha * budget), sinks and window
                                   # first (kvpress); "outside-window": floor(alpha * heavy) heavy hitters (kvviz < #24)
    pyramid_beta: float = 20.0     # PyramidKV: the steepness (kvpress beta 20; 1 = flat)
    pyramid_schedule: str = "kvpress"  # "kvpress": layer totals as PyramidKVPress; "heavy": the heavy part sloped
    ea_horizon: int = 512          # Expected Attention: future positions the query statistics are rotated over
    ea_covariance: bool = True     # Expected Attention: use the queries' covariance as well as their mean
    chunk_size: int = 20           # ChunkKV: tokens per chunk (kvpress chunk_length 20)
    chunk_scorer: str = "snapkv"   # ChunkKV: the token scorer whose scores are pooled per chunk
    chunk_rule: str = "chunks"     # "chunks": kvpress's count of whole chunks; "budget": chunks fill the budget
    page_size: int = 16            # Quest: tokens per page (Quest's default page size 16)
    quest_heads: str = "query"     # Quest: "query": each query head reads its own pages (the paper); "kv": per KV head

    def __post_init__(self) -> None:
        check_spec(self)

    @property
    def evicts(self) -> bool:
        return self.sink + self.recent + self.heavy > 0

    @property
    def eviction_key(self) -> tuple:
        """What decides what is kept: every field but those that only quantize (eviction comes first, so
        quantization never changes it). Derived, not listed: a new eviction setting is in it by default."""
        if not self.evicts:
            return ()
        return tuple(getattr(self, f.name) for f in fields(self) if f.name not in QUANT_FIELDS)

    @property
    def observation_window(self) -> int:
        """SnapKV's voters: the last this-many context queries. Always inside the recent window,
        so the window is kept and every heavy slot goes to a voted token before it."""
        if self.snapkv_window is not None:
            return self.snapkv_window
        return min(self.recent, SNAPKV_MAX_WINDOW)

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
        return replace(self, **changes)

    def label(self) -> str:
        parts = []
        if self.evicts:
            scorer = "h2o (mean over the queries that saw each token)" if self.scorer == "h2o" and \
                self.h2o_normalized else self.scorer
            if self.scorer == "chunkkv":
                scorer = f"chunkkv ({self.chunk_scorer}, chunks of {self.chunk_size})"
            elif self.scorer == "quest":
                scorer = f"quest (pages of {self.page_size}, cache kept whole)"
            if self.allocation == "adakv":
                scorer = f"adakv-{scorer} (alpha {self.adakv_alpha:g})"
            elif self.allocation == "pyramid":
                scorer = f"pyramid-{scorer} (beta {self.pyramid_beta:g})"
            parts.append(f"{scorer} sink {self.sink} recent {self.recent} heavy {self.heavy}")
        if self.quant_model == "noise" and self.noise_sigma > 0:
            parts.append(f"logit noise sigma {self.noise_sigma:g}")
        elif self.quant_model == "kv" and self.quantizes:
            if self.key_format == "int" and self.value_format == "int":
                parts.append(f"K{self.key_bits}/V{self.value_bits}-bit")
            else:
                parts.append(f"K {_format_label(self.key_format, self.key_bits)} / "
                             f"V {_format_label(self.value_format, self.value_bits)}")
                if "e4m3" in (self.key_format, self.value_format) or "e5m2" in (self.key_format, self.value_format):
                    parts.append(f"FP8 scale per {self.fp8_scale}")
            if self.rotate != "none":
                parts.append("Hadamard-rotated " + ("keys" if self.rotate == "keys" else "keys and values"))
            if self.residual_mode == "hf":
                parts.append(f"HF QuantizedCache residual {self.residual}")
            if self.zero_point == "int" and not self.symmetric:
                parts.append("integer zero point")
        if self.positions == "cache":
            parts.append("keys re-rotated to cache slots")
        return ", ".join(parts) or "no compression"


def _format_label(fmt: str, bits: int) -> str:
    if fmt == "int":
        return "16-bit" if bits >= FULL_BITS else f"{bits}-bit int"
    return {"e4m3": "FP8 E4M3", "e5m2": "FP8 E5M2", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}[fmt]


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
    if s.scorer not in SCORERS and s.scorer not in PLUGIN_SCORERS and s.scorer not in installed_plugin_names():
        raise SpecError(f"unknown scorer {s.scorer!r}; choose one of {', '.join(scorer_names())}")
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
    for name, allowed in (("zero_point", ZERO_POINTS), ("partial", PARTIAL_GROUPS), ("positions", POSITIONS),
                          ("key_format", FORMATS), ("value_format", FORMATS), ("fp8_scale", FP8_SCALES),
                          ("rotate", ROTATIONS), ("residual_mode", RESIDUAL_MODES),
                          ("adakv_floor", ADAKV_FLOORS), ("pyramid_schedule", PYRAMID_SCHEDULES),
                          ("chunk_rule", CHUNK_RULES), ("quest_heads", QUEST_HEADS)):
        if getattr(s, name) not in allowed:
            raise SpecError(f"{name} must be one of {', '.join(allowed)}, got {getattr(s, name)!r}")
    if s.snapkv_kernel < 1 or s.snapkv_kernel % 2 == 0:
        raise SpecError(f"the SnapKV pooling kernel must be an odd number >= 1, got {s.snapkv_kernel}")
    if s.snapkv_window is not None and s.snapkv_window < 1:
        raise SpecError(f"the SnapKV observation window must be at least 1 query, got {s.snapkv_window}")
    check_new_fields(s)
    if (s.scorer == "snapkv" or (s.scorer == "chunkkv" and s.chunk_scorer == "snapkv")) and s.evicts:
        if s.recent < 1:
            raise SpecError("SnapKV needs a recent window of at least 1 token: its observation window (the last "
                            "context queries, which vote) is always kept, as part of the recent window")
        if s.observation_window > s.recent:
            raise SpecError(f"the SnapKV observation window ({s.observation_window}) must fit inside the recent "
                            f"window ({s.recent}): the window is always kept. Raise the recent window to "
                            f"{s.observation_window} or shrink the observation window")


def installed_plugin_names() -> frozenset[str]:
    """Names of the installed plug-in scorers (entry-point group `kvviz.policies`), read from the
    package metadata without loading their code: the registry (kvviz.policies.registry) loads
    them when one is first used, so a spec can name a plug-in kvviz has not loaded yet."""
    from importlib.metadata import entry_points
    return frozenset(ep.name for ep in entry_points(group="kvviz.policies"))


def scorer_names() -> tuple[str, ...]:
    """Built-in scorers, then the ones plug-ins registered."""
    return SCORERS + tuple(n for n in PLUGIN_SCORERS if n not in SCORERS)


STREAMING_SCORERS = ("h2o", "tova")   # decide again at every step


def check_new_fields(s: Spec) -> None:
    """Allocation, Expected Attention, ChunkKV and Quest settings (issue #12)."""
    if s.allocation not in ALLOCATIONS:
        raise SpecError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {s.allocation!r}")
    if not 0.0 <= s.adakv_alpha <= 1.0 or s.adakv_alpha != s.adakv_alpha:
        raise SpecError(f"the AdaKV safeguard alpha must be between 0 and 1, got {s.adakv_alpha}")
    if not s.pyramid_beta >= 1.0 or s.pyramid_beta > 1e6:
        raise SpecError(f"the PyramidKV beta must be at least 1 (1 = flat), got {s.pyramid_beta}")
    if not 1 <= s.ea_horizon <= 1_000_000:
        raise SpecError(f"the Expected Attention horizon must be 1 to 1,000,000 future positions, got {s.ea_horizon}")
    if not 1 <= s.chunk_size <= 4096:
        raise SpecError(f"the ChunkKV chunk size must be 1-4096 tokens, got {s.chunk_size}")
    if s.chunk_scorer not in CHUNK_INNER:
        raise SpecError(f"ChunkKV pools one-shot token scores: chunk scorer must be one of {', '.join(CHUNK_INNER)}, "
                        f"got {s.chunk_scorer!r}")
    if not 1 <= s.page_size <= 4096:
        raise SpecError(f"the Quest page size must be 1-4096 tokens, got {s.page_size}")
    if s.allocation == "adakv" and s.evicts and s.scorer in STREAMING_SCORERS:
        raise SpecError(f"AdaKV spreads one layer budget over the KV heads once, at the compression point, from "
                        f"one-shot scores (kvpress: a ScorerPress); {s.scorer} decides again at every step. Use "
                        f"snapkv, expected_attention, keydiff, knorm or the oracle, or allocation "
                        f"uniform / pyramid")
    if s.allocation == "adakv" and s.evicts and s.scorer == "chunkkv":
        raise SpecError("ChunkKV keeps the same chunks in every KV head, so there is nothing for AdaKV to spread "
                        "over heads: use allocation uniform or pyramid")
    if s.allocation == "adakv" and s.evicts and s.quantizes and (
            s.key_format != "int" or s.value_format != "int" or s.rotate != "none" or s.residual_mode != "kivi"):
        raise SpecError("AdaKV's per-head caches have different lengths; the FP8 / FP4 formats, rotation and HF's "
                        "residual flush quantize a layer's heads together and need equal lengths. Use the integer "
                        "format with AdaKV, or allocation uniform / pyramid with these formats")
    if s.scorer == "quest" and s.quest_heads == "query" and s.evicts and s.quantizes and s.quant_model == "kv" and (
            s.key_format != "int" or s.value_format != "int" or s.rotate != "none" or s.residual_mode != "kivi"):
        raise SpecError("Quest per query head reads a different number of tokens through each KV head; the FP8 / "
                        "FP4 formats, rotation and HF's residual flush quantize a layer's heads together and need "
                        "equal lengths. Use the integer format, or Quest per KV head (quest_heads 'kv')")


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
