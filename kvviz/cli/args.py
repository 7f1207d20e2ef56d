"""Argument groups and conversions every command shares: source, compression, view; args -> Spec."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from kvviz.sources.synthetic import MAX_CONTEXT, MAX_STEPS
from kvviz.spec import (ADAKV_FLOORS, ALLOCATIONS, AXES, CHUNK_INNER, CHUNK_RULES, ENSEMBLES, FORMATS, FP8_SCALES, FULL_BITS,
                         MAX_ENSEMBLE, PARTIAL_GROUPS, PYRAMID_SCHEDULES, QUANT_MODELS, QUEST_HEADS, RESIDUAL_MODES,
                         ROTATIONS, SCORERS, ZERO_POINTS, Spec)
from kvviz.trace import TraceError

MAX_TOKENS = 1_000_000     # token counts and budgets (the work budget bounds their products)
MAX_SEED = 2**32 - 1
DASH_VALUE = re.compile(r"argument (-[-\w]+(?:/-[-\w]+)*): expected one argument")


class CliError(Exception):
    """A usage problem to report in one line."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one clear line and exit status 2, not a usage dump."""

    argv: list[str] = []          # the command line being parsed (set by kvviz.cli.parser.main)

    def error(self, message: str):
        m = DASH_VALUE.fullmatch(message)
        if m:   # `--budgets -1,abc`: argparse reads a value starting with '-' as another option
            options = m.group(1).split("/")
            at = next((i for i, x in enumerate(self.argv) if x in options), None)
            value = self.argv[at + 1] if at is not None and at + 1 < len(self.argv) else "-1"
            message += f"; a value that starts with '-' must be attached with '=': {options[-1]}={value}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class ProgressLine:
    """One self-overwriting progress line on stderr."""

    def __init__(self, enabled: bool):
        self.enabled, self.last, self.width = enabled, 0.0, 0

    def __call__(self, fraction: float, message: str) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and fraction < 1.0):
            return
        self.last = now
        line = f"[{fraction:4.0%}] {message}"
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = len(line)

    def done(self) -> None:
        if self.enabled and self.width:
            sys.stderr.write("\n")


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def integer(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi], else one line saying the range."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be {lo:,}-{hi:,}, got {value:,}")
        return value
    return parse


