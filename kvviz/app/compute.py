"""The core's calls through Streamlit's caches: compare, sweep, concentration, the head grid.

A `Source` is a trace with a hashable identity (`key`): the caches key on it instead of hashing
the arrays. Impossible settings show an error and give None; numerics stay in the core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import streamlit as st

from kvviz.engine import Comparison, compare
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import Trace, TraceError


@dataclass(frozen=True, eq=False)
class Source:
    key: tuple                   # hashable identity for the caches
    trace: Trace
    label: str
    seed_fn: Callable[[int], Trace] | None = None
    quant_note_kv: str = "real K/V quantization of the cached keys and values"


def _items(obj) -> tuple:
    return tuple(sorted(asdict(obj).items()))


@st.cache_data(max_entries=64, show_spinner=False)
def _compare_cached(source_key: tuple, spec_items: tuple, view_items: tuple,
                    _trace: Trace, _seed_fn) -> Comparison:
    return compare(_trace, Spec(**dict(spec_items)), View(**dict(view_items)), trace_for_seed=_seed_fn)


@st.cache_resource(show_spinner="Compiling the quantization kernel (once after an install)…")
def _quantization_kernel() -> bool:
    from kvviz.quant import compile_kernel
    compile_kernel()
    return True


def run_compare(source: Source, spec: Spec, view: View) -> Comparison | None:
    """kvviz.compare through the cache; impossible settings show an error and give None."""
    if spec.quantizes and spec.quant_model == "kv":
        _quantization_kernel()
    try:
        return _compare_cached(source.key, _items(spec), _items(view), source.trace, source.seed_fn)
    except (SpecError, TraceError, ValueError) as e:
        st.error(f"Cannot compare with these settings: {e}. Change the View or Compression settings in the sidebar.")
        return None


@st.cache_resource
def _sweep_results() -> dict:
    """Sweeps shared across sessions. Not st.cache_data: the sweep drives a progress bar,
    and Streamlit cannot replay elements created outside a cached function."""
    return {}


def run_sweep(source: Source, scorers: tuple, bits: tuple, view: View, base: Spec,
              max_entries: int = 16, formats: tuple = ()) -> list[dict] | None:
    """kvviz.analysis.sweep with a progress bar, cached by (source, methods, bits, formats, view, base spec)."""
    from kvviz.analysis.sweep import sweep
    key = (source.key, tuple(scorers), tuple(bits), _items(view), _items(base)) + ((tuple(formats),) if formats else ())
    results = _sweep_results()
    if key in results:
        return results[key]
    bar = st.progress(0.0, text="Sweeping budgets and bit widths…")
    try:
        rows = sweep(source.trace, scorers=scorers, bits=bits, view=view, base=base,
                     progress=lambda f, text: bar.progress(min(1.0, f), text=f"Sweeping: {text}"), formats=formats)
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
def _head_grid_cached(source_key: tuple, spec_items: tuple, step: int | None, metric: str,
                      _trace: Trace) -> np.ndarray:
    from kvviz.engine import head_grid
    return head_grid(_trace, Spec(**dict(spec_items)), step, metric)


def run_head_grid(source: Source, spec: Spec, step: int | None, metric: str) -> np.ndarray:
    """kvviz.engine.head_grid through the cache: the metric for every layer and query head."""
    return _head_grid_cached(source.key, _items(spec), step, metric, source.trace)
