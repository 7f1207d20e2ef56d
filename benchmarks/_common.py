"""What several benchmarks share: the offline model setting, the prompt text that the capture benchmarks
repeat to their length, the attention shape of Llama 3 8B that the big-trace and GPU benchmarks build
with random weights, the KIVI 4-bit spec that the decode benchmarks time, the bundled model on a set number of threads
and its plain and compressed decode times taken in turns, and the lines that hold a figure against
its target.

Not a benchmark: `make bench` runs every benchmarks/*.py, and running this one does nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

TEXT = (
    "The river that runs through the old town is slow and brown in summer and fast and grey "
    "in winter. People have built mills, bridges, markets and schools along its banks for "
    "centuries, and each generation has told its own stories about the water. "
)

# Llama 3 8B's attention: 32 query heads over 8 KV heads of 128 dimensions, RoPE base 500,000
LLAMA_8B_ATTENTION = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)


def offline() -> None:
    """Models from the local Hugging Face cache only (no network), and tokenizers without their own
    thread pool (a benchmark times one thing at a time). Call before transformers is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def kivi_4bit():
    """KIVI at 4 bits: keys quantized per channel, values per token, groups of 32, the last 128
    tokens kept in full precision."""
    from kvviz.spec import Spec

    return Spec(key_bits=4, value_bits=4, key_axis="channel", value_axis="token", group_size=32, residual=128)


def bundled_model(threads: int, **options):
    """The bundled model on `threads` torch threads: (model, tokenizer, info, seconds its load took);
    `options` go to kvviz.models.load_model."""
    import torch

    from kvviz.models import load_model

    torch.set_num_threads(threads)
    t = time.perf_counter()
    model, tokenizer, info = load_model("bundled", **options)
    return model, tokenizer, info, time.perf_counter() - t


def decode_times(model, prompt: list[int], feed: list[int], specs: dict, steps: int, repeats: int):
    """Decode seconds for `steps` teacher-forced steps, plain (transformers' DynamicCache) and compressed (each
    spec), in turns so that background load hits both alike: `repeats` rounds, each spec's run right after a
    plain one. Returns (plain decode times, {name: compressed decode times}, {name: prefill and compression
    point times})."""
    from kvviz.decode import decode, plain_decode

    plain: list[float] = []
    comp: dict[str, list[float]] = {k: [] for k in specs}
    point: dict[str, list[float]] = {k: [] for k in specs}
    for _ in range(repeats):
        for name, spec in specs.items():
            tp: dict = {}
            plain_decode(model, prompt, steps, feed=feed, timings=tp)
            plain.append(tp["decode"])
            tc: dict = {}
            decode(model, prompt, spec, steps, feed=feed, timings=tc)
            comp[name].append(tc["decode"])
            point[name].append(tc["prefill"])
    return plain, comp, point


def within(text: str, value: float, target: float) -> bool:
    """Print `TEXT (target <= TARGET): OK`, or OVER where `value` is above the target; whether it is within."""
    ok = value <= target
    print(f"{text} (target <= {target:g}): {'OK' if ok else 'OVER'}")
    return ok


def exit_status(text: str, value: float, target: float) -> int:
    """Print `TEXT (target <= TARGET)`; the exit status: 0 where `value` is within the target, else 1."""
    print(f"{text} (target <= {target:g})", flush=True)
    return 0 if value <= target else 1


def targets_met(what: str, missed: list[str], log: Path | None = None) -> int:
    """Print `WHAT: met`, or `WHAT: MISSED: ` and the missed targets' names, then the server log's path if
    there is one; the exit status: 1 where a target was missed."""
    where = "" if log is None else f"; server log {log}"
    print(f"{what}: " + ("met" if not missed else "MISSED: " + ", ".join(missed)) + where)
    return 1 if missed else 0