def number(lo: float, hi: float, open_low: bool = False):
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with open_low)."""
    def parse(text: str) -> float:
        value = _number(text, float)
        if not (lo < value if open_low else lo <= value) or value > hi:
            raise argparse.ArgumentTypeError(f"must be {'above' if open_low else 'at least'} {lo:g} and at most "
                                             f"{hi:g}, got {value:g}")
        return value
    return parse


def number_list(kind, lo: float, hi: float, example: str, open_low: bool = False):
    """An argparse type: comma-separated numbers, each in range; one line names the first bad one."""
    one = integer(lo, hi) if kind is int else number(lo, hi, open_low)

    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated values like {example}, got {text!r}")
        out = []
        for x in items:
            try:
                out.append(one(x))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{x!r} in {text!r}: {e} (like {example})") from None
        return out
    return parse


_nonneg = integer(0, MAX_TOKENS)


MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 128, 256, 1024   # per knob; the work budget bounds their product


def add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("source")
    g.add_argument("--source", default="handbook", help="handbook, synthetic, or a trace file (.safetensors)")
    g.add_argument("--context", type=integer(8, MAX_CONTEXT), default=512,
                   help=f"synthetic: context tokens (8-{MAX_CONTEXT})")
    g.add_argument("--steps", type=integer(0, MAX_STEPS), default=32, help=f"synthetic: later query steps (0-{MAX_STEPS})")
    g.add_argument("--layers", type=integer(1, MAX_LAYERS), default=2, help=f"synthetic: layers (1-{MAX_LAYERS})")
    g.add_argument("--heads", type=integer(1, MAX_HEADS), default=4, help=f"synthetic: query heads (1-{MAX_HEADS})")
    g.add_argument("--kv-heads", type=integer(1, MAX_HEADS), default=2, help=f"synthetic: KV heads (1-{MAX_HEADS})")
    g.add_argument("--head-dim", type=integer(8, MAX_HEAD_DIM), default=64,
                   help=f"synthetic: head dimension (8-{MAX_HEAD_DIM})")
    g.add_argument("--topic-shift", type=number(0, 1000), default=0.0, help="synthetic: logit boost of late anchors")


def add_compression_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compression (eviction is off unless --sink, --recent or --heavy is given)")
    g.add_argument("--sink", type=_nonneg, default=0, help="attention-sink tokens kept")
    g.add_argument("--recent", type=_nonneg, default=0, help="recent-window tokens kept")
    g.add_argument("--heavy", type=_nonneg, default=0, help="heavy-hitter budget")
    g.add_argument("--scorer", default=None, metavar="SCORER",
                   help=f"how heavy hitters are ranked: {', '.join(SCORERS)}, or an installed plug-in "
                        "(default h2o; with --policy, the plug-in)")
    g.add_argument("--policy", default=None, metavar="FILE.py:NAME",
                   help="your own scorer: a Policy subclass or score(ctx) function in a Python file "
                        "(docs/plugins.md); it becomes --scorer unless --scorer is given")
    g.add_argument("--allocation", default="uniform", choices=ALLOCATIONS,
                   help="heavy budget over heads and layers: uniform; adakv (one budget per layer, top scores "
                        "across its KV heads, each head first its top alpha x budget); pyramid (layer budgets "
                        "falling linearly, as kvpress's PyramidKVPress)")
    g.add_argument("--adakv-alpha", type=number(0, 1), default=0.2, help="AdaKV safeguard alpha (kvpress 0.2)")
    g.add_argument("--adakv-floor", default="all", choices=ADAKV_FLOORS,
                   help="AdaKV safeguard: all = each head's top alpha x budget tokens, sinks and window first "
                        "(kvpress); outside-window = alpha x heavy heavy hitters beside them (kvviz before #24)")
    g.add_argument("--pyramid-beta", type=number(1, 1e6), default=20.0,
                   help="PyramidKV steepness (kvpress 20; 1 = flat)")
    g.add_argument("--pyramid-schedule", default="kvpress", choices=PYRAMID_SCHEDULES,
                   help="PyramidKV: kvpress = layer totals as PyramidKVPress.get_layer_budget; heavy = the heavy "
                        "part alone from 2h - h/beta down to h/beta, same total (kvviz before #24)")
    g.add_argument("--ea-horizon", type=integer(1, 1_000_000), default=512,
                   help="Expected Attention: future positions the query statistics are rotated over (kvpress 512)")
    g.add_argument("--ea-no-covariance", action="store_true",
                   help="Expected Attention: the queries' mean only, no covariance")
    g.add_argument("--chunk-size", type=integer(1, 4096), default=20, help="ChunkKV: tokens per chunk (kvpress 20)")
    g.add_argument("--chunk-scorer", default="snapkv", choices=CHUNK_INNER,
                   help="ChunkKV: the token scorer pooled per chunk")
    g.add_argument("--chunk-rule", default="chunks", choices=CHUNK_RULES,
                   help="ChunkKV: chunks = kvpress's count of whole chunks (the cache may hold fewer tokens than the "
                        "budget); budget = chunks fill the heavy budget beside sinks and window (kvviz before #24)")
    g.add_argument("--page-size", type=integer(1, 4096), default=16, help="Quest: tokens per page (Quest 16)")
    g.add_argument("--quest-heads", default="query", choices=QUEST_HEADS,
                   help="Quest: query = each query head reads its own top pages (the paper); kv = one page choice "
                        "per KV head by its group's largest bound (kvviz before #24)")
    g.add_argument("--bits", type=integer(1, FULL_BITS), help="key and value bits (1-8; 16 = off)")
    g.add_argument("--key-bits", type=integer(1, FULL_BITS), help="key bits (overrides --bits)")
    g.add_argument("--value-bits", type=integer(1, FULL_BITS), help="value bits (overrides --bits)")
    g.add_argument("--key-axis", default="channel", choices=AXES)
    g.add_argument("--value-axis", default="token", choices=AXES)
    g.add_argument("--group-size", type=integer(1, 4096), default=32)
    g.add_argument("--residual", type=_nonneg, default=0, help="recent tokens kept in full precision")
    g.add_argument("--symmetric", action="store_true", help="symmetric quantization (no zero point)")
    g.add_argument("--zero-point", default="float", choices=ZERO_POINTS,
                   help="asymmetric groups: KIVI's float offset x_hat = q*s + min (float, default) or an "
                        "integer zero point x_hat = s*(q - z) as integer kernels store it (int)")
    g.add_argument("--partial-groups", default="full", choices=PARTIAL_GROUPS,
                   help="a trailing group shorter than --group-size: kept at 16 bits as KIVI does (full, "
                        "default) or quantized as a short group (quantize)")
    g.add_argument("--snapkv-window", type=integer(0, 4096), default=0,
                   help="SnapKV observation window in queries (0 = the recent window, capped at 64); "
                        "must fit inside --recent, which keeps it")
    g.add_argument("--h2o-normalized", action="store_true",
                   help="H2O: divide each token's accumulated attention by the number of queries that saw it "
                        "(kvpress's observed-attention form)")
    g.add_argument("--rerotate", action="store_true",
                   help="real-model decode (eval): re-rotate kept keys to their cache slots as the original "
                        "StreamingLLM does, instead of keeping their true positions")
    g.add_argument("--key-format", default="int", choices=FORMATS,
                   help="key cache format: int = integer groups at --key-bits (KIVI, default); e4m3 / e5m2 = FP8 "
                        "with FP32 scales (--fp8-scale); nvfp4 = E2M1 blocks of 16 + E4M3 block scale + FP32 tensor "
                        "scale; mxfp4 = E2M1 blocks of 32 + power-of-two scale")
    g.add_argument("--value-format", default="int", choices=FORMATS, help="value cache format (as --key-format)")
    g.add_argument("--fp8-scale", default="head", choices=FP8_SCALES,
                   help="FP8 scale granularity: one per layer tensor, per KV head (default) or per token")
    g.add_argument("--rotate", default="none", choices=ROTATIONS,
                   help="Hadamard-rotate the head dimension before quantizing: keys (and queries, so q.k is "
                        "unchanged) or keys-values (values rotated back on the output)")
    g.add_argument("--residual-mode", default="kivi", choices=RESIDUAL_MODES,
                   help="which tokens --residual keeps exact: kivi = the last N (sliding, default); hf = "
                        "transformers' QuantizedCache (prompt quantized whole, a window flushed every N tokens)")
    g.add_argument("--quant-preset", choices=("hf-qc-4bit", "hf-qc-2bit"),
                   help="transformers' QuantizedCache defaults (quanto: per-token groups of 64 on K and V, "
                        "residual_length 128, flushed) at 4 or 2 bits; overrides the bits/axis/group/residual options")
    g.add_argument("--quant-model", default="kv", choices=QUANT_MODELS,
                   help="kv = real K/V quantization; noise = the handbook's logit-noise model")
    g.add_argument("--noise-sigma", type=number(0, 100), default=0.01, help="noise model: logit noise std")
    g.add_argument("--seed", type=integer(0, MAX_SEED), default=0,
                   help="random draws (noise, random scorer, synthetic source)")


def scorer_from_args(a: argparse.Namespace) -> str:
    """--scorer, else the --policy plug-in's name, else h2o; loads the --policy file once."""
    plugin = None
    if getattr(a, "policy", None):
        from kvviz.policies.registry import load_file
        if getattr(a, "_plugin", None) is None:
            a._plugin = load_file(a.policy)
        plugin = a._plugin.name
    return a.scorer or plugin or "h2o"


