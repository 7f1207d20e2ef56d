"""The sidebar's Compression section: budgets, bits and the Advanced expander, and the Spec they describe."""

from __future__ import annotations

import streamlit as st

from kvviz.app.charts import deferred
from kvviz.app.labels import ALLOCATION_LABELS, FORMAT_LABELS, SCORER_LABELS, SCORER_SHORT, bits_label, scorer_help
from kvviz.app.params import BITS_OPTIONS, GROUP_OPTIONS, SCORER_CHOICES
from kvviz.app.store import state, w_budget, w_check, w_choice, w_number
from kvviz.links import spec_from_values
from kvviz.spec import FORMATS, FP8_SCALES, RESIDUAL_MODES, ROTATIONS, Spec, SpecError
from kvviz.trace import Trace


def compression_section(trace: Trace, where=None, budget_only: bool = False, headline=None) -> Spec | None:
    """Sidebar: the four headline sliders and the Advanced expander. None if the combination is impossible.

    budget_only: only the eviction budget (a page that draws each policy itself and never
    quantizes); the other controls are hidden and the page says so. headline: a container in the
    main area that takes the four headline sliders instead of the sidebar (Presentation mode: one
    widget a setting, so the sliders there are the ones the store and the link follow).
    """
    where = where or st.sidebar
    where.header("Compression")
    n = trace.n_positions
    unit = w_choice(where, "budget_unit", "Budgets in", ("tokens", "%"), widget="radio",
                    format_func={"tokens": "tokens", "%": f"% of the {n} tokens"}.get,
                    help="Type budgets as token counts or as a share of the tokens; the sliders always show counts.")
    if headline is not None:
        where.caption("Presentation mode: the four headline sliders are above the charts.")
        slots = headline.columns(4, gap="medium")
    else:
        slots = [where] * 4
    box = headline is None     # the number boxes beside the budgets: the sidebar's, not the projector's
    sink = w_budget(slots[0], "sink", "Sink tokens", n, unit, box=box,
                    help="The first tokens, always kept: attention sinks (StreamingLLM keeps 4).")
    recent = w_budget(slots[1], "recent", "Recent window", n, unit, box=box,
                      help="The last tokens the query sees (its own included), always kept.")
    heavy = w_budget(slots[2], "heavy", "Heavy-hitter budget", n, unit, box=box,
                     help="How many more tokens the scorer may keep among the rest (H2O's heavy hitters).")
    if budget_only:
        where.caption("This page compares eviction policies side by side: the scorer is picked per chart and "
                      "nothing is quantized, so only the budget sliders are shown.")
        return Spec(sink=sink, recent=recent, heavy=heavy)
    split = bool(state()["split"])
    bits = w_choice(slots[3], "bits", "Quantization bits", BITS_OPTIONS, widget="select_slider",
                    format_func=bits_label, disabled=split,
                    help="Bits per cached key and value (16 = not quantized). "
                         + ("Advanced sets keys and values separately now." if split else ""))
    with where.expander("Advanced"):
        if not deferred():   # folded at the first paint: its ~20 widgets come with the charts (kvviz.app.charts)
            advanced_controls(n)
    values = state()
    try:
        return spec_from_values(values)
    except SpecError as e:
        bits_used = (values["key_bits"], values["value_bits"]) if values["split"] else (values["bits"],)
        hint = (" Turn off symmetric quantization or raise the bits to 2 or more."
                if values["symmetric"] and 1 in bits_used else "")
        st.error(f"These compression settings are impossible: {e}.{hint}")
        return None


def advanced_controls(n: int) -> None:
    """Advanced: the scorer and its settings, the budget allocation, the quantizer and the cache format."""
    scorer = w_choice(st, "scorer", "Heavy-hitter scorer", tuple(SCORER_CHOICES), format_func=SCORER_LABELS.get,
                      help=scorer_help())
    allocation_widgets(st, scorer, n)
    if scorer == "snapkv":
        w_number(st, "snap_window", "SnapKV observation window (queries; 0 = auto)", 0, 4096,
                 help="The last context queries that vote. 0 = the recent window, capped at 64 (SnapKV's "
                      "default). The window is kept, so it must fit inside the recent window.")
    if scorer == "h2o":
        w_check(st, "h2o_norm", "H2O: divide by the queries that saw each token",
                help="Off: accumulated attention (H2O as published). On: accumulated attention / number of "
                     "queries that could see the token, so early tokens are not favoured for having been seen "
                     "more often (kvpress's observed-attention press).")
    if w_check(st, "split", "Separate key and value bits"):
        w_choice(st, "key_bits", "Key bits", BITS_OPTIONS, widget="select_slider", format_func=bits_label)
        w_choice(st, "value_bits", "Value bits", BITS_OPTIONS, widget="select_slider", format_func=bits_label)
    w_choice(st, "key_axis", "Key groups run along", ("channel", "token"), widget="radio",
             help="KIVI quantizes keys per channel (keys have outlier channels).")
    w_choice(st, "value_axis", "Value groups run along", ("channel", "token"), widget="radio",
             help="KIVI quantizes values per token.")
    w_choice(st, "group", "Group size (values per scale)", GROUP_OPTIONS)
    w_number(st, "residual", "Residual (last tokens kept at 16 bits)", 0, n)
    symmetric = w_check(st, "symmetric", "Symmetric quantization (no zero point; needs ≥ 2 bits)")
    w_choice(st, "zero_point", "Asymmetric zero", ("float", "int"), widget="radio",
             format_func={"float": "float offset (KIVI)", "int": "integer zero point"}.get, disabled=symmetric,
             help="KIVI dequantizes x̂ = q·s + min with min kept as a 16-bit float. Integer kernels round a zero "
                  "point z = round(−min/s) and store it in b bits: x̂ = s·(q − z), slightly larger error, and at "
                  "1 bit x̂ can leave [min, max].")
    w_choice(st, "partial", "Partial groups (shorter than G)", ("full", "quantize"), widget="radio",
             format_func={"full": "16-bit (KIVI)", "quantize": "quantize"}.get,
             help="Tokens after the last full group of G (per-channel keys) or channels after the last full "
                  "group (per-token): KIVI keeps them at full precision until a group fills; counted as 16-bit "
                  "in the memory. Or quantize them as a short group.")
    cache_format_controls()
    qmodel = w_choice(st, "qmodel", "Quantization model", ("kv", "noise"), widget="radio",
                      format_func={"kv": "real K/V quantization", "noise": "handbook logit noise"}.get)
    w_number(st, "sigma", "Noise σ (logit noise model)", 0.0, 100.0, step=0.005, fmt="%.3f",
             disabled=qmodel != "noise")


