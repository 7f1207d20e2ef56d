"""`kvviz trace info FILE`: what a trace file holds - its manifest (model, versions, prompt, when) and the
sizes of its tensors - from the header alone, without reading any array."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "trace",
        help="inspect trace files (kvviz trace info FILE)",
        description="Inspect kvviz trace files without reading their arrays.",
    )
    inner = p.add_subparsers(dest="trace_command", required=True)
    i = inner.add_parser("info", help="the manifest and tensor sizes of a trace file (header only)")
    i.add_argument("file", help="a .safetensors trace written by kvviz capture or save_trace")
    i.add_argument("--json", action="store_true", help="print a JSON object instead of lines")
    i.set_defaults(func=cmd_info)


def cmd_info(a: argparse.Namespace) -> int:
    from kvviz.sources.traceheader import trace_info

    info = trace_info(a.file)
    if a.json:
        json.dump(info, sys.stdout, ensure_ascii=False, default=str)
        sys.stdout.write("\n")
    else:
        print(format_info(info))
    return 0


MANIFEST = (
    "model",
    "path",
    "revision",
    "architecture",
    "dtype",
    "device",
    "attn_implementation",
    "layer_kinds",
    "sliding_window",
    "prompt_sha256",
    "prompt_tokens",
    "new_tokens",
    "captured_at",
    "capture_seconds",
    "kvviz_version",
    "transformers_version",
    "torch_version",
    "source",
)


def format_info(info: dict) -> str:
    from kvviz.limits import fmt_bytes
    from kvviz.trace import layer_ranges

    m = info["meta"]
    lines = [
        f"{info['file']}: kvviz trace, format {info['version']}, {fmt_bytes(info['bytes'])}",
        f"  {info['positions']:,} positions (context {info['context_len']:,}), layers "
        f"{layer_ranges(info['layers'])} ({len(info['layers'])}), "
        f"{fmt_bytes(info['bytes_per_token'])} a token",
    ]
    for kind, e in info["tensors"].items():
        lines.append(f"  {kind:<16} {e['dtype']:<5} {e['tensors']:>4} x {e['shape']}  {fmt_bytes(e['bytes'])}")
    for key in MANIFEST:
        if m.get(key) is not None:
            value = m[key]
            if key == "layer_kinds" and isinstance(value, list):
                value = ", ".join(f"{n} x {k}" for k, n in _counts(value))
            lines.append(f"  {key:<20} {value}")
    prompt = " ".join(str(info.get("prompt") or "").split())
    if prompt:
        lines.append(f"  {'prompt':<20} {prompt[:100]}{'…' if len(prompt) > 100 else ''}")
    return "\n".join(lines)


def _counts(items: list) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return list(out.items())