def spec_from_args(a: argparse.Namespace) -> Spec:
    bits = FULL_BITS if a.bits is None else a.bits
    fields = dict(sink=a.sink, recent=a.recent, heavy=a.heavy, scorer=scorer_from_args(a),
                  allocation=a.allocation, adakv_alpha=a.adakv_alpha, pyramid_beta=a.pyramid_beta,
                  ea_horizon=a.ea_horizon, ea_covariance=not a.ea_no_covariance, chunk_size=a.chunk_size,
                  chunk_scorer=a.chunk_scorer, page_size=a.page_size, adakv_floor=a.adakv_floor,
                  pyramid_schedule=a.pyramid_schedule, chunk_rule=a.chunk_rule, quest_heads=a.quest_heads,
                  key_bits=bits if a.key_bits is None else a.key_bits,
                  value_bits=bits if a.value_bits is None else a.value_bits,
                  key_axis=a.key_axis, value_axis=a.value_axis, group_size=a.group_size,
                  residual=a.residual, symmetric=a.symmetric, quant_model=a.quant_model,
                  noise_sigma=a.noise_sigma, seed=a.seed, zero_point=a.zero_point, partial=a.partial_groups,
                  snapkv_window=a.snapkv_window or None, h2o_normalized=a.h2o_normalized,
                  positions="cache" if a.rerotate else "true")
    return Spec(**(fields | _format_args(a)))


