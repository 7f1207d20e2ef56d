"""A lesson: the Explorer's charts and numbers at every point of a grid of the four headline sliders.

`lesson_grid` picks each slider's values (sink, recent window, heavy-hitter budget, bits; at most
MAX_VALUES each, the current setting always among them); `compute_lesson` runs `kvviz.compare` at
every grid point and keeps exactly what the Explorer draws there - the per-token (or, past
BIN_THRESHOLD tokens, per-bin) frames of kvviz.analysis.frames and the metrics - packed into
compact arrays: chart rows that are equal bit for bit are stored once and indexed, which is what
makes a grid of thousands of points small (many budgets keep the same tokens).

No plotting here: kvviz.plots.lesson turns a `Lesson` into the self-contained HTML page.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from kvviz.analysis.frames import (
    BIN_THRESHOLD,
    band_bounds,
    bin_edges,
    binned_columns,
    ensemble_text,
    row_text,
    token_columns,
)
from kvviz.engine import REASONS, compare
from kvviz.spec import FULL_BITS, Spec, SpecError, View
from kvviz.trace import Trace

SLIDERS = ("sink", "recent", "heavy", "bits")
MAX_VALUES = 12  # per slider: 12^4 = 20,736 points at most
# The default grids, densest first: (sink values, recent / heavy: 0 and up to this many powers of two, bits;
# 16 = not quantized). A lesson takes the densest whose values (points x chart columns x arrays per column)
# stay within MAX_CELLS, ~8 MB of float64 before identical rows are shared and gzip: the handbook (64 tokens,
# many budgets keep all of them, rows shared) gets the first, 2,688 points in 1.2 MB; a 222-token model trace
# the third, 720 points in ~4 MB (its rows rarely repeat); a 544-token synthetic pattern (109 bins) the third
# too (the second made a 5.0 MB page).
TIERS = (
    ((0, 1, 2, 4, 8, 16), 7, (1, 2, 3, 4, 6, 8, 16)),
    ((0, 1, 4, 8, 16), 6, (1, 2, 3, 4, 8, 16)),
    ((0, 1, 4, 16), 5, (2, 3, 4, 8, 16)),
    ((0, 4, 16), 4, (2, 4, 8, 16)),
)
MAX_CELLS = 1_050_000
# What each chart row holds, per token (or per bin): the columns of kvviz.analysis.frames the
# Explorer's attention and error charts draw (band_lo / band_hi: the error bars `bars` asks for).
TOKEN_COLUMNS = ("compressed", "error_eviction_mean", "error_quantization_mean", "error_mean", "band_lo", "band_hi")
BIN_COLUMNS = ("compressed", "evicted_mass") + TOKEN_COLUMNS[1:]


@dataclass(frozen=True)
class Lesson:
    """The grid and what the Explorer shows at each of its points, deduplicated.

    Point i (C order over SLIDERS: sink slowest, bits fastest) draws chart row `rows[row_of[i]]`
    (columns `columns`, one value per token or bin) and marks `marks[mark_of[i]]` (per token: the
    reason code of kvviz.engine.REASONS; per bin: the kept tokens); `metrics[i]` is
    Comparison.metrics and `specs[i]` the Spec computed there.
    """

    grid: dict[str, tuple[int, ...]]
    start: dict[str, int]  # the base setting's value of each slider
    binned: bool
    columns: tuple[str, ...]
    x: np.ndarray  # token positions, or bin starts
    x_end: np.ndarray  # = x per token; bin ends (inclusive) per bin
    labels: tuple[str, ...]  # token text; per bin the first and last token
    # the original attention per token (or bin): the same at every point
    original: np.ndarray
    rows: np.ndarray  # (unique rows, columns, tokens or bins) float64
    row_of: np.ndarray  # (points,) uint32
    marks: np.ndarray  # (unique marks, tokens or bins)
    mark_of: np.ndarray  # (points,) uint32
    metrics: tuple[dict, ...]  # per point
    specs: tuple[Spec, ...]  # per point
    members: int  # ensemble members behind the error bars
    bars: str  # which band band_lo / band_hi hold (kvviz.metrics.BANDS)
    row: str  # the primary row in words
    ensemble: str  # the ensemble in words
    notes: tuple[str, ...]
    n_tokens: int  # tokens the evaluated query sees
    text_tokens: bool  # real text (a model's tokens), not t0, t1, ...
    reasons: dict[int, str] = field(default_factory=lambda: dict(REASONS))

    @property
    def points(self) -> int:
        return len(self.row_of)

    def index(self, **values: int) -> int:
        """The point index of slider values (every slider named, each on the grid)."""
        i = 0
        for name in SLIDERS:
            axis = self.grid[name]
            if values[name] not in axis:
                raise SpecError(f"{name} {values[name]} is not on the lesson's grid ({', '.join(map(str, axis))})")
            i = i * len(axis) + axis.index(values[name])
        return i

    def frame(self, i: int) -> dict[str, np.ndarray]:
        """Point i's chart columns (and its marks as `reason` or `kept_tokens`), as the page holds them."""
        out = dict(zip(self.columns, self.rows[self.row_of[i]]))
        out["kept_tokens" if self.binned else "reason"] = self.marks[self.mark_of[i]]
        return out


