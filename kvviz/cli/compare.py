"""`kvviz compare`: original vs compressed attention for one configuration (a table or JSON)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from kvviz.cli.args import _json_safe, add_trace_args, spec_trace_view
from kvviz.metrics import DEFINITIONS as METRIC_DEFINITIONS


def cmd_compare(a: argparse.Namespace) -> int:
    from kvviz.engine import compare

    # --layer is the model's own layer number (a capture of --layers 0-3,15 holds layer 15 at position 4)
    spec, trace, for_seed, view = spec_trace_view(a, ensemble=a.ensemble, ensemble_size=a.ensemble_size)
    result = compare(trace, spec, view, trace_for_seed=for_seed)
    if a.json:
        json.dump(
            _json_safe(
                {**result.to_json(), "layer_number": trace.layer_numbers[view.layer], "definitions": METRIC_DEFINITIONS}
            ),
            sys.stdout,
        )
        sys.stdout.write("\n")
    else:
        print(format_table(result, trace))
    return 0


def format_table(result, trace, max_rows: int = 80) -> str:
    from kvviz.engine import REASONS

    p = result.primary
    lines = [
        trace.describe(),
        f"spec: {result.spec.label()}   layer {trace.layer_numbers[p.layer]}"
        + ("" if result.layer_window is None else f" (sliding window {result.layer_window})")
        + f", head {p.head} (KV head {p.kv_head}), "
        f"query at position {p.position}"
        + (f", error bars over {len(result.members)} {result.ensemble}" if result.ensemble else ""),
        *[f"note: {n}" for n in result.notes],
        "",
        f"{'pos':>6} {'token':<12} {'original':>10} {'compressed':>11} {'error':>10} {'err std':>9}  kept",
    ]
    n = len(p.original)
    rows = range(n) if n <= max_rows else list(range(max_rows // 2)) + list(range(n - max_rows // 2, n))
    last = -1
    for i in rows:
        if i != last + 1:
            lines.append(f"{'...':>6}")
        last = i
        lines.append(
            f"{i:>6} {result.tokens[i][:12]:<12} {p.original[i]:>10.5f} {p.compressed[i]:>11.5f} "
            f"{p.error[i]:>+10.5f} {result.spread.std[i]:>9.5f}  {REASONS[int(p.reason[i])]}"
        )
    m = result.metrics
    out = "n/a" if m["output_rel_error"] is None else f"{m['output_rel_error']:.4f}"
    forward = (
        "inf (a token the original attends to was evicted)"
        if math.isinf(m["kl_forward"])
        else f"{m['kl_forward']:.4f} nats"
    )
    lines += [
        "",
        "metrics:",
        f"  attention mass retained   {m['mass_retained']:.4f}",
        f"  total-variation distance  {m['tv_distance']:.4f}",
        f"  KL(compressed || original) {m['kl']:.4f} nats",
        f"  KL(original || compressed) {forward}",
        f"  Jensen-Shannon            {m['js']:.4f} nats (at most ln 2 = 0.6931)",
        f"  max |error|               {m['max_abs_error']:.5f}",
        f"  output relative L2 error  {out}",
        f"  KV cache                  {m['kv_bytes']:,.0f} B of {m['kv_bytes_full']:,.0f} B (16-bit), "
        f"{m['compression_ratio']:.2f}x smaller; {m['kept_tokens']} of {m['total_tokens']} tokens kept",
    ]
    if m.get("kv_bytes_peak") is not None and m["kv_bytes_peak"] > m["kv_bytes"]:
        lines.append(
            f"  at its peak               {m['kv_bytes_peak']:,.0f} B: the full 16-bit prefill cache, before "
            "compression"
        )
    if m.get("kv_bytes_read") is not None and m["kv_bytes_read"] != m["kv_bytes"]:
        lines.append(
            f"  read per step             {m['kv_bytes_read']:,.0f} B ({m['kv_bytes_read'] / m['kv_bytes_full']:.1%} "
            "of the 16-bit cache): this method saves memory read, not memory stored"
        )
    return "\n".join(lines)


# what `kvviz compare --help` opens with, before its ~60 options (as git and pip do)
EXAMPLES = """\
examples:
  kvviz compare --sink 4 --recent 8 --heavy 2
      the handbook's worked example: 4 sinks, a window of 8, 2 heavy hitters (H2O), token by token
  kvviz compare --sink 4 --recent 8 --heavy 2 --bits 4
      the same cache with its keys and values quantized to 4 bits
  kvviz compare --source synthetic --context 1024 --scorer snapkv --sink 4 --recent 64 --heavy 100 \\
      --ensemble heads
      a 1,024-token synthetic pattern under SnapKV, with error bars over the query heads

Every option below has a default; `--json` prints the numbers for a script."""


def register(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="original vs compressed attention for one configuration",
        usage="kvviz compare [options]",
        description=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=cmd_compare)
