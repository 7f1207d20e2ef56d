"""Model lab: run a real model with the compressed KV cache and compare its text with the full cache's."""

from contextlib import nullcontext

import streamlit as st

from kvviz.decode import labsettings

from kvviz.app.compression import compression_section
from kvviz.app.device import device_controls
from kvviz.app.layout import page_setup
from kvviz.app.modellab import results_held, estimate_text, run_or_say, show
from kvviz.app.router import run_page
from kvviz.app.presets import preset_buttons
from kvviz.app.store import show_notices, state, w_check, w_choice, w_number, w_text

from kvviz.app import sources as ui_sources
from kvviz.decode.quality import QUESTION_POINTS, sample_text
from kvviz.trace import Trace
from kvviz.app.sources import EXAMPLE_PROMPT

TEXTS = {"sample": sample_text, "bakery": lambda: EXAMPLE_PROMPT, "custom": None}
TEXT_LABELS = {"sample": "kvviz sample text (built-in)", "bakery": "Bakery story (built-in)", "custom": "Your own text"}
POINT_LABELS = {
    "before-question": "Before the question (query-agnostic, kvpress's pipeline default)",
    "after-question": "After the question (query-aware: the scorer sees it)",
}
POSITION_TEXT = {
    "true": "every token at its true position (kvpress)",
    "cache": "kept keys re-rotated to their cache slots (the original StreamingLLM)",
}

# Caps that keep one run under about a minute on a classroom laptop's CPU.
MAX_PROMPT = 512
MAX_CONTINUATION = 128
MAX_GREEDY = 64
CAP_MESSAGE = (
    f"Lengths are capped (prompt ≤ {MAX_PROMPT} tokens, continuation ≤ {MAX_CONTINUATION}, greedy "
    f"≤ {MAX_GREEDY}) so a run on a laptop CPU takes seconds, not minutes. For longer texts use "
    "`kvviz eval --text-file F --prompt-tokens N` on the command line."
)


def _slider_trace() -> Trace:
    """A stand-in with as many positions as the longest run, so the sidebar sliders get their range."""
    return Trace.placeholder(MAX_PROMPT + MAX_CONTINUATION, "model lab")


def main() -> None:
    present = page_setup(
        "Model lab: what compression does to the text",
        "A real model (SmolLM2-135M, bundled) reads the prompt, the cache is compressed at the end "
        "of it, and every later token is decoded from the compressed cache at its true position. "
        "Quality is measured against the full cache on the same text.",
    )
    st.sidebar.header("Model")
    model_name = (
        st.sidebar.text_input(
            "Model",
            "bundled",
            key="lab_model",
            help="'bundled' (SmolLM2-135M, offline), a local model folder or .gguf "
            "file, or a hub id where a hub is reachable.",
        ).strip()
        or "bundled"
    )
    device, dtype = device_controls(st.sidebar, "lab")
    # budgets typed in % are shares of the prompt (the cache at the compression point), not of the sliders' range
    spec = compression_section(_slider_trace(), percent_of=(int(state()["lab_prompt"]), "prompt tokens"))
    show_notices()
    # Presentation mode: the run and its result first, on the projector's first screen; the text and the
    # run's settings folded below it
    results = st.container() if present else nullcontext()
    with st.expander("Text and run settings", icon=":material/tune:") if present else nullcontext():
        run_settings = _run_settings(present)
    with results:
        _run_and_show(model_name, device, dtype, spec, *run_settings, present)


