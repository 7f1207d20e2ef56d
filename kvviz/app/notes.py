"""What the numbers alone do not say: the quantization model, warnings on budgets and groups, and notes
on what the chosen scorer keeps and why."""

from __future__ import annotations

import streamlit as st

from kvviz.app.compute import Source
from kvviz.analysis.readout import (  # noqa: F401 (the pages read these here)
    budget_warnings,
    no_eviction_note,
    quant_warnings,
)
from kvviz.app.store import state
from kvviz.spec import Spec
from kvviz.trace import Trace


def quant_model_note(source: Source, spec: Spec) -> str:
    if spec.quant_model == "noise":
        return (
            f"Quantization model: the handbook's logit-noise stand-in (logits + σ·ε, σ = {spec.noise_sigma:g}); "
            "the bits set the memory only."
        )
    now = "off (16 bits)" if not spec.quantizes else f"K {spec.key_bits}-bit / V {spec.value_bits}-bit"
    if spec.quantizes and (spec.key_format != "int" or spec.value_format != "int" or spec.rotate != "none"):
        from kvviz.quant.formats import format_label

        now = (
            f"K {format_label(spec.key_format, spec.key_bits)} / V {format_label(spec.value_format, spec.value_bits)}"
            + ("" if spec.rotate == "none" else ", Hadamard-rotated " + spec.rotate.replace("-", " and "))
        )
    return f"Quantization model: {source.quant_note_kv}; now {now}."


def quant_scope_note(spec: Spec) -> str | None:
    """One plain sentence: which keys and values the bits slider reaches, and how they are grouped."""
    if spec.quant_model != "kv" or spec.key_format != "int" or spec.value_format != "int":
        return None
    along = {"channel": "along each channel", "token": "along each token"}
    short = (
        "a group the kept tokens do not fill is quantized too"
        if spec.partial == "quantize"
        else "a group the kept tokens do not fill stays at 16 bits, as in KIVI"
    )
    residual = f", except the last {spec.residual} tokens, kept at 16 bits" if spec.residual else ""
    return (
        f"The bits slider quantizes every kept key (groups of {spec.group_size} {along[spec.key_axis]}) and "
        f"value (groups of {spec.group_size} {along[spec.value_axis]}){residual}; {short}."
    )


def _quantize_partial_groups() -> None:
    state()["partial"] = st.session_state["partial"] = "quantize"


def quant_warning_box(spec: Spec, kept: int) -> None:
    """The warnings above, with a one-click way out."""
    for w in quant_warnings(spec, kept):
        st.warning(w, icon=":material/warning:")
    if quant_warnings(spec, kept):
        st.button("Quantize the partial groups too", key="_fix_partial", on_click=_quantize_partial_groups)


def scorer_note(spec: Spec, trace: Trace | None = None) -> str | None:
    """What the chosen scorer keeps and why, where the sliders alone do not say it."""
    if not spec.evicts:
        return None
    from kvviz.policies import get_policy

    own = get_policy(spec.scorer).note(spec, trace)
    alloc = allocation_note(spec)
    text = " ".join(x for x in (own, alloc) if x)
    return text or None


def allocation_note(spec: Spec) -> str | None:
    """What an allocation does to the budget (AdaKV, PyramidKV)."""
    floor = (
        f"each head first keeps its top {int(spec.budget * spec.adakv_alpha)} tokens, sinks and window "
        "first, as kvpress"
        if spec.adakv_floor == "all"
        else f"each head at least {int(spec.adakv_alpha * spec.heavy)} heavy hitters beside sinks and window"
    )
    pyramid = (
        "each layer keeps its own total, falling linearly with depth as kvpress's PyramidKVPress computes it "
        f"(β {spec.pyramid_beta:g}; a short prompt's top layer keeps its window alone, and where kvpress's "
        "schedule does not fit the prompt every layer keeps the uniform budget)"
        if spec.pyramid_schedule == "kvpress"
        else f"each layer has its own heavy budget, falling linearly with depth (β {spec.pyramid_beta:g}), the "
        f"same total as {spec.heavy} per layer"
    )
    alloc = {
        "adakv": f" AdaKV: this layer's {spec.budget} × KV-heads token slots go to the top scores across its "
        f"heads ({floor}), so heads hold different numbers of tokens — the Budget ledger below lists "
        "each head.",
        "pyramid": f" PyramidKV: {pyramid} — see the Budget ledger.",
    }.get(spec.allocation, "")
    return alloc.strip() or None


@st.cache_resource(max_entries=16, show_spinner=False)
def _fp8_clipping(source_key: tuple, spec: Spec, step: int | None, _trace: Trace) -> str | None:
    from kvviz.analysis.readout import fp8_clipping, fp8_clipping_note

    return fp8_clipping_note(fp8_clipping(_trace, spec, step))


def fp8_note(source: Source, spec: Spec, step: int | None = None) -> str | None:
    """Static FP8 (vLLM's k_scale / v_scale): how many stored values saturated or flushed to zero."""
    if spec.quant_model != "kv" or spec.fp8_scale != "static":
        return None
    return _fp8_clipping(source.key, spec, step, source.trace)
