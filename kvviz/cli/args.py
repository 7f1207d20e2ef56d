"""Argument groups and conversions every command shares: source, compression, view; args -> Spec."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from kvviz.sources.synthetic import MAX_CONTEXT, MAX_STEPS
from kvviz.settings import SETTINGS, Setting
from kvviz.spec import ENSEMBLES, FULL_BITS, MAX_ENSEMBLE, SCORERS, Spec, View
from kvviz.trace import TraceError

MAX_TOKENS = 1_000_000  # token counts and budgets (the work budget bounds their products)
MAX_SEED = 2**32 - 1
DASH_VALUE = re.compile(r"argument (-[-\w]+(?:/-[-\w]+)*): expected one argument")


class CliError(Exception):
    """A usage problem to report in one line."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one clear line and exit status 2, not a usage dump."""

    argv: list[str] = []  # the command line being parsed (set by kvviz.cli.parser.main)

    def error(self, message: str):
        m = DASH_VALUE.fullmatch(message)
        if m:  # `--budgets -1,abc`: argparse reads a value starting with '-' as another option
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
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
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
            raise argparse.ArgumentTypeError(
                f"must be {'above' if open_low else 'at least'} {lo:g} and at most {hi:g}, got {value:g}"
            )
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


# per knob; the work budget bounds their product
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 128, 256, 1024


# the synthetic source's sizes: flag, smallest, largest, default, what it counts
_SYNTHETIC_SIZES = (
    ("--context", 8, MAX_CONTEXT, 512, "context tokens"),
    ("--steps", 0, MAX_STEPS, 32, "later query steps"),
    ("--layers", 1, MAX_LAYERS, 2, "layers"),
    ("--heads", 1, MAX_HEADS, 4, "query heads"),
    ("--kv-heads", 1, MAX_HEADS, 2, "KV heads"),
    ("--head-dim", 8, MAX_HEAD_DIM, 64, "head dimension"),
)


def add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("source")
    g.add_argument("--source", default="handbook", help="handbook, synthetic, or a trace file (.safetensors)")
    for flag, low, high, default, what in _SYNTHETIC_SIZES:
        g.add_argument(flag, type=integer(low, high), default=default, help=f"synthetic: {what} ({low}-{high})")
    g.add_argument("--topic-shift", type=number(0, 1000), default=0.0, help="synthetic: logit boost of late anchors")


# The flags that are not one Spec setting each: the scorer's name (with --policy), the bits both K and V take,
# the Model lab's key positions, and transformers' QuantizedCache preset
_BY_HAND = frozenset({"scorer", "positions"})


def _setting_type(s: Setting):
    """The argparse type of a setting's flag: its range, from its declaration (one line on a bad value)."""
    if s.kind == "int":
        return integer(s.none_as if s.default is None else s.lo, s.hi)
    if s.kind == "float":
        return number(s.lo, s.hi)
    return None


def add_setting_arg(g, s: Setting) -> None:
    """One Spec setting's flag, made from its declaration: name, type, range, default and help."""
    help_text = s.help or s.label
    if s.kind == "bool":
        g.add_argument(
            s.flag, dest=s.name, action="store_false" if s.default else "store_true", default=s.default, help=help_text
        )
        return
    if s.name in ("key_bits", "value_bits"):  # no default: they follow --bits unless given
        g.add_argument(s.flag, dest=s.name, type=_setting_type(s), default=None, help=f"{help_text} (overrides --bits)")
        return
    default = s.none_as if s.default is None else s.default
    late = s.kind == "choice" and callable(s.choices)  # values known when parsed: ChunkKV's inner scorers
    if late:
        kwargs = dict(metavar=s.name.upper(), type=_choice_of(s))
    elif s.kind == "choice":
        kwargs = dict(choices=s.values)
    else:
        kwargs = dict(type=_setting_type(s))
    g.add_argument(s.flag, dest=s.name, default=default, help=f"{help_text} (default {default})", **kwargs)


def _choice_of(s: Setting):
    """A choice whose values are known late (ChunkKV's inner scorers): checked when parsed."""

    def parse(text: str) -> str:
        if text not in s.values:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(s.values)}, got {text!r}")
        return text

    return parse


def add_compression_args(p: argparse.ArgumentParser) -> None:
    from kvviz.policies.registry import load_entry_points

    load_entry_points()  # an installed plug-in's settings get flags (and --help lines) too
    g = p.add_argument_group("compression (eviction is off unless --sink, --recent or --heavy is given)")
    g.add_argument(
        "--scorer",
        default=None,
        metavar="SCORER",
        help=f"how heavy hitters are ranked: {', '.join(SCORERS)}, or an installed plug-in "
        "(default h2o; with --policy, the plug-in)",
    )
    g.add_argument(
        "--policy",
        default=None,
        metavar="FILE.py:NAME",
        help="your own scorer: a Policy subclass or score(ctx) function in a Python file "
        "(docs/plugins.md); it becomes --scorer unless --scorer is given",
    )
    g.add_argument("--bits", type=integer(1, FULL_BITS), help="key and value bits (1-8; 16 = off)")
    g.add_argument(
        "--rerotate",
        action="store_true",
        help="real-model decode (eval): re-rotate kept keys to their cache slots as the original "
        "StreamingLLM does, instead of keeping their true positions",
    )
    g.add_argument(
        "--quant-preset",
        choices=("hf-qc-4bit", "hf-qc-2bit"),
        help="transformers' QuantizedCache defaults (quanto: per-token groups of 64 on K and V, "
        "residual_length 128, flushed) at 4 or 2 bits; overrides the bits/axis/group/residual options",
    )
    for s in SETTINGS.values():
        if s.name not in _BY_HAND and s.flag:
            add_setting_arg(g, s)