def _run_settings(present: bool) -> tuple:
    """The text and the run's lengths, question and positions (widgets; in the link but your own text):
    (text, prompt_tokens, continuation, greedy_tokens, question, point, rerotate), as _run_and_show takes them."""
    choice = w_choice(
        st,
        "lab_text",
        "Text",
        tuple(TEXTS),
        widget="radio",
        format_func=TEXT_LABELS.get,
        help="A built-in text (kept in the page's link) or your own (not put in the link).",
    )
    if choice == "custom":
        text = st.text_area(
            "Your text (the prompt is its first tokens, the continuation the next ones)",
            sample_text(),
            height=160,
            key="lab_custom_text",
        )
    else:
        text = TEXTS[choice]()
        with st.container(height=120) if present else st.expander("The text"):  # expanders do not nest
            st.write(text)
    c1, c2, c3 = st.columns(3)
    prompt_tokens = int(w_number(c1, "lab_prompt", "Prompt tokens (compression point)", 8, MAX_PROMPT, step=8))
    continuation = int(w_number(c2, "lab_cont", "Continuation tokens scored", 2, MAX_CONTINUATION))
    greedy_tokens = int(w_number(c3, "lab_greedy", "Greedy tokens side by side (0 = off)", 0, MAX_GREEDY))
    question = w_text(
        st,
        "lab_question",
        "Question after the prompt (optional)",
        placeholder="e.g. Who runs the bakery?",
        help="Splits the text into a context and a question: the prompt's tokens are the context, the "
        "question follows as a paragraph of its own, and the continuation scored is the text's "
        "next tokens; the greedy texts answer it. Empty: no question.",
    ).strip()
    point = w_choice(
        st,
        "lab_point",
        "Compress the cache",
        QUESTION_POINTS,
        widget="radio",
        format_func=POINT_LABELS.get,
        disabled=not question,
        help="Before the question: the context is compressed without knowing what will be asked, "
        "then the question is read through the compressed cache (kvpress's pipeline). After "
        "the question: the scorer sees the question's own queries, which favours methods such "
        "as SnapKV (kvpress reports such runs separately). Applies when there is a question.",
    )
    rerotate = w_check(
        st,
        "lab_rerotate",
        "Re-rotate kept keys to their cache slots (StreamingLLM's original)",
        help="Off (default, as kvpress does): every token keeps its true position, so RoPE "
        "distances stay right however many tokens were evicted. On: as the original "
        "StreamingLLM, the kept keys are re-rotated to their slot in the compressed cache "
        "and the query to its own slot, so distances shrink to the cache's.",
    )
    st.caption(CAP_MESSAGE)
    preset_buttons(prompt_tokens)  # budgets sized to this prompt (the sidebar keeps the explorer's values)
    return text, prompt_tokens, continuation, greedy_tokens, question, point, rerotate


def _runnable(spec, text: str) -> bool:
    """False, with what to change, for the logit-noise model (attention rows only) or an empty text."""
    if spec.quant_model == "noise":
        st.error(
            "The handbook's logit-noise model only stands in for attention rows; on a real model the "
            "cached keys and values are quantized for real. Switch *Quantization model* to real K/V "
            "quantization under Advanced."
        )
        return False
    if not text.strip():
        st.warning("Enter some text first.", icon=":material/warning:")
        return False
    return True


def _run_and_show(
    model_name,
    device,
    dtype,
    spec,
    text,
    prompt_tokens,
    continuation,
    greedy_tokens,
    question,
    point,
    rerotate,
    present: bool,
) -> None:
    """What the settings compress, the Run button, and the result (the stored one where it exists)."""
    if spec is None or not _runnable(spec, text):
        return
    if rerotate:
        spec = spec.with_(positions="cache")
    st.markdown(
        f"**Compression:** {spec.label()}"
        + ("" if spec.evicts or spec.quantizes else " — set a budget or bits in the sidebar to compress.")
        + f"  \n**Positions:** {POSITION_TEXT[spec.positions]}"
        + (f"  \n**Compressed:** {POINT_LABELS[point].lower()}" if question else "")
    )

    settings = labsettings.LabSettings(
        model_name,
        text,
        prompt_tokens,
        continuation,
        greedy_tokens,
        spec,
        device,
        dtype,
        question=question,
        question_point=point,
    )
    key = settings.key()
    done = results_held(settings)
    c_run, c_est = st.columns([1, 3])
    clicked = c_run.button(
        "Run the model" if key not in done else "Run again (live)",
        type="primary",
        key="lab_run",
        help="Loads the model on first use, then decodes with the full and the compressed cache.",
    )
    c_est.caption(estimate_text(settings))
    status_line = ui_sources.model_status(model_name)
    if status_line and not clicked:
        st.caption(status_line)
    if st.session_state.get("lab_cancel"):
        st.warning(
            "Run cancelled: nothing was kept. Press **Run the model** to start again.", icon=":material/stop_circle:"
        )
    if not clicked and key not in done:
        st.info(
            "Nothing has run yet for these settings: press **Run the model**. The model loads only then.",
            icon=":material/play_circle:",
        )
        return
    result = run_or_say(settings) if clicked else done[key]
    if result is None:
        return
    if result.precomputed:
        st.caption(
            "Precomputed for the default settings (at install or on the first start); "
            "**Run again (live)** recomputes it now."
        )
    show(result, present)


run_page(main)
