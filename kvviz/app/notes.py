"""What the numbers alone do not say: the quantization model, warnings on budgets and groups, and notes
on what the chosen scorer keeps and why."""

from __future__ import annotations

import streamlit as st

from kvviz.app.compute import Source
from kvviz.analysis.readout import budget_warnings, quant_warnings  # noqa: F401 (app.py reads budget_warnings here)
from kvviz.app.store import state
from kvviz.spec import Spec
from kvviz.trace import Trace


def quant_model_note(source: Source, spec: Spec) -> str:
    if spec.quant_model == "noise":
        return (f"Quantization model: the handbook's logit-noise stand-in (logits + σ·ε, σ = {spec.noise_sigma:g}); "
                "the bits set the memory only.")
    now = "off (16 bits)" if not spec.quantizes else f"K {spec.key_bits}-bit / V {spec.value_bits}-bit"
    if spec.quantizes and (spec.key_format != "int" or spec.value_format != "int" or spec.rotate != "none"):
        from kvviz.spec import _format_label
        now = (f"K {_format_label(spec.key_format, spec.key_bits)} / V {_format_label(spec.value_format, spec.value_bits)}"
               + ("" if spec.rotate == "none" else ", Hadamard-rotated " + spec.rotate.replace("-", " and ")))
    return f"Quantization model: {source.quant_note_kv}; now {now}."


def quant_scope_note(spec: Spec) -> str | None:
    """One plain sentence: which keys and values the bits slider reaches, and how they are grouped."""
    if spec.quant_model != "kv" or spec.key_format != "int" or spec.value_format != "int":
        return None
    along = {"channel": "along each channel", "token": "along each token"}
    short = ("a group the kept tokens do not fill is quantized too" if spec.partial == "quantize" else
             "a group the kept tokens do not fill stays at 16 bits, as in KIVI")
    residual = f", except the last {spec.residual} tokens, kept at 16 bits" if spec.residual else ""
    return (f"The bits slider quantizes every kept key (groups of {spec.group_size} {along[spec.key_axis]}) and "
            f"value (groups of {spec.group_size} {along[spec.value_axis]}){residual}; {short}.")


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
    if spec.heavy > 0 and spec.scorer == "streaming":
        return ("StreamingLLM ranks tokens by position only, so the heavy-hitter budget simply widens the recent "
                "window; pick another scorer under Advanced to keep heavy hitters.")
    if spec.scorer == "snapkv" and trace is not None:
        c, w = trace.context_len, min(spec.observation_window, trace.context_len)
        return (f"SnapKV: the last {w} context queries (positions {c - w}–{c - 1}) are the observation window; "
                f"they vote with their attention, averaged and smoothed (pooling kernel {spec.snapkv_kernel}). "
                f"The window is kept as part of the recent window ({spec.recent} tokens); the {spec.heavy} heavy "
                f"hitters are the top-voted tokens before position {c - w}.")
    if spec.scorer == "oracle" and trace is not None and trace.group_size > 1:
        return (f"The oracle keeps one cache per KV head, chosen by the attention of all {trace.group_size} query "
                "heads that share it: it is the bound for the group's total attention mass, not for each query "
                "head on its own, so another policy can keep slightly more of this one head's mass.")
    if spec.scorer in ("h2o", "tova") and trace is not None and trace.has_later_queries:
        form = " divided by the queries that saw each token" if spec.h2o_normalized and spec.scorer == "h2o" else ""
        return (f"{'H2O' if spec.scorer == 'h2o' else 'TOVA'} decides again at every decode step{form}: the new "
                f"token arrives inside the budget, so each query attends over exactly {spec.budget} tokens "
                "(sink + recent + heavy), itself among them.")
    return new_scorer_note(spec, trace)


def new_scorer_note(spec: Spec, trace: Trace | None = None) -> str | None:
    """Issue #12: what Quest saves, what an allocation does, how the new scorers decide."""
    floor = (f"each head first keeps its top {int(spec.budget * spec.adakv_alpha)} tokens, sinks and window "
             "first, as kvpress" if spec.adakv_floor == "all" else
             f"each head at least {int(spec.adakv_alpha * spec.heavy)} heavy hitters beside sinks and window")
    pyramid = ("each layer keeps its own total, falling linearly with depth as kvpress's PyramidKVPress computes it "
               f"(β {spec.pyramid_beta:g}; a short prompt's top layer keeps its window alone, and where kvpress's "
               "schedule does not fit the prompt every layer keeps the uniform budget)"
               if spec.pyramid_schedule == "kvpress" else
               f"each layer has its own heavy budget, falling linearly with depth (β {spec.pyramid_beta:g}), the "
               f"same total as {spec.heavy} per layer")
    alloc = {"adakv": f" AdaKV: this layer's {spec.budget} × KV-heads token slots go to the top scores across its "
                      f"heads ({floor}), so heads hold different numbers of tokens — the Budget ledger below lists "
                      "each head.",
             "pyramid": f" PyramidKV: {pyramid} — see the Budget ledger."
             }.get(spec.allocation, "")
    what = {"quest": f"Quest keeps the whole cache plus each page's min / max keys (pages of {spec.page_size}); "
                     "this query reads only its top pages by the bound q·k ≤ Σ max(q·min, q·max)" + (
                         ", each query head its own (a KV head serves the union of its heads' pages)"
                         if spec.quest_heads == "query" else ", one choice per KV head") +
                     ", so it saves memory read per step, not memory stored (the memory card counts what is "
                     "stored).",
            "expected_attention": f"Expected Attention: the context queries' mean and covariance (before RoPE) "
                                  f"rotated over the next {spec.ea_horizon} positions give each key its expected "
                                  "attention, times its value norm; the first 4 tokens always rank first (kvpress).",
            "keydiff": "KeyDiff: keys least similar (cosine) to the mean of the context's normalised keys are kept; "
                       "no attention is needed.",
            "chunkkv": f"ChunkKV: chunks of {spec.chunk_size} tokens, ranked by the mean {spec.chunk_scorer} score "
                       "of their tokens summed over heads, are kept whole (one decision for every head)" + (
                           "; as kvpress, it keeps as many whole chunks as the budget's share of the chunks, so "
                           "the cache can hold fewer tokens than the budget (the memory card counts what it holds)."
                           if spec.chunk_rule == "chunks" else ", filling the heavy budget.")}.get(
        spec.scorer, "")
    text = (what + alloc).strip()
    return text or None