# --- the grid ----------------------------------------------------------------------------------


def _budget_values(n: int, steps: int) -> tuple[int, ...]:
    """0 and the largest `steps` powers of two up to n (64 tokens, 7 steps: 0, 1, 2, 4, ..., 64)."""
    powers = [2**k for k in range(0, max(n, 1).bit_length()) if 2**k <= n]
    return (0, *powers[-steps:])


def default_grid(n_tokens: int, symmetric: bool = False) -> dict[str, tuple[int, ...]]:
    """The densest of TIERS within MAX_CELLS for a query that sees n_tokens (binned past BIN_THRESHOLD)."""
    binned = n_tokens > BIN_THRESHOLD
    columns = (len(bin_edges(n_tokens)) if binned else n_tokens) * len(BIN_COLUMNS if binned else TOKEN_COLUMNS)
    for sinks, steps, bits in TIERS:
        grid = {
            "sink": tuple(s for s in sinks if s <= n_tokens),
            "recent": _budget_values(n_tokens, steps),
            "heavy": _budget_values(n_tokens, steps),
            "bits": tuple(b for b in bits if not (symmetric and b == 1)),
        }
        if math.prod(map(len, grid.values())) * columns <= MAX_CELLS:
            break
    return grid


def lesson_grid(
    n_tokens: int, base: Spec, given: dict[str, tuple[int, ...]] | None = None, limit: int | None = None
) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """(grid, start): each slider's values and the base setting's value of each.

    Unless `given`, `default_grid`: sinks 0-16, recent and heavy 0 and powers of two up to the n_tokens
    the query sees, bits 1-8 and 16 (no 1 with symmetric quantization), fewer of each on long sources. The base
    setting's value joins its slider's values, so the lesson opens where the link was. A budget
    above `limit` (the trace's tokens, as the app's sliders end there) raises SpecError.
    """
    start = {"sink": base.sink, "recent": base.recent, "heavy": base.heavy, "bits": _bits_of(base)}
    grid = {**default_grid(n_tokens, base.symmetric), **(given or {})}
    limit = n_tokens if limit is None else limit
    for name in SLIDERS:
        values = sorted(set(grid[name]) | {start[name]})
        if name != "bits" and values[-1] > limit:
            raise SpecError(
                f"{name} {values[-1]} is more than the {limit} tokens of this source: "
                f"{'the setting' if values[-1] == start[name] else 'the grid'} must stay within 0-{limit}"
            )
        if len(values) > MAX_VALUES:
            raise SpecError(
                f"{name} has {len(values)} values with the current setting {start[name]} added; "
                f"a slider takes at most {MAX_VALUES}"
            )
        grid[name] = tuple(values)
    return grid, start


def _bits_of(spec: Spec) -> int:
    if spec.key_bits != spec.value_bits:
        raise SpecError(
            f"the lesson's bits slider sets keys and values together, but this setting has "
            f"{spec.key_bits}-bit keys and {spec.value_bits}-bit values: use one bit width for both"
        )
    if spec.quant_model != "kv" or spec.key_format != "int" or spec.value_format != "int":
        raise SpecError(
            "the lesson's bits slider is the integer K/V quantizer's: use the real K/V quantization "
            "model (not the logit noise) and the integer cache format for keys and values"
        )
    return spec.key_bits


