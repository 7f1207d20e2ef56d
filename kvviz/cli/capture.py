"""`kvviz capture` (a real model's q, k, v for a prompt -> trace file) and `kvviz models`.

torch and transformers are imported inside the handlers only, so `kvviz compare` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvviz.cli.args import ProgressLine

DEFAULT_MAX_TOKENS = 2048  # mirrors kvviz.sources.request.DEFAULT_MAX_TOKENS (no torch import here)
MAX_CAPTURE_TOKENS = 131072


def register(subparsers) -> None:
    from kvviz.cli.args import integer
    from kvviz.sources.request import MAX_NEW_TOKENS

    p = subparsers.add_parser(
        "capture",
        help="capture a real model's queries, keys and values for a prompt -> trace file",
        description="Run a causal language model over a prompt (prefill, then greedy decode steps) "
        "and save its post-RoPE queries, keys and values as a kvviz trace "
        "(open it with `kvviz compare --source FILE` or the app's Trace file source).",
    )
    p.add_argument(
        "--model",
        default="bundled",
        help="'bundled' (SmolLM2-135M, offline), a local model folder or .gguf file, or a hub id",
    )
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the prompt text")
    text.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file ('-' = stdin)")
    p.add_argument(
        "--new-tokens",
        type=integer(0, MAX_NEW_TOKENS),
        default=0,
        help=f"greedy decode steps after the prompt (0-{MAX_NEW_TOKENS}, default 0)",
    )
    p.add_argument(
        "--max-tokens",
        type=integer(1, MAX_CAPTURE_TOKENS),
        default=DEFAULT_MAX_TOKENS,
        help=f"longer prompts are cut to their first N tokens (1-{MAX_CAPTURE_TOKENS:,}, default "
        f"{DEFAULT_MAX_TOKENS}); the work budget (KVVIZ_MAX_BYTES) bounds what the model's shape allows",
    )
    p.add_argument("--layers", default=None, help="layers to keep, e.g. 0,1,5 or 0-3 (default: all)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps (default cpu)")
    p.add_argument(
        "--device-map", default=None, help="e.g. 'auto' to spread a big model over several GPUs (needs accelerate)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="model weights' dtype; the trace stores q, k, v in it (bfloat16 stays bfloat16)",
    )
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=("sdpa", "eager", "model"),
        help="the attention the model runs while recorded (default sdpa: no tokens x tokens matrix; "
        "'model': whatever it was loaded with)",
    )
    p.add_argument(
        "--kvzip",
        action="store_true",
        help="also run KVzip's reconstruction pass over the prompt (3-4 times the prefill's time) and keep "
        "its scores in the trace, so that the KVzip scorer can be chosen on it",
    )
    p.add_argument("--out", required=True, help="output trace file (.safetensors)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_capture)

    m = subparsers.add_parser(
        "models",
        help="list the models available offline",
        description="The bundled model (present or not) and models in the local Hugging Face cache.",
    )
    m.set_defaults(func=cmd_models)


def _read_prompt(a: argparse.Namespace) -> str:
    from kvviz.models import ModelError

    if a.prompt is not None:
        return a.prompt
    if a.prompt_file == "-":
        return sys.stdin.read()
    path = Path(a.prompt_file)
    if not path.is_file():
        raise ModelError(f"prompt file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ModelError(f"{path} is not a UTF-8 text file") from None


def cmd_capture(a: argparse.Namespace) -> int:
    from kvviz.models import ModelError
    from kvviz.decode.reconstruct import kvzip_meta
    from kvviz.models import load_model
    from kvviz.sources.capture import capture

    prompt = _read_prompt(a)
    if not prompt.strip():
        raise ModelError("the prompt is empty: give some text with --prompt or --prompt-file")
    out = Path(a.out)
    if out.suffix != ".safetensors":
        raise ModelError(f"--out must end in .safetensors, not {out.name!r}")
    if not out.parent.exists():
        raise ModelError(f"folder {out.parent} does not exist")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bar = ProgressLine(not a.quiet and sys.stderr is not None)
    free_budget = False
    try:
        free_budget = default_budget_is_free_memory()
        model, tokenizer, info = load_model(
            a.model, device=a.device, dtype=a.dtype, device_map=a.device_map, progress=lambda f, m: bar(0.3 * f, m)
        )
        trace = capture(
            model,
            tokenizer,
            info,
            prompt,
            new_tokens=a.new_tokens,
            max_tokens=a.max_tokens,
            layers=a.layers,
            progress=lambda f, m: bar(0.3 + 0.7 * f, m),
            attention=a.attention,
            # written layer by layer; `out` is replaced only when complete
            out=out,
            more_meta=kvzip_meta(model, tokenizer) if a.kvzip else None,
        )
    finally:
        bar.done()
        if free_budget:
            from kvviz.limits import set_max_bytes

            # the process's budget as it was (main() in a test, a notebook)
            set_max_bytes(None)
    for note in trace.meta.get("notes", []):
        print(f"kvviz: note: {note}", file=sys.stderr)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 1e6:.1f} MB): {trace.describe()}", file=sys.stderr)
    return 0


def default_budget_is_free_memory() -> bool:
    """The command line's work budget, unless KVVIZ_MAX_BYTES or a program says otherwise: the memory this
    machine has free now (the app keeps its per-request cap: it serves many). True when it set it."""
    from kvviz.limits import DEFAULT_MAX_BYTES, ENV, MIN_MAX_BYTES, max_bytes, set_max_bytes

    if os.environ.get(ENV, "").strip() or max_bytes() != DEFAULT_MAX_BYTES:
        return False
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: keep the default
        return False
    set_max_bytes(max(free, MIN_MAX_BYTES))
    return True


def cmd_models(a: argparse.Namespace) -> int:
    from kvviz.models import available_models

    for m in available_models():
        state = "available" if m.present else "missing"
        print(f"{m.name:<40} {m.kind:<9} {state:<10} {m.detail}")
    print("any local folder or .gguf file also works: kvviz capture --model PATH ...", file=sys.stderr)
    return 0
