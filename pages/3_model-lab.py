"""Model lab: run a real model with the compressed KV cache and compare its text with the full cache's."""

import time
from contextlib import nullcontext

import streamlit as st

from kvviz.decode import lab, labsettings, labstore

from kvviz.app.charts import chart
from kvviz.app.cards import fmt_bytes, fmt_exact, fmt_pct
from kvviz.app.compression import compression_section
from kvviz.app.device import device_controls, run_notice
from kvviz.app.guard import other_runs
from kvviz.app.layout import page_setup
from kvviz.app.router import run_page
from kvviz.app.presets import preset_buttons
from kvviz.app.store import show_notices, state, w_check, w_choice, w_number, w_text

from kvviz.app import sources as ui_sources
from kvviz.plots import style
from kvviz.plots.decode import continuation_html, kl_strip, nll_chart
from kvviz.decode.quality import QUESTION_POINTS, sample_text
from kvviz.spec import SpecError
from kvviz.trace import Trace
from kvviz.app.sources import EXAMPLE_PROMPT, shared_model

TEXTS = {"sample": sample_text, "bakery": lambda: EXAMPLE_PROMPT, "custom": None}
TEXT_LABELS = {
    "sample": "kvviz sample text (built-in)",
    "bakery": "Bakery story (built-in)",
    "custom": "Your own text",
}
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


@st.cache_resource(show_spinner=False)
def _results(folder: str) -> dict:
    """Finished runs, shared by every session (a run's progress widgets are not replayed), per results
    folder (labstore.lab_cache_dir()): a run stored under another folder is not this server's."""
    return {}


def _remember(key: tuple, result: labstore.LabResult) -> None:
    cache = _results(str(labstore.lab_cache_dir()))
    if len(cache) >= 32:
        cache.pop(next(iter(cache)))
    cache[key] = result


def _label(info, name: str) -> str:
    label = getattr(info, "label", getattr(info, "name", name))
    return label() if callable(label) else label


def _estimate_text(settings: labsettings.LabSettings) -> str:
    median, runs = labstore.recent_runs(settings)
    seconds = (
        median
        if median is not None
        else labstore.step_estimate(settings, full_cached=_full_cached(settings))
    )
    others = other_runs()
    busy = (
        f" The server is busy ({others} other run{'s' if others > 1 else ''} in progress or waiting), so this "
        "one may take longer."
        if others
        else ""
    )
    if seconds is None:
        return "The first run also measures how long a step takes here." + busy
    basis = (
        f"the median of the last {runs} run{'s' if runs > 1 else ''} of this size on this server"
        if runs
        else "from the step time measured here"
    )
    return (
        f"About {max(1, round(seconds))} s ({basis}), "
        + (
            "one masked pass for the scored tokens."
            if labsettings.one_pass(settings.spec)
            else f"step by step for the scored tokens ({settings.spec.scorer} decides at every step)."
        )
        + busy
    )


def _full_cached(settings: labsettings.LabSettings) -> bool:
    loaded = ui_sources.loaded_model(settings.model, settings.device, settings.dtype)
    return loaded is not None and lab.full_cached(loaded[0], loaded[1], settings)


def _run_live(settings: labsettings.LabSettings) -> labstore.LabResult:
    """Run with progress, the greedy texts streaming in as they are produced, and a cancel button."""
    cancel = st.empty()  # gone with the run, whether it finishes or fails
    cancel.button(
        "Cancel",
        key="lab_cancel",
        icon=":material/stop_circle:",
        help="Stops the run at the next token; nothing is kept.",
    )
    with st.status("Running the model…", expanded=True) as status:
        try:
            result = _decode(settings)
        except Exception:
            status.update(label="The run stopped", state="error", expanded=False)
            cancel.empty()
            raise
        status.update(label=f"Finished in {result.seconds:.1f} s", state="complete", expanded=False)
    cancel.empty()
    return result


