"""The compression presets: one click sets the sliders to a published method, sized to the text."""

from __future__ import annotations

import math

import streamlit as st

from kvviz.app.store import state
from kvviz.sources import handbook
from kvviz.spec import FULL_BITS

PRESETS = (
    "Handbook example",
    "StreamingLLM",
    "H2O 10%+10%",
    "KIVI 2-bit",
    "Aggressive 25% + 2-bit",
    "HF QuantizedCache 4-bit",
    "llama.cpp q8_0 / q4_0 K/V",
    "vLLM FP8 (uncalibrated)",
)
_NO_QUANT = dict(
    bits=FULL_BITS,
    split=False,
    key_bits=FULL_BITS,
    value_bits=FULL_BITS,
    qmodel="kv",
    symmetric=False,
    residual=0,
    key_axis="channel",
    value_axis="token",
    group=32,
    zero_point="float",
    partial="quantize",
    key_fmt="int",
    value_fmt="int",
    rotate="none",
    res_mode="kivi",
    fp8_scale="head",
    fp8_cal=False,
)


PRESET_HELP = {
    "Handbook example": (
        "Sink 4, recent 8, heavy 2 (H2O), no quantization: the handbook's worked example. Groups of "
        "32 that the kept tokens do not fill are quantized too, so the bits slider reaches every "
        "kept key and value."
    ),
    "StreamingLLM": "4 attention sinks + a recent window of ~20% of the tokens; position only.",
    "H2O 10%+10%": "H2O: 10% heavy hitters + 10% recent window, as in the H2O paper's experiments.",
    "KIVI 2-bit": (
        "No eviction; KIVI as published: 2-bit keys per channel, values per token, groups of 32, float "
        "offset, the last 128 tokens at 16 bits (fewer on a short text, so one group is quantized)."
    ),
    "Aggressive 25% + 2-bit": "Keep 25% of the tokens (sinks, recent, H2O heavy hitters) and quantize them to 2 bits.",
    "HF QuantizedCache 4-bit": (
        "No eviction; transformers' QuantizedCache defaults (quanto): 4-bit keys AND values per "
        "token in groups of 64 channels, float offset, the prompt quantized whole and a "
        "full-precision window flushed every 128 tokens. Unlike KIVI, keys are per token."
    ),
    "llama.cpp q8_0 / q4_0 K/V": (
        "No eviction; llama.cpp / ollama's quantized cache as `--cache-type-k q8_0 "
        "--cache-type-v q4_0` sets it: keys in q8_0 (int8, 34 bytes per block of 32 "
        "channels), values in q4_0 (4-bit, 18 bytes per block), one fp16 scale per block, "
        "every token quantized (no full-precision window)."
    ),
    "vLLM FP8 (uncalibrated)": (
        "No eviction; vLLM's `kv_cache_dtype=fp8` (E4M3) on a checkpoint without k_scale / "
        "v_scale: both scales are 1.0, so the cache is a plain cast that saturates |x| above "
        "448 and flushes tiny values to zero. The notes count them."
    ),
}


def preset_values(name: str, n_tokens: int) -> dict:
    """Slider values of a preset for a query that sees n_tokens tokens."""
    tenth = max(1, math.ceil(0.1 * n_tokens))
    if name == "Handbook example":
        return dict(_NO_QUANT, sink=handbook.SINK, recent=handbook.RECENT, heavy=handbook.HEAVY, scorer="h2o")
    if name == "StreamingLLM":  # 4 attention sinks + a recent window (~20% of the tokens)
        return dict(_NO_QUANT, sink=4, recent=max(8, 2 * tenth - 4), heavy=0, scorer="streaming")
    if name == "H2O 10%+10%":
        return dict(_NO_QUANT, sink=0, recent=tenth, heavy=tenth, scorer="h2o")
    # keys per channel, values per token, G=32; residual 128 (less on short traces)
    if name == "KIVI 2-bit":
        from kvviz.quant import kivi_residual

        return dict(
            _NO_QUANT,
            sink=0,
            recent=0,
            heavy=0,
            bits=2,
            key_bits=2,
            value_bits=2,
            residual=kivi_residual(n_tokens),
            partial="full",
        )
    if name == "Aggressive 25% + 2-bit":
        budget = max(3, math.ceil(0.25 * n_tokens))
        sink = min(4, budget // 3)
        recent = (budget - sink) // 2
        return dict(
            _NO_QUANT,
            sink=sink,
            recent=recent,
            heavy=budget - sink - recent,
            scorer="h2o",
            bits=2,
            key_bits=2,
            value_bits=2,
        )
    if name == "HF QuantizedCache 4-bit":  # kvviz.quant.formats.hf_quantized_cache(4)
        return dict(
            _NO_QUANT,
            sink=0,
            recent=0,
            heavy=0,
            bits=4,
            key_bits=4,
            value_bits=4,
            key_axis="token",
            value_axis="token",
            group=64,
            residual=min(128, n_tokens),
            partial="quantize",
            res_mode="hf",
        )
    if name == "llama.cpp q8_0 / q4_0 K/V":  # kvviz.quant.ggml
        return dict(_NO_QUANT, sink=0, recent=0, heavy=0, key_fmt="q8_0", value_fmt="q4_0")
    if name == "vLLM FP8 (uncalibrated)":  # kvviz.quant.fp8, static scales of 1.0
        return dict(_NO_QUANT, sink=0, recent=0, heavy=0, key_fmt="e4m3", value_fmt="e4m3", fp8_scale="static")
    raise ValueError(f"unknown preset {name!r}")


def apply_preset(name: str, n_tokens: int) -> None:
    store = state()
    for k, v in preset_values(name, n_tokens).items():
        store[k] = v
        st.session_state[k] = v


def preset_buttons(n_tokens: int) -> None:
    with st.container(horizontal=True, vertical_alignment="center", gap="small"):
        st.markdown("**Presets**", width="content")
        for name in PRESETS:
            st.button(name, key=f"preset_{name}", on_click=apply_preset, args=(name, n_tokens), help=PRESET_HELP[name])
