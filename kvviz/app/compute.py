"""The core's calls through Streamlit's caches: compare, sweep, concentration, the head grid.

A `Source` is a trace with a hashable identity (`key`): the caches key on it instead of hashing
the arrays. Impossible settings show an error and give None; numerics stay in the core.
"""

from __future__ import annotations

import gc
import importlib
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import streamlit as st

from kvviz.engine import Comparison, compare
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import Trace, TraceError


@dataclass(frozen=True, eq=False)
class Source:
    key: tuple  # hashable identity for the caches
    trace: Trace
    label: str
    seed_fn: Callable[[int], Trace] | None = None
    quant_note_kv: str = "real K/V quantization of the cached keys and values"


def _items(obj) -> tuple:
    return tuple(sorted((obj.as_dict() if isinstance(obj, Spec) else asdict(obj)).items()))


def _key(source: Source, *settings) -> str:
    """One string that names a cached call: the source's key and each Spec / View's settings, as text.
    Streamlit's cache hashes its arguments object by object (about 150 objects for a source, a spec and a
    view: 2.5 ms of every slider move); one string is one object. repr of ints, floats, strings, None and
    tuples of them is exact, so two calls share a key only when their settings are the same."""
    return repr((source.key, *(_items(s) for s in settings)))


@st.cache_data(max_entries=64, show_spinner=False)
def _compare_cached(key: str, _trace: Trace, _spec: Spec, _view: View, _seed_fn) -> Comparison:
    return compare(_trace, _spec, _view, trace_for_seed=_seed_fn)


# --- warm before the first touch ---------------------------------------------------------------

# What a first move needs that the first paint does not: numba and the quantization kernel (compiled
# once after an install, loaded from numba's disk cache after that: 0.5-1.6 s in a fresh process), the
# analyses behind the Explorer's buttons and sections, the other pages' figure modules.
WARM_MODULES = (
    "kvviz.analysis.solve",
    "kvviz.analysis.ledger",
    "kvviz.analysis.sweep",
    "kvviz.plots.ledger",
    "kvviz.plots.quant",
    "kvviz.plots.decode",
    "kvviz.plots.needle",
    "kvviz.sources.synthetic",
    "kvviz.policies.registry",
    "kvviz.plots.lesson",
    "scipy.stats",
)
_warm_lock = threading.Lock()
_warmed: list[threading.Event] = []


def warm_up() -> threading.Event:
    """Start warming in a background thread, once per server process: the kernel, one small quantized
    comparison, the modules in WARM_MODULES. The event is set when it is done. Every page's head calls
    it, so it starts with the process's first page run (Streamlit runs no app code before the first
    browser session); on two cores it runs beside that run (measured: a faster first paint than
    warming after it, when it competes with the browser drawing the page). Not at import: a test that
    only imports kvviz.app starts nothing."""
    with _warm_lock:
        if not _warmed:
            _warmed.append(threading.Event())
            threading.Thread(target=_warm, args=(_warmed[0],), name="kvviz-warm-up", daemon=True).start()
        return _warmed[0]


def _warm(done: threading.Event) -> None:
    try:
        from kvviz.quant import compile_kernel
        from kvviz.sources.handbook import handbook_trace

        compile_kernel()
        comp = compare(handbook_trace(), Spec(key_bits=4, value_bits=4), View())
        _warm_figures(comp)
        for name in WARM_MODULES:
            importlib.import_module(name)
        # What is imported and built by now lives as long as the server: out of the garbage collector's
        # sight (Python's documented gc.freeze), each later collection walks only what runs create.
        gc.freeze()
    except Exception:  # noqa: BLE001 - a failed warm-up only means the first move does this work itself
        pass
    finally:
        done.set()


def _warm_figures(comp: Comparison) -> None:
    """Build and serialise the Explorer's two charts once, as st.plotly_chart does: plotly imports each
    trace's and layout's validators on first use (~0.2 s on two cores), which the first page run paid."""
    import plotly.io

    from kvviz.analysis.frames import token_frame
    from kvviz.plots import figures

    frame = token_frame(comp)
    for fig in (figures.attention_figure(frame), figures.error_figure(frame, members=len(comp.members))):
        plotly.io.to_json(fig, validate=False)


def run_compare(source: Source, spec: Spec, view: View) -> Comparison | None:
    """kvviz.compare through the cache; impossible settings show an error and give None."""
    if spec.quantizes and spec.quant_model == "kv":
        warm_up().wait()  # usually long done; never a "compiling" spinner on a slider move
    try:
        return _compare_cached(_key(source, spec, view), source.trace, spec, view, source.seed_fn)
    except (SpecError, TraceError, ValueError) as e:
        st.error(f"Cannot compare with these settings: {e}. Change the View or Compression settings in the sidebar.")
        return None


@st.cache_resource
def _sweep_results() -> dict:
    """Sweeps shared across sessions. Not st.cache_data: the sweep drives a progress bar,
    and Streamlit cannot replay elements created outside a cached function."""
    return {}


def run_sweep(
    source: Source, scorers: tuple, bits: tuple, view: View, base: Spec, max_entries: int = 16, formats: tuple = ()
) -> list[dict] | None:
    """kvviz.analysis.sweep with a progress bar, cached by (source, methods, bits, formats, view, base spec)."""
    from kvviz.analysis.sweep import sweep

    key = (source.key, tuple(scorers), tuple(bits), _items(view), _items(base)) + ((tuple(formats),) if formats else ())
    results = _sweep_results()
    if key in results:
        return results[key]
    bar = st.progress(0.0, text="Sweeping budgets and bit widths…")
    try:
        rows = sweep(
            source.trace,
            scorers=scorers,
            bits=bits,
            view=view,
            base=base,
            progress=lambda f, text: bar.progress(min(1.0, f), text=f"Sweeping: {text}"),
            formats=formats,
        )
    except (SpecError, TraceError, ValueError) as e:
        st.error(f"The sweep failed: {e}. Change the methods, bits or View settings.")
        return None
    finally:
        bar.empty()
    while len(results) >= max_entries:
        results.pop(next(iter(results)))
    results[key] = rows
    return rows


@st.cache_data(max_entries=16, show_spinner=False)
def _concentration_cached(source_key: tuple, step: int | None, sink: int, window: int, _trace: Trace):
    from kvviz.analysis.frames import concentration

    return concentration(_trace, step=step, sink=sink, window=window)


def run_concentration(source: Source, step: int | None, sink: int, window: int):
    return _concentration_cached(source.key, step, sink, window, source.trace)


@st.cache_data(max_entries=32, show_spinner="Computing every layer and head…")
def _head_grid_cached(key: str, step: int | None, metric: str, _trace: Trace, _spec: Spec) -> np.ndarray:
    from kvviz.engine import head_grid

    return head_grid(_trace, _spec, step, metric)


def run_head_grid(source: Source, spec: Spec, step: int | None, metric: str) -> np.ndarray:
    """kvviz.engine.head_grid through the cache: the metric for every layer and query head."""
    return _head_grid_cached(_key(source, spec), step, metric, source.trace, spec)