def _decode(settings: labsettings.LabSettings) -> labstore.LabResult:
    """The run inside _run_live's status box: its progress bar and line, the two texts side by side."""
    bar = st.progress(0.0)
    line = st.empty()
    t0 = time.perf_counter()
    expected = labstore.estimate(settings, full_cached=_full_cached(settings))

    def progress(f: float, msg: str) -> None:
        bar.progress(min(max(float(f), 0.0), 1.0))
        took = time.perf_counter() - t0
        left = (
            f" · about {max(1, round(expected - took))} s left"
            if expected and expected > took
            else ""
        )
        line.caption(f"{msg} · {took:.0f} s{left}")

    progress(0.0, "Loading the model (read from the weights cache after the first conversion)…")
    model, tokenizer, info = shared_model(
        settings.model,
        settings.device,
        settings.dtype,
        progress=lambda f, m: progress(0.0, f"Loading the model: {m}"),
    )
    a, b = st.columns(2)
    full_box, comp_box = a.empty(), b.empty()
    full_toks: list[str] = []
    comp_toks: list[str] = []

    def stream(box, toks, title):
        def on_token(i: int, tok: int) -> None:
            toks.append(tokenizer.decode([tok]))
            box.html(continuation_html(toks, None, title))

        return on_token

    result = lab.run(
        model,
        tokenizer,
        _label(info, settings.model),
        settings,
        progress=progress,
        on_full_token=stream(full_box, full_toks, "Full cache"),
        on_token=stream(comp_box, comp_toks, f"Compressed: {settings.spec.label()}"),
    )
    return result


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
    spec = compression_section(
        _slider_trace(), percent_of=(int(state()["lab_prompt"]), "prompt tokens")
    )
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
        with (
            st.container(height=120) if present else st.expander("The text")
        ):  # expanders do not nest
            st.write(text)
    c1, c2, c3 = st.columns(3)
    prompt_tokens = int(
        w_number(c1, "lab_prompt", "Prompt tokens (compression point)", 8, MAX_PROMPT, step=8)
    )
    continuation = int(w_number(c2, "lab_cont", "Continuation tokens scored", 2, MAX_CONTINUATION))
    greedy_tokens = int(
        w_number(c3, "lab_greedy", "Greedy tokens side by side (0 = off)", 0, MAX_GREEDY)
    )
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
    preset_buttons(
        prompt_tokens
    )  # budgets sized to this prompt (the sidebar keeps the explorer's values)
    return text, prompt_tokens, continuation, greedy_tokens, question, point, rerotate


def _done(settings) -> dict:
    """The results this server holds (key -> LabResult), the default settings' precomputed one among them
    (by `make venv` or the first start) where it is on disk."""
    done = _results(str(labstore.lab_cache_dir()))
    key = settings.key()
    if key not in done and key == labsettings.default_settings().key():
        stored = labstore.load_result(settings)
        if stored is not None:
            done[key] = stored
    return done


def _run_or_say(settings):
    """The run, kept for this server; or None with one line that says why it did not run (the settings, a
    model that does not load, out of GPU or host memory, a device gone): the server keeps serving."""
    from kvviz.models import ModelError

    try:
        result = _run_live(settings)
    except SpecError as e:
        st.error(f"Cannot run: {e}")
        return None
    except (ModelError, OSError) as e:
        st.error(f"The model could not be loaded: {e}")
        return None
    except Exception as e:
        notice = run_notice(e)
        if notice is None:
            raise
        st.error(f"The run stopped: {notice}.")
        return None
    _remember(settings.key(), result)
    return result


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
        + (
            ""
            if spec.evicts or spec.quantizes
            else " — set a budget or bits in the sidebar to compress."
        )
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
    done = _done(settings)
    c_run, c_est = st.columns([1, 3])
    clicked = c_run.button(
        "Run the model" if key not in done else "Run again (live)",
        type="primary",
        key="lab_run",
        help="Loads the model on first use, then decodes with the full and the compressed cache.",
    )
    c_est.caption(_estimate_text(settings))
    status_line = ui_sources.model_status(model_name)
    if status_line and not clicked:
        st.caption(status_line)
    if st.session_state.get("lab_cancel"):
        st.warning(
            "Run cancelled: nothing was kept. Press **Run the model** to start again.",
            icon=":material/stop_circle:",
        )
    if not clicked and key not in done:
        st.info(
            "Nothing has run yet for these settings: press **Run the model**. The model loads only then.",
            icon=":material/play_circle:",
        )
        return
    result = _run_or_say(settings) if clicked else done[key]
    if result is None:
        return
    if result.precomputed:
        st.caption(
            "Precomputed for the default settings (at install or on the first start); "
            "**Run again (live)** recomputes it now."
        )
    show(result, present)