def cache_format_controls() -> None:
    """Advanced: the cache format of keys and values, FP8 scales, rotation, the residual's mode."""
    st.markdown("**Cache format**")
    key_fmt = w_choice(st, "key_fmt", "Key format", FORMATS, format_func=FORMAT_LABELS.get,
                       help="Integer min-max groups (KIVI) at the bits above, or a serving format: FP8 (vLLM, "
                            "SGLang) with FP32 scales, NVFP4 (E2M1 values, E4M3 scale per 16, FP32 per tensor) or "
                            "MXFP4 (E2M1, power-of-two scale per 32). FP8/FP4 fix their own width.")
    value_fmt = w_choice(st, "value_fmt", "Value format", FORMATS, format_func=FORMAT_LABELS.get)
    fp8 = {"e4m3", "e5m2"} & {key_fmt, value_fmt}
    w_choice(st, "fp8_scale", "FP8 scale per", FP8_SCALES, widget="radio", disabled=not fp8,
             format_func={"tensor": "tensor (layer)", "head": "KV head", "token": "token"}.get,
             help="One FP32 scale s = amax / format max for the layer's whole K (or V), for each KV head, or "
                  "for each token of each head.")
    w_choice(st, "rotate", "Hadamard rotation before quantizing", ROTATIONS, widget="radio",
             format_func={"none": "off", "keys": "keys (+ queries)", "keys-values": "keys and values"}.get,
             help="An orthonormal Hadamard rotation of the head dimension spreads outlier channels over all "
                  "channels (QuaRot / SpinQuant). Queries get the same rotation, so q·k is unchanged before "
                  "quantization; rotated values are rotated back on the output. Works with every format and axis.")
    w_choice(st, "res_mode", "Residual window", RESIDUAL_MODES, widget="radio",
             format_func={"kivi": "sliding (KIVI)", "hf": "flushed (HF QuantizedCache)"}.get,
             help="Sliding: the last `Residual` tokens are always exact. Flushed: transformers' QuantizedCache "
                  "quantizes the prompt whole, then collects new tokens at full precision and quantizes them "
                  "together once `Residual` of them have arrived.")
    if key_fmt != "int" or value_fmt != "int":
        st.caption("The bits slider sets the integer format only: FP8 stores 8 bits a value, NVFP4 / MXFP4 4 "
                   "(plus their scales, all counted in the memory).")


def allocation_widgets(where, scorer: str, n: int) -> None:
    """Advanced: the budget allocation over heads / layers, and the new scorers' own settings."""
    allocation = w_choice(where, "allocation", "Budget allocation", ("uniform", "adakv", "pyramid"),
                          format_func=ALLOCATION_LABELS.get,
                          help="Uniform: every KV head of every layer keeps `heavy` heavy hitters. AdaKV (Feng et "
                               "al. 2024; kvpress AdaKVPress): one budget per layer, given to the top scores across "
                               "all its KV heads, each head keeping at least α × heavy — heads end up with different "
                               "cache lengths. PyramidKV (Cai et al. 2024; kvpress PyramidKVPress): layer budgets "
                               "falling linearly from the lowest layer to the highest, the same total.")
    if allocation == "adakv":
        w_number(where, "ada_alpha", "AdaKV safeguard α (share of heavy each head keeps)", 0.0, 1.0, step=0.05,
                 fmt="%.2f", help="kvpress alpha_safeguard, 0.2 by default.")
    if allocation == "pyramid":
        w_number(where, "pyr_beta", "PyramidKV β (slope; 1 = flat)", 1.0, 1000.0, step=1.0,
                 help="Top layer heavy/β, bottom layer 2·heavy − heavy/β (kvpress β = 20).")
    if scorer == "expected_attention":
        w_number(where, "ea_horizon", "Expected Attention horizon (future positions)", 1, 100_000, step=64,
                 help="The query statistics are rotated by the RoPE rotation averaged over this many positions "
                      "after the context (kvpress n_future_positions 512). No effect on traces without RoPE.")
        w_check(where, "ea_cov", "Use the queries' covariance (not only their mean)")
    if scorer == "chunkkv":
        w_number(where, "chunk", "ChunkKV chunk size (tokens)", 1, 4096, help="kvpress chunk_length 20.")
        w_choice(where, "chunk_scorer", "ChunkKV token scorer", ("snapkv", "expected_attention", "keydiff", "knorm",
                                                                "h2o", "random"), format_func=SCORER_SHORT.get)
    if scorer == "quest":
        w_number(where, "page", "Quest page size (tokens)", 1, 4096, help="Quest's default is 16.")