def _format_args(a: argparse.Namespace) -> dict:
    """The cache-format options (kvviz.quant.formats); the HF preset replaces the integer settings."""
    out = dict(key_format=a.key_format, value_format=a.value_format, fp8_scale=a.fp8_scale, rotate=a.rotate,
               residual_mode=a.residual_mode)
    if getattr(a, "quant_preset", None):
        from kvviz.quant.formats import hf_quantized_cache
        hf = hf_quantized_cache(4 if a.quant_preset == "hf-qc-4bit" else 2)
        out.update({k: getattr(hf, k) for k in ("key_bits", "value_bits", "key_axis", "value_axis", "group_size",
                                                 "residual", "residual_mode", "zero_point", "partial")})
    return out


def source_from_args(a: argparse.Namespace):
    """(trace, trace_for_seed) for the chosen source."""
    from kvviz.sources import SyntheticSpec, load_source

    synthetic = None
    if a.source == "synthetic":
        synthetic = SyntheticSpec(context=a.context, steps=a.steps, layers=a.layers, q_heads=a.heads,
                                  kv_heads=a.kv_heads, head_dim=a.head_dim, seed=a.seed,
                                  topic_shift=a.topic_shift)
    elif a.source not in ("handbook",) and not Path(a.source).exists():
        raise TraceError(f"no such source or file: {a.source} (use handbook, synthetic or a .safetensors trace)")
    trace = load_source(a.source, synthetic)
    for_seed = None
    if a.source == "handbook":   # other seeds realise other keys and values, as in the app (kvviz.links)
        from kvviz.sources import handbook_trace
        for_seed = lambda r: handbook_trace(seed=r)  # noqa: E731
    if synthetic is not None:
        from kvviz.sources import make_synthetic
        for_seed = lambda r: make_synthetic(synthetic.with_(seed=synthetic.seed + r))  # noqa: E731
    return trace, for_seed


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def view_layer(trace, a: argparse.Namespace) -> int:
    """The position in the trace of --layer (a model layer number; TraceError naming the layers there are)."""
    return 0 if a.layer is None else trace.layer_index(a.layer)


def add_view_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("view")
    g.add_argument("--layer", type=integer(0, MAX_TOKENS), default=None,
                   help="the model's own layer number (a capture of --layers 0-3,15 has layer 15; "
                        "default: the trace's first layer)")
    g.add_argument("--head", type=integer(0, MAX_TOKENS), default=0, help="query head")
    g.add_argument("--step", type=integer(0, MAX_TOKENS), default=None, help="which evaluated query (default: the last)")
    g.add_argument("--ensemble", choices=ENSEMBLES, default=None, help="what the error bars range over")
    g.add_argument("--ensemble-size", type=integer(1, MAX_ENSEMBLE), default=8,
                   help=f"rows behind the error bars (1-{MAX_ENSEMBLE})")
