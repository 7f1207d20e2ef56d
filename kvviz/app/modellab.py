"""The Model lab page's parts: a live run of the model (its progress, the two greedy texts streaming in
side by side, a Cancel button) and the one line that says why a run could not start; the runs this server
keeps for every session, the default settings' precomputed one among them; the line that says how long a
run will take; and a result's sections (what was scored, the cards, the per-token charts, the greedy
texts side by side).

The shared model is asked of `kvviz.app.sources` at the time of the run (`ui_sources.shared_model`), and
the run of `kvviz.decode.lab` (`lab.run`), so that what replaces them there (the tests' stand-ins) is what
the page runs.
"""

from __future__ import annotations

import time

import streamlit as st

from kvviz.app import sources as ui_sources
from kvviz.app.cards import fmt_bytes, fmt_exact, fmt_pct
from kvviz.app.charts import chart
from kvviz.app.device import run_notice
from kvviz.app.guard import other_runs
from kvviz.decode import lab, labsettings, labstore
from kvviz.plots import style
from kvviz.plots.decode import continuation_html, kl_strip, nll_chart
from kvviz.spec import SpecError


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


def estimate_text(settings: labsettings.LabSettings) -> str:
    median, runs = labstore.recent_runs(settings)
    seconds = median if median is not None else labstore.step_estimate(settings, full_cached=_full_cached(settings))
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
        left = f" · about {max(1, round(expected - took))} s left" if expected and expected > took else ""
        line.caption(f"{msg} · {took:.0f} s{left}")

    progress(0.0, "Loading the model (read from the weights cache after the first conversion)…")
    model, tokenizer, info = ui_sources.shared_model(
        settings.model, settings.device, settings.dtype, progress=lambda f, m: progress(0.0, f"Loading the model: {m}")
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


def results_held(settings) -> dict:
    """The results this server holds (key -> LabResult), the default settings' precomputed one among them
    (by `make venv` or the first start) where it is on disk."""
    done = _results(str(labstore.lab_cache_dir()))
    key = settings.key()
    if key not in done and key == labsettings.default_settings().key():
        stored = labstore.load_result(settings)
        if stored is not None:
            done[key] = stored
    return done


def run_or_say(settings):
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
            [{"metric": k, "value": fmt_exact(v) if isinstance(v, float) else str(v)} for k, v in q.as_dict().items()],
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
    question = f", the last {d['question_tokens']} of them the question" if d["question_tokens"] else ""
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
        b.html(continuation_html(pair.compressed_tokens, pair.first_divergence, f"Compressed: {q.spec.label()}"))
