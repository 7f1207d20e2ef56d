"""The model flags every command that runs a real model shares: --model, --device, --device-map, --dtype.

    add_model_args(p)    the four flags, in their own group
    load_from_args(a)    the model on that device in that dtype; a device that is not there is one line
    device_errors(fn)    a command handler whose out-of-memory (GPU or host) or missing device is one
                         line saying what to lower (exit 2), never a traceback

torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

import argparse
import functools
import re

from kvviz.cli.args import CliError

# kvviz.models.load.DTYPES, without importing it here
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_RE = re.compile(r"cpu|cuda(:\d{1,3})?|mps")
MODEL_HELP = "'bundled' (SmolLM2-135M, offline), a local model folder or .gguf file, or a hub id"


def device_name(text: str) -> str:
    """An argparse type: cpu, cuda, cuda:N or mps (whether it is there is checked before the model loads)."""
    value = text.strip().lower()
    if not DEVICE_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps, got {text!r}")
    return value


def add_model_args(p: argparse.ArgumentParser, model_default: str = "bundled") -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=model_default, help=MODEL_HELP)
    g.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        help="where the model and its compressed cache run: cpu (default), cuda, cuda:N or mps",
    )
    g.add_argument(
        "--device-map",
        default=None,
        choices=("auto",),
        help="auto: spread a model too big for one GPU over every GPU, then the CPU (needs accelerate); "
        "overrides --device",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the weights' dtype, which the cache keeps too (default float32; bfloat16 or float16 halve "
        "the memory; attention over the cache runs in float32 either way)",
    )


def check_device(device: str) -> None:
    """One line (CliError) when this machine has no such device."""
    from kvviz.decode.place import missing_device

    line = missing_device(device)
    if line is not None:
        raise CliError("--" + line)


def load_from_args(a: argparse.Namespace, progress=None):
    """(model, tokenizer, info) as --model / --device / --device-map / --dtype ask."""
    from kvviz.models import load_model

    if not a.device_map:
        check_device(a.device)
    return load_model(a.model, device=a.device, dtype=a.dtype, device_map=a.device_map, progress=progress)


def device_errors(fn):
    """Wrap a command handler: out of memory or a missing device -> one line (CliError, exit 2)."""

    @functools.wraps(fn)
    def run(a: argparse.Namespace) -> int:
        try:
            return fn(a)
        except (RuntimeError, MemoryError) as exc:
            from kvviz.decode.place import device_error

            line = device_error(exc)
            if line is None:
                raise
            raise CliError(line) from None

    return run