def parse_grid(items: list[str] | tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """--grid 'sink=0,2,4' items -> {'sink': (0, 2, 4)}; bad names or values raise SpecError."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in SLIDERS:
            raise SpecError(f"--grid {item!r}: write NAME=V1,V2,... with NAME one of {', '.join(SLIDERS)}")
        try:
            values = tuple(sorted({int(v) for v in raw.split(",") if v.strip()}))
        except ValueError:
            raise SpecError(f"--grid {item!r}: the values must be whole numbers separated by commas") from None
        if not values:
            raise SpecError(f"--grid {item!r}: give at least one value")
        if min(values) < 0:
            raise SpecError(f"--grid {item!r}: values must be 0 or more")
        if name == "bits" and not set(values) <= set(range(1, 9)) | {FULL_BITS}:
            raise SpecError(f"--grid {item!r}: bits must be 1-8 or {FULL_BITS} (not quantized)")
        if len(values) > MAX_VALUES:
            raise SpecError(f"--grid {item!r}: at most {MAX_VALUES} values a slider (to keep the file small)")
        out[name] = values
    return out


def grid_specs(base: Spec, grid: dict[str, tuple[int, ...]]) -> list[Spec]:
    """The Spec of every grid point, in point order; an impossible point raises SpecError naming it."""
    specs = []
    for sink, recent, heavy, bits in itertools.product(*(grid[name] for name in SLIDERS)):
        try:
            specs.append(base.with_(sink=sink, recent=recent, heavy=heavy, key_bits=bits, value_bits=bits))
        except SpecError as e:
            raise SpecError(
                f"the grid point sink {sink}, recent {recent}, heavy {heavy}, bits {bits} is impossible "
                f"({e}); leave that value out of the grid"
            ) from None
    return specs


# --- computing it --------------------------------------------------------------------------------


def compute_lesson(
    trace: Trace,
    base: Spec,
    view: View,
    grid: dict[str, tuple[int, ...]],
    start: dict[str, int],
    bars: str = "std",
    trace_for_seed: Callable[[int], Trace] | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> Lesson:
    """kvviz.compare at every grid point, kept as the Explorer draws it (see Lesson)."""
    specs = grid_specs(base, grid)
    if trace_for_seed is not None:  # every point asks for the same seeds: make each trace once
        trace_for_seed = lru_cache(maxsize=None)(trace_for_seed)
    rows: dict[bytes, int] = {}
    marks: dict[bytes, int] = {}
    row_data, mark_data, row_of, mark_of, metrics = [], [], [], [], []
    first = None
    for i, spec in enumerate(specs):
        comp = compare(trace, spec, view, trace_for_seed=trace_for_seed)
        binned = len(comp.tokens) > BIN_THRESHOLD
        # the Explorer's frames, as arrays
        frame = binned_columns(comp) if binned else token_columns(comp)
        frame["band_lo"], frame["band_hi"] = band_bounds(frame, bars)
        columns = BIN_COLUMNS if binned else TOKEN_COLUMNS
        row = np.ascontiguousarray(np.stack([np.asarray(frame[c], dtype=np.float64) for c in columns]))
        mark = (
            np.asarray(frame["kept_tokens"], dtype=np.int32)
            if binned
            else np.asarray(comp.primary.reason, dtype=np.uint8)
        )
        row_of.append(rows.setdefault(row.tobytes(), len(rows)))
        if row_of[-1] == len(row_data):
            row_data.append(row)
        mark_of.append(marks.setdefault(mark.tobytes(), len(marks)))
        if mark_of[-1] == len(mark_data):
            mark_data.append(mark)
        metrics.append(comp.metrics)
        if first is None:
            first = (comp, frame, binned, columns)
        if progress is not None:
            progress((i + 1) / len(specs), f"grid point {i + 1} of {len(specs)}")
    comp, frame, binned, columns = first
    if binned:
        x, x_end = np.asarray(frame["start"]), np.asarray(frame["end"])
        labels = tuple(f"{a} … {b}" for a, b in zip(frame["first_token"], frame["last_token"]))
    else:
        x = x_end = np.asarray(frame["position"])
        labels = tuple(map(str, comp.tokens))
    return Lesson(
        grid=grid,
        start=start,
        binned=binned,
        columns=columns,
        x=x,
        x_end=x_end,
        labels=labels,
        original=np.asarray(frame["original"], dtype=np.float64),
        rows=np.stack(row_data),
        row_of=np.asarray(row_of, dtype=np.uint32),
        marks=np.stack(mark_data),
        mark_of=np.asarray(mark_of, dtype=np.uint32),
        metrics=tuple(metrics),
        specs=tuple(specs),
        members=len(comp.members),
        bars=bars,
        row=row_text(comp),
        ensemble=ensemble_text(comp),
        notes=comp.notes,
        n_tokens=len(comp.tokens),
        text_tokens=trace.meta.get("source") not in ("handbook", "synthetic"),
    )