def scorer_from_args(a: argparse.Namespace) -> str:
    """--scorer, else the --policy plug-in's name, else the default scorer; loads the --policy file once."""
    plugin = None
    if getattr(a, "policy", None):
        from kvviz.policies.registry import load_file

        if getattr(a, "_plugin", None) is None:
            a._plugin = load_file(a.policy)
        plugin = a._plugin.name
    return a.scorer or plugin or SETTINGS["scorer"].default


def spec_from_args(a: argparse.Namespace) -> Spec:
    bits = FULL_BITS if a.bits is None else a.bits
    values = {s.name: getattr(a, s.name) for s in SETTINGS.values() if s.name not in _BY_HAND and hasattr(a, s.name)}
    for s in SETTINGS.values():
        if s.default is None and values.get(s.name) == s.none_as:
            values[s.name] = None
    for name in ("key_bits", "value_bits"):
        if values.get(name) is None:
            values[name] = bits
    values.update(scorer=scorer_from_args(a), positions="cache" if a.rerotate else "true")
    return Spec(**(values | _format_args(a)))


def _format_args(a: argparse.Namespace) -> dict:
    """The cache-format options (kvviz.quant.formats); the HF preset replaces the integer settings."""
    out = {}
    if getattr(a, "quant_preset", None):
        from kvviz.quant.formats import hf_quantized_cache

        hf = hf_quantized_cache(4 if a.quant_preset == "hf-qc-4bit" else 2)
        out.update(
            {
                k: getattr(hf, k)
                for k in (
                    "key_bits",
                    "value_bits",
                    "key_axis",
                    "value_axis",
                    "group_size",
                    "residual",
                    "residual_mode",
                    "zero_point",
                    "partial",
                )
            }
        )
    return out


def source_from_args(a: argparse.Namespace):
    """(trace, trace_for_seed) for the chosen source."""
    from kvviz.sources import SyntheticSpec, load_source

    synthetic = None
    if a.source == "synthetic":
        synthetic = SyntheticSpec(
            context=a.context,
            steps=a.steps,
            layers=a.layers,
            q_heads=a.heads,
            kv_heads=a.kv_heads,
            head_dim=a.head_dim,
            seed=a.seed,
            topic_shift=a.topic_shift,
        )
    elif a.source not in ("handbook",) and not Path(a.source).exists():
        raise TraceError(f"no such source or file: {a.source} (use handbook, synthetic or a .safetensors trace)")
    trace = load_source(a.source, synthetic)
    for_seed = None
    # other seeds realise other keys and values, as in the app (kvviz.links)
    if a.source == "handbook":
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


def view_from_args(trace, a: argparse.Namespace, **more) -> View:
    """The View that --layer (the model's own layer number), --head and --step pick in `trace`; `more`
    sets its other fields (the error bars' ensemble)."""
    return View(layer=view_layer(trace, a), head=a.head, step=a.step, **more)


def add_view_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("view")
    g.add_argument(
        "--layer",
        type=integer(0, MAX_TOKENS),
        default=None,
        help="the model's own layer number (a capture of --layers 0-3,15 has layer 15; "
        "default: the trace's first layer)",
    )
    g.add_argument("--head", type=integer(0, MAX_TOKENS), default=0, help="query head")
    g.add_argument(
        "--step", type=integer(0, MAX_TOKENS), default=None, help="which evaluated query (default: the last)"
    )
    g.add_argument("--ensemble", choices=ENSEMBLES, default=None, help="what the error bars range over")
    g.add_argument(
        "--ensemble-size",
        type=integer(1, MAX_ENSEMBLE),
        default=8,
        help=f"rows behind the error bars (1-{MAX_ENSEMBLE})",
    )


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The source, compression and view groups: what a command that works on one trace's view takes."""
    add_source_args(p)
    add_compression_args(p)
    add_view_args(p)


def spec_trace_view(a: argparse.Namespace, **more):
    """(spec, trace, trace_for_seed, view) from add_trace_args' options, in that order: a bad spec is
    reported before the source is loaded; `more` sets the View's other fields (view_from_args)."""
    spec = spec_from_args(a)
    trace, for_seed = source_from_args(a)
    return spec, trace, for_seed, view_from_args(trace, a, **more)
