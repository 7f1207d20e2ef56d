"""What several benchmarks share: the offline model setting, the prompt text that the capture benchmarks
repeat to their length, the attention shape of Llama 3 8B that the big-trace and GPU benchmarks build
with random weights, and the KIVI 4-bit spec that the decode benchmarks time.

Not a benchmark: `make bench` runs every benchmarks/*.py, and running this one does nothing."""

from __future__ import annotations

import os

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
