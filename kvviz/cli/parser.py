"""The `kvviz` command line: compare one configuration, sweep many, and the plug-in commands."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvviz.metrics import DEFINITIONS as METRIC_DEFINITIONS
from kvviz.spec import (ALLOCATIONS, AXES, CHUNK_INNER, ENSEMBLES, FORMATS, FP8_SCALES, FULL_BITS, PARTIAL_GROUPS,
                   QUANT_MODELS, RESIDUAL_MODES, ROTATIONS, SCORERS, ZERO_POINTS, Spec, SpecError, View,
                   scorer_names)
from kvviz.trace import TraceError


class CliError(Exception):
    """A usage problem to report in one line."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one clear line and exit status 2, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("source")
    g.add_argument("--source", default="handbook", help="handbook, synthetic, or a trace file (.safetensors)")
    g.add_argument("--context", type=int, default=512, help="synthetic: context tokens (8-32768)")
    g.add_argument("--steps", type=int, default=32, help="synthetic: later query steps")
    g.add_argument("--layers", type=int, default=2, help="synthetic: layers")
    g.add_argument("--heads", type=int, default=4, help="synthetic: query heads")
    g.add_argument("--kv-heads", type=int, default=2, help="synthetic: KV heads")
    g.add_argument("--head-dim", type=int, default=64, help="synthetic: head dimension")
    g.add_argument("--topic-shift", type=float, default=0.0, help="synthetic: logit boost of late anchors")


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
                        "across its KV heads, each head at least alpha x heavy); pyramid (layer budgets falling "
                        "linearly, same total)")
    g.add_argument("--adakv-alpha", type=float, default=0.2, help="AdaKV safeguard alpha (kvpress 0.2)")
    g.add_argument("--pyramid-beta", type=float, default=20.0,
                   help="PyramidKV: top layer heavy/beta, bottom 2 heavy - heavy/beta (kvpress 20; 1 = flat)")
    g.add_argument("--ea-horizon", type=int, default=512,
                   help="Expected Attention: future positions the query statistics are rotated over (kvpress 512)")
    g.add_argument("--ea-no-covariance", action="store_true",
                   help="Expected Attention: the queries' mean only, no covariance")
    g.add_argument("--chunk-size", type=int, default=20, help="ChunkKV: tokens per chunk (kvpress 20)")
    g.add_argument("--chunk-scorer", default="snapkv", choices=CHUNK_INNER,
                   help="ChunkKV: the token scorer pooled per chunk")
    g.add_argument("--page-size", type=int, default=16, help="Quest: tokens per page (Quest 16)")
    g.add_argument("--bits", type=int, help="key and value bits (1-8; 16 = off)")
    g.add_argument("--key-bits", type=int, help="key bits (overrides --bits)")
    g.add_argument("--value-bits", type=int, help="value bits (overrides --bits)")
    g.add_argument("--key-axis", default="channel", choices=AXES)
    g.add_argument("--value-axis", default="token", choices=AXES)
    g.add_argument("--group-size", type=int, default=32)
    g.add_argument("--residual", type=_nonneg, default=0, help="recent tokens kept in full precision")
    g.add_argument("--symmetric", action="store_true", help="symmetric quantization (no zero point)")
    g.add_argument("--zero-point", default="float", choices=ZERO_POINTS,
                   help="asymmetric groups: KIVI's float offset x_hat = q*s + min (float, default) or an "
                        "integer zero point x_hat = s*(q - z) as integer kernels store it (int)")
    g.add_argument("--partial-groups", default="full", choices=PARTIAL_GROUPS,
                   help="a trailing group shorter than --group-size: kept at 16 bits as KIVI does (full, "
                        "default) or quantized as a short group (quantize)")
    g.add_argument("--snapkv-window", type=_nonneg, default=0,
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
    g.add_argument("--noise-sigma", type=float, default=0.01, help="noise model: logit noise std")
    g.add_argument("--seed", type=int, default=0, help="random draws (noise, random scorer, synthetic source)")


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
                  chunk_scorer=a.chunk_scorer, page_size=a.page_size,
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
    if synthetic is not None:
        from kvviz.sources import make_synthetic
        for_seed = lambda r: make_synthetic(synthetic.with_(seed=synthetic.seed + r))  # noqa: E731
    return trace, for_seed


def cmd_compare(a: argparse.Namespace) -> int:
    from kvviz.engine import compare

    spec = spec_from_args(a)
    view = View(layer=a.layer, head=a.head, step=a.step, ensemble=a.ensemble, ensemble_size=a.ensemble_size)
    trace, for_seed = source_from_args(a)
    result = compare(trace, spec, view, trace_for_seed=for_seed)
    if a.json:
        json.dump(_json_safe({**result.to_json(), "definitions": METRIC_DEFINITIONS}), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_table(result, trace))
    return 0


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def format_table(result, trace, max_rows: int = 80) -> str:
    from kvviz.engine import REASONS

    p = result.primary
    lines = [trace.describe(),
             f"spec: {result.spec.label()}   layer {p.layer}, head {p.head} (KV head {p.kv_head}), "
             f"query at position {p.position}"
             + (f", error bars over {len(result.members)} {result.ensemble}" if result.ensemble else ""),
             *[f"note: {n}" for n in result.notes], "",
             f"{'pos':>6} {'token':<12} {'original':>10} {'compressed':>11} {'error':>10} {'err std':>9}  kept"]
    n = len(p.original)
    rows = range(n) if n <= max_rows else list(range(max_rows // 2)) + list(range(n - max_rows // 2, n))
    last = -1
    for i in rows:
        if i != last + 1:
            lines.append(f"{'...':>6}")
        last = i
        lines.append(f"{i:>6} {result.tokens[i][:12]:<12} {p.original[i]:>10.5f} {p.compressed[i]:>11.5f} "
                     f"{p.error[i]:>+10.5f} {result.spread.std[i]:>9.5f}  {REASONS[int(p.reason[i])]}")
    m = result.metrics
    out = "n/a" if m["output_rel_error"] is None else f"{m['output_rel_error']:.4f}"
    forward = "inf (a token the original attends to was evicted)" if math.isinf(m["kl_forward"]) \
        else f"{m['kl_forward']:.4f} nats"
    lines += ["", "metrics:",
              f"  attention mass retained   {m['mass_retained']:.4f}",
              f"  total-variation distance  {m['tv_distance']:.4f}",
              f"  KL(compressed || original) {m['kl']:.4f} nats",
              f"  KL(original || compressed) {forward}",
              f"  Jensen-Shannon            {m['js']:.4f} nats (at most ln 2 = 0.6931)",
              f"  max |error|               {m['max_abs_error']:.5f}",
              f"  output relative L2 error  {out}",
              f"  KV cache                  {m['kv_bytes']:,.0f} B of {m['kv_bytes_full']:,.0f} B (16-bit), "
              f"{m['compression_ratio']:.2f}x smaller; {m['kept_tokens']} of {m['total_tokens']} tokens kept"]
    if m.get("kv_bytes_read") is not None and m["kv_bytes_read"] != m["kv_bytes"]:
        lines.append(f"  read per step             {m['kv_bytes_read']:,.0f} B ({m['kv_bytes_read'] / m['kv_bytes_full']:.1%} "
                     "of the 16-bit cache): this method saves memory read, not memory stored")
    return "\n".join(lines)


def cmd_sweep(a: argparse.Namespace) -> int:
    from kvviz.analysis.sweep import sweep, to_csv

    scorers = [s.strip() for s in a.scorers.split(",") if s.strip()]
    if a.policy:   # the plug-in joins the sweep
        name = scorer_from_args(a)
        scorers += [] if name in scorers else [name]
    from kvviz.policies.registry import load_entry_points
    load_entry_points()
    bad = [s for s in scorers if s not in scorer_names()]
    if bad:
        raise SpecError(f"unknown scorer {bad[0]!r}; choose from {', '.join(scorer_names())}")
    try:
        fractions = [float(x) for x in a.budgets.split(",")]
        bits = [int(x) for x in a.bits_list.split(",")]
    except ValueError:
        raise CliError("--budgets takes fractions like 0.1,0.2 and --bits-list integers like 16,4,2") from None
    if any(not 0 < f <= 1 for f in fractions):
        raise CliError("budgets are fractions of the tokens, each in (0, 1]")
    base = spec_from_args(a)
    trace, _ = source_from_args(a)
    view = View(layer=a.layer, head=a.head, step=a.step, ensemble=a.ensemble or "heads",
                ensemble_size=a.ensemble_size)
    from kvviz.analysis.sweep import SWEEP_FORMATS
    formats = [f.strip() for f in a.formats_list.split(",") if f.strip()]
    bad = [f for f in formats if f not in SWEEP_FORMATS]
    if bad:
        raise CliError(f"unknown format {bad[0]!r} in --formats-list; choose from {', '.join(SWEEP_FORMATS)}")
    rows = sweep(trace, scorers, fractions, bits, view, base,
                 progress=(lambda f, msg: print(f"\r[{f:4.0%}] {msg:<50}", end="", file=sys.stderr)), formats=formats)
    print(file=sys.stderr)
    text = to_csv(rows)
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {len(rows)} rows to {a.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_solve(a: argparse.Namespace) -> int:
    from kvviz.analysis.solve import SPLIT_RULE, solve

    if a.sink or a.recent or a.heavy:
        raise CliError("solve chooses sink, recent and heavy itself (split rule: " + SPLIT_RULE
                       + "); use --max-sink to change the number of sinks")
    if (a.target_mass is None) == (a.target_tv is None):
        raise CliError("give one target: --target-mass M (keep at least M of the attention) or --target-tv T")
    base = spec_from_args(a)
    trace, _ = source_from_args(a)
    view = View(layer=a.layer, head=a.head, step=a.step)
    sol = solve(trace, base, view, target_mass=a.target_mass, target_tv=a.target_tv, max_sink=a.max_sink)
    if a.json:
        json.dump(_json_safe(sol.as_dict()), sys.stdout)
        sys.stdout.write("\n")
        return 0
    what = "attention mass" if sol.metric == "mass_retained" else "TV distance"
    sign = ">=" if sol.metric == "mass_retained" else "<="
    below = "" if sol.below is None else f"; one token less gives {sol.below:.4f}"
    print(f"smallest cache with {what} {sign} {sol.target:g} ({base.scorer}, {base.label()}): "
          f"{sol.budget} of {sol.tokens} tokens = sink {sol.spec.sink} + recent {sol.spec.recent} + "
          f"heavy {sol.spec.heavy}; reaches {sol.value:.4f}{below}")
    print(f"split rule: {SPLIT_RULE}; {'exact smallest' if sol.exact else 'one token less misses the target'}; "
          f"{sol.evaluations} budgets evaluated")
    return 0


def cmd_ledger(a: argparse.Namespace) -> int:
    from kvviz.analysis.ledger import budget_ledger, to_csv

    spec = spec_from_args(a)
    trace, _ = source_from_args(a)
    ledger = budget_ledger(trace, spec, a.step)
    if a.csv:
        sys.stdout.write(to_csv(ledger))
        return 0
    print(trace.describe())
    print(f"spec: {spec.label()}; caches at the query at position {ledger.position} ({ledger.n_tokens} tokens seen)")
    print(f"{'layer':>5} {'declared':>9} {'kept':>6} {'sink':>5} {'recent':>7} {'heavy':>6} {'stored B':>11} "
          f"{'read B':>11} {'overhead B':>11} {'16-bit B':>10}   (summed over the layer's KV heads)")
    cols = ("declared_tokens", "kept_tokens", "sink", "recent", "heavy", "stored_bytes", "read_bytes",
            "overhead_bytes")
    per = {c: ledger.per_layer(c) for c in cols}
    full16 = ledger.per_layer("residual_bytes") + ledger.per_layer("partial_bytes")
    for i in range(len(per["kept_tokens"])):
        print(f"{i:>5} {per['declared_tokens'][i]:>9.0f} {per['kept_tokens'][i]:>6.0f} {per['sink'][i]:>5.0f} "
              f"{per['recent'][i]:>7.0f} {per['heavy'][i]:>6.0f} {per['stored_bytes'][i]:>11,.0f} "
              f"{per['read_bytes'][i]:>11,.0f} {per['overhead_bytes'][i]:>11,.0f} {full16[i]:>10,.0f}")
    for note in ledger.notes():
        print(f"note: {note}")
    return 0


def add_view_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("view")
    g.add_argument("--layer", type=int, default=0)
    g.add_argument("--head", type=int, default=0, help="query head")
    g.add_argument("--step", type=int, default=None, help="which evaluated query (default: the last)")
    g.add_argument("--ensemble", choices=ENSEMBLES, default=None, help="what the error bars range over")
    g.add_argument("--ensemble-size", type=int, default=8)


def build_parser() -> argparse.ArgumentParser:
    from kvviz.cli.commands import register_all

    parser = OneLineParser(prog="kvviz", description="See what KV-cache compression does to attention.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    p = sub.add_parser("compare", help="original vs compressed attention for one configuration")
    add_source_args(p)
    add_compression_args(p)
    add_view_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="several policies over several budgets and bits -> CSV")
    add_source_args(p)
    add_compression_args(p)
    add_view_args(p)
    p.add_argument("--scorers", default=",".join(SCORERS), help="comma-separated scorers")
    p.add_argument("--budgets", default="0.05,0.1,0.2,0.3,0.5,1.0", help="budget fractions of the tokens")
    p.add_argument("--bits-list", default="16,8,4,2", help="bit widths to sweep")
    p.add_argument("--formats-list", default="",
                   help="cache formats to add to the sweep, K and V alike: e4m3,e5m2,nvfp4,mxfp4 (default none)")
    p.add_argument("--out", help="CSV file (default: standard output)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("solve", help="the smallest cache that keeps a target attention mass (or TV)")
    add_source_args(p)
    add_compression_args(p)
    add_view_args(p)
    g = p.add_argument_group("target (give one)")
    g.add_argument("--target-mass", type=float, help="keep at least this share of the attention (0-1)")
    g.add_argument("--target-tv", type=float, help="keep the TV distance at most this (0-1)")
    p.add_argument("--max-sink", type=_nonneg, default=4, help="sinks in the split rule (default 4)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("ledger", help="declared vs kept tokens and bytes per layer and KV head (the budget ledger)")
    add_source_args(p)
    add_compression_args(p)
    p.add_argument("--step", type=int, default=None, help="which evaluated query (default: the last)")
    p.add_argument("--csv", action="store_true", help="every (layer, KV head) row as CSV")
    p.set_defaults(func=cmd_ledger)

    register_all(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except (SpecError, TraceError, CliError) as exc:
        print(f"kvviz: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # ModelError and friends: one line, no traceback
        from kvviz.models import ModelError
        if isinstance(exc, (ModelError, FileNotFoundError, PermissionError)):
            print(f"kvviz: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
