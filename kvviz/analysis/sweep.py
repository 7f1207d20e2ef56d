"""Sweeps: many policies over many budgets and bit widths -> the data behind a trade-off curve."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Sequence

from kvviz.engine import compare, compare_work
from kvviz.limits import checkpoint
from kvviz.policies import get_policy
from kvviz.quant.formats import FORMAT_BITS, SERVING_FORMATS
from kvviz.settings import SETTINGS, shown
from kvviz.spec import FULL_BITS, SCORERS, Spec, SpecError, View
from kvviz.trace import Trace

DEFAULT_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
DEFAULT_BITS = (16, 8, 4, 2)
# Which metric of the engine each error column holds (kl: KL(compressed || original), finite), in the
# columns' order
METRIC_COLUMNS = {
    "mass_retained": "mass_retained",
    "tv": "tv_distance",
    "kl_compressed_vs_original": "kl",
    "js": "js",
    "output_error": "output_rel_error",
    "output_cosine": "output_cosine",
}
COLUMNS = (
    "method",
    "budget",
    "budget_fraction",
    "bits",
    "memory_ratio",
    "compression_ratio",
    *METRIC_COLUMNS,
    "memory_read_ratio",
    "saves",
    "format",
)
# Cache formats a sweep can add next to the integer bit widths: the quantizers' serving formats
# (kvviz.quant.formats), in their order; `bits` is their width.
SWEEP_FORMATS = {f: FORMAT_BITS[f] for f in SERVING_FORMATS}


def split_budget(scorer: str, budget: int, sink: int = 4) -> dict:
    """Sink / recent / heavy for a total token budget (the split rule of every sweep).

    Up to `sink` sinks, but at least one recent token (the query's own, which SnapKV's
    observation window also needs); StreamingLLM spends the rest on the recent window, the
    others split it evenly between recent window and heavy hitters (H2O's 10% + 10%), the
    odd token going to the heavy hitters.
    """
    sink = min(sink, max(0, budget - 1))
    rest = budget - sink
    if get_policy(scorer).window_only:
        return dict(sink=sink, recent=rest, heavy=0)
    recent = max(1, rest // 2) if rest else 0
    return dict(sink=sink, recent=recent, heavy=rest - recent)


def point_spec(method: str, budget: int, bits: int, fmt: str = "int", base: Spec = Spec()) -> Spec | None:
    """The spec of one sweep point: `method` ("full" = no eviction) at a token budget, K and V at
    `bits` in format `fmt`, the rest from `base`. None when the base's allocation has no such
    method (e.g. AdaKV with H2O / TOVA); SpecError when the point is impossible."""
    evict = {} if method == "full" else split_budget(method, budget)
    changes = dict(
        scorer=base.scorer if method == "full" else method,
        key_bits=bits,
        value_bits=bits,
        key_format=fmt,
        value_format=fmt,
        **({"sink": 0, "recent": 0, "heavy": 0} | evict),
    )
    # a setting of the base's scorer that this method does not take (merging, compress-every under H2O) is off
    values = {**base.__dict__, **changes}
    changes |= {
        name: s.default
        for name, s in SETTINGS.items()
        if s.owner and s.owner[0] == "scorer" and not shown(s, values) and values[name] != s.default
    }
    try:
        return base.with_(**changes)
    except SpecError:
        if base.allocation == "uniform":
            raise
        # raises if the allocation is not the reason
        base.with_(allocation="uniform", **changes)
        return None


def sweep(
    trace: Trace,
    scorers: Sequence[str] = SCORERS,
    fractions: Iterable[float] = DEFAULT_FRACTIONS,
    bits: Iterable[int] = DEFAULT_BITS,
    view: View = View(ensemble="heads"),
    base: Spec = Spec(),
    progress: Callable[[float, str], None] | None = None,
    formats: Iterable[str] = (),
) -> list[dict]:
    """One row per (method, budget, bits): memory ratio and errors averaged over the view's ensemble.

    `formats` (SWEEP_FORMATS: e4m3, e5m2, nvfp4, mxfp4, q8_0, q4_0, ...) add points in those cache formats, K
    and V alike, with the
    base spec's FP8 scale and rotation; their rows carry the format's width in `bits` and its name
    in `format` (integer rows: "int").

    A fraction of 1.0 means no eviction (the method column then reads "full") so the
    quantization-only points sit on the same chart.
    """
    n_tokens = int(trace.query_positions[trace.evaluated_queries[-1 if view.step is None else view.step]]) + 1
    fractions, bits = sorted(set(fractions)), list(bits)
    widths = [(b, "int") for b in bits] + [(SWEEP_FORMATS[f], f) for f in formats]
    jobs = []
    for f in fractions:
        budget = max(1, int(round(f * n_tokens)))
        methods = ["full"] if budget >= n_tokens else list(scorers)
        for method in methods:
            for b, fmt in widths:
                jobs.append((method, budget, f, b, fmt))
    # the peak of any job, before the first one runs
    compare_work(trace, True, view).check()
    rows = []
    for i, (method, budget, f, b, fmt) in enumerate(jobs):
        checkpoint()
        if progress:
            progress(
                i / len(jobs),
                f"{method} budget {budget} at {b} bits" if fmt == "int" else f"{method} budget {budget} in {fmt}",
            )
        spec = point_spec(method, budget, b, fmt, base)
        if spec is None:
            continue
        c = compare(trace, spec, view)
        m = c.metrics_mean
        rows.append(
            {
                "method": method,
                "budget": min(budget, n_tokens),
                "budget_fraction": f,
                "bits": b,
                "memory_ratio": c.memory.ratio,
                "compression_ratio": c.memory.compression_ratio,
                # eviction and quantization save memory stored; read-selection methods (Quest) store
                # everything and save memory read per step
                "memory_read_ratio": c.memory.bytes_read / c.memory.kv_bytes_full if c.memory.kv_bytes_full else 1.0,
                "saves": "memory read" if c.memory.kv_bytes_read is not None else "memory stored",
                **{column: m[key] for column, key in METRIC_COLUMNS.items()},
                "format": fmt,
            }
        )
    if progress:
        progress(1.0, "done")
    return rows


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    return buf.getvalue()


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (lower x, lower y), sorted by x (negate y for higher-is-better)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


__all__ = [
    "COLUMNS",
    "METRIC_COLUMNS",
    "DEFAULT_BITS",
    "DEFAULT_FRACTIONS",
    "FULL_BITS",
    "SWEEP_FORMATS",
    "pareto_front",
    "point_spec",
    "split_budget",
    "sweep",
    "to_csv",
]