def show(result: labstore.LabResult, present: bool = False) -> None:
    """The result: how it was scored, the cards, the per-token KL, the greedy texts side by side, the
    per-token log-loss and every number. Presentation mode: the KL strip and the texts first, larger."""
    q, pair = result.quality, result.pair
    if present:
        chart(style.projector(kl_strip(q.tokens, q.kl), height=260), key="lab_kl_strip")
        greedy(pair, q)
        about(result)
        cards(q)
    else:
        about(result)
        cards(q)
        chart(kl_strip(q.tokens, q.kl), key="lab_kl_strip")
        greedy(pair, q)
    chart(nll_chart(q.tokens, q.nll, q.nll_full), key="lab_nll")
    with st.expander("All numbers"):
        st.dataframe(
            [
                {"metric": k, "value": fmt_exact(v) if isinstance(v, float) else str(v)}
                for k, v in q.as_dict().items()
            ],
            hide_index=True,
            key="lab_numbers",
        )


def about(result: labstore.LabResult) -> None:
    """What was scored: the model, the prompt and the continuation (and a text too short for the prompt)."""
    d = result.quality.as_dict()
    where = (
        "the first is predicted by the prefill, before compression"
        if d["compressed_at"] == d["prompt_tokens"]
        else f"the cache was compressed at token {d['compressed_at']}, before the question's "
        f"{d['question_tokens']} tokens, which were then read through it"
    )
    question = (
        f", the last {d['question_tokens']} of them the question" if d["question_tokens"] else ""
    )
    st.caption(
        f"{result.model}: {d['prompt_tokens']}-token prompt{question}, {d['continuation_tokens']} continuation "
        f"tokens scored (teacher-forced; {where})."
    )
    if result.asked is not None:  # the text was shorter than the prompt asked for (fit_to_text)
        context = d["prompt_tokens"] - d["question_tokens"]
        st.info(
            f"This text has {context + d['continuation_tokens']} tokens, too few for a "
            f"{result.asked.prompt_tokens}-token prompt: its first {context} were the prompt and the next "
            f"{d['continuation_tokens']} were scored. Set **Prompt tokens** to {context} or fewer to choose "
            "the split yourself, or pick a longer text.",
            icon=":material/content_cut:",
        )


def cards(q) -> None:
    """Perplexity with and without compression, next-token KL, top-1 agreement and the cache's bytes."""
    m = st.columns(3) + st.columns(3)[:2]  # five cards in one row are cut at a projector's 1024 px
    m[0].metric(
        "Perplexity (compressed)",
        f"{q.perplexity:.2f}",
        delta=f"{q.perplexity - q.perplexity_full:+.2f}",
        delta_color="inverse",
        border=True,
        help="exp(mean −log p̂) of the true continuation tokens.",
    )
    m[1].metric("Perplexity (full cache)", f"{q.perplexity_full:.2f}", border=True)
    m[2].metric(
        "Next-token KL",
        f"{q.kl_mean:.3f}",
        border=True,
        help=f"KL(full ‖ compressed) between the two caches' next-token distributions over the vocabulary, "
        f"mean over the scored tokens, nats (max {q.kl_max:.3f}). Not the Explorer's attention KL, "
        "which compares attention rows.",
    )
    m[3].metric(
        "Top-1 agreement",
        fmt_pct(q.top1_agreement),
        border=True,
        help="Share of steps where both caches rank the same next token first.",
    )
    m[4].metric(
        "KV cache",
        fmt_bytes(q.kv_bytes),
        border=True,
        help=f"{q.compression_ratio:.2f}× smaller than the full 16-bit cache "
        f"({fmt_bytes(q.kv_bytes_full)}); {q.kept_tokens} of {q.total_tokens} tokens kept.",
    )


def greedy(pair, q) -> None:
    """The two caches' greedy continuations side by side, from their first divergence on shaded."""
    if pair is not None:
        st.subheader("Greedy continuation, side by side")
        if pair.first_divergence is None:
            st.success(f"Identical for all {len(pair.full_ids)} tokens.", icon=":material/check:")
        else:
            st.caption(
                f"First divergence at token {pair.first_divergence} (marked); the text after it is "
                "shaded. Token 0 comes from the prefill, before compression, so it always agrees."
            )
        a, b = st.columns(2)
        a.html(continuation_html(pair.full_tokens, pair.first_divergence, "Full cache"))
        b.html(
            continuation_html(
                pair.compressed_tokens, pair.first_divergence, f"Compressed: {q.spec.label()}"
            )
        )


run_page(main)
