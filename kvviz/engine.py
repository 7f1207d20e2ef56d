"""Apply a compression spec to a trace and compare compressed attention with the original.

`compare` evaluates the view's row (layer, query head, query) and its ensemble (the rows the error bars
range over), each row by kvviz.rows (original vs compressed attention and outputs), within the work
budget, and adds the memory of the compressed cache and the per-token spread of the error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvviz.attention import chunk_rows, keep_heap, small_blas
from kvviz.heads import view_masks
from kvviz.limits import Part, Work, checkpoint
from kvviz.memory import Memory, budget_is_exact, memory_dict, memory_for, seen_tokens
from kvviz.metrics import RowMetrics, Spread, spread
from kvviz.policies.merging import merge_note

# one row: what is kept at a query, and its original vs compressed attention (re-exported: the engine's API)
from kvviz.rows import REASONS, RowResult, evaluate_rows, keep_masks, kept_at_query  # noqa: F401
from kvviz.rows import ALL, EVICTED, HEAVY, RECENT, SINK, evaluate_row, read_masks, reasons_for  # noqa: F401
from kvviz.spec import Spec, SpecError, View
from kvviz.trace import Trace

keep_heap()  # the engine's temporaries reuse freed heap instead of faulting pages in again

NO_LATER_QUERIES_NOTE = (
    "This source has no later queries: the evaluated query is the last context "
    "query, and its own attention is part of the history the policy ranks by."
)


@dataclass(frozen=True, eq=False)
class Comparison:
    """Everything one configuration produces: the primary row, its ensemble, and summaries."""

    spec: Spec
    view: View
    ensemble: str | None
    tokens: tuple[str, ...]  # labels of tokens 0..p of the primary row
    primary: RowResult
    members: tuple[RowResult, ...]
    spread: Spread  # per-token error statistics over the members
    memory: Memory
    notes: tuple[str, ...]

    @property
    def metrics(self) -> dict:
        """The primary row's metrics plus memory (what the app's cards show)."""
        return {**self.primary.metrics.as_dict(), **memory_dict(self.memory)}

    @property
    def metrics_mean(self) -> dict:
        """Each row metric averaged over the ensemble members."""
        out = {}
        for key in self.primary.metrics.as_dict():
            vals = [getattr(m.metrics, key) for m in self.members]
            out[key] = None if vals[0] is None else float(np.mean(vals))
        return out

    def to_json(self) -> dict:
        p = self.primary
        return {
            "source": self.primary_source,
            "spec": self.spec.__dict__,
            "layer": p.layer,
            "layer_number": self.model_layer,
            "layer_kind": self.layer_kind,
            "layer_window": self.layer_window,
            "head": p.head,
            "kv_head": p.kv_head,
            "position": p.position,
            "ensemble": self.ensemble,
            "ensemble_members": len(self.members),
            "tokens": list(self.tokens),
            "original": p.original.tolist(),
            "compressed": p.compressed.tolist(),
            "kept": p.kept.tolist(),
            "reason": [REASONS[int(r)] for r in p.reason],
            "error": p.error.tolist(),
            "error_mean": self.spread.mean.tolist(),
            "error_std_sample": self.spread.std.tolist(),
            "error_ci95_lo": self.spread.ci_lo.tolist(),
            "error_ci95_hi": self.spread.ci_hi.tolist(),
            "error_min": self.spread.member_min.tolist(),
            "error_max": self.spread.member_max.tolist(),
            "metrics": self.metrics,
            "metrics_mean": self.metrics_mean,
            "notes": list(self.notes),
        }

    primary_source: str = ""
    # the model's own number of the view's layer (a capture may keep some)
    layer_number: int | None = None
    # the view's layer's sliding window in tokens (None: full attention)
    layer_window: int | None = None
    # the model's own number of every layer of the trace, by position (empty: the positions are the numbers)
    layer_numbers: tuple[int, ...] = ()

    @property
    def layer_kind(self) -> str:
        """The view's layer's kind: "sliding_attention" (not compressed: the model's own window) or
        "full_attention"."""
        return "full_attention" if self.layer_window is None else "sliding_attention"

    def layer_name(self, position: int) -> int:
        """A layer's number in the model from its position in the trace (a member row's `layer`)."""
        return self.layer_numbers[position] if self.layer_numbers else int(position)

    @property
    def model_layer(self) -> int:
        """The view's layer as the model numbers it (the position in the trace where it does not say)."""
        return self.primary.layer if self.layer_number is None else self.layer_number


# --- checks ------------------------------------------------------------------------


def check_view(trace: Trace, view: View) -> int:
    """Validate layer / head / step against the trace; return the query index evaluated."""
    if not 0 <= view.layer < trace.n_layers:
        raise SpecError(f"layer {view.layer} does not exist: this trace has layers 0-{trace.n_layers - 1}")
    if not 0 <= view.head < trace.n_q_heads:
        raise SpecError(f"head {view.head} does not exist: this trace has query heads 0-{trace.n_q_heads - 1}")
    evaluated = trace.evaluated_queries
    step = len(evaluated) - 1 if view.step is None else view.step
    if not 0 <= step < len(evaluated):
        raise SpecError(
            f"step {view.step} does not exist: this trace has {len(evaluated)} evaluated "
            f"quer{'y' if len(evaluated) == 1 else 'ies'} (steps 0-{len(evaluated) - 1})"
        )
    return int(evaluated[step])


def sliding_note(trace: Trace, view: View) -> str | None:
    """What a sliding-window layer means for the view: the model's own window, not the policy's choice."""
    number, window = trace.layer_numbers[view.layer], trace.layer_windows[view.layer]
    out = []
    if window is not None:
        out.append(
            f"Layer {number} is a sliding-window layer: the model itself keeps only its last {window} "
            "tokens there, at full precision. kvviz compresses the full-attention layers only (as "
            "kvpress skips sliding layers), so here the compressed attention is the model's own."
        )
    if view.ensemble == "layers":
        members = [(view.layer + i) % trace.n_layers for i in range(min(view.ensemble_size, trace.n_layers))]
        sliding = sum(trace.layer_windows[i] is not None for i in members)
        if sliding:
            out.append(
                f"{sliding} of the {len(members)} layers in the ensemble are sliding-window layers, "
                "which compression leaves alone: their error is zero."
            )
    return " ".join(out) or None


# --- one row -------------------------------------------------------------------------


def kept_counts(trace: Trace, spec: Spec, qi: int) -> np.ndarray:
    """(layers, kv_heads) int: the tokens each cache holds at query qi (Quest: the tokens it reads),
    counted from the kept masks where the budget does not say it exactly — the memory card and the
    budget ledger both count bytes from these."""
    n = int(trace.query_positions[qi]) + 1
    L, H = trace.n_layers, trace.n_kv_heads
    if budget_is_exact(spec):
        from kvviz.policies.allocation import layer_spec

        per_layer = [
            seen_tokens(window, n)  # a sliding layer: its window, whatever the spec
            if window is not None or not spec.evicts
            else min(layer_spec(spec, layer, L, trace.context_len).budget, n)
            for layer, window in enumerate(trace.layer_windows)
        ]
        return np.repeat(np.array(per_layer, dtype=np.int64)[:, None], H, axis=1)
    return np.stack([kept_at_query(trace, spec, layer, qi).sum(axis=1) for layer in range(L)]).astype(np.int64)


# --- the work budget -------------------------------------------------------------------

# float64 (tokens,) arrays per evaluated row: logits, softmax, log, compressed, error, ...
ROW_TEMPORARIES = 12


def n_members(trace: Trace, view: View) -> int:
    """How many rows the view's ensemble holds (the primary row included)."""
    size = view.ensemble_size
    return {
        None: 1,
        "heads": min(size, trace.n_q_heads),
        "layers": min(size, trace.n_layers),
        "steps": min(size, len(trace.evaluated_queries)),
        "seeds": size,
    }[view.ensemble]


def trace_bytes(trace: Trace) -> int:
    """What the trace holds in memory (a trace read lazily from its file: what its reads keep)."""
    from kvviz.trace import held_bytes

    return sum(held_bytes(a) for a in (trace.q, trace.k, trace.v, trace.logits) if a is not None)


def compare_work(trace: Trace, evicts: bool, view: View, seeds: bool = False) -> Work:
    """What a comparison holds at its peak: the trace itself, the ensemble's rows, (evicts) the policy's
    inputs, attention chunks and kept masks, and (seeds=True, a source that draws a new trace per seed)
    the ensemble's other traces."""
    m, P, D = n_members(trace, view), trace.n_positions, trace.head_dim
    Hq, Hkv = trace.n_q_heads, trace.n_kv_heads
    parts = [
        Part("the trace", ((trace_bytes(trace), "bytes"),), item_bytes=1),
        Part("attention rows", ((m, "rows"), (P, "tokens"), (ROW_TEMPORARIES, "arrays")), item_bytes=8),
    ]
    if evicts:
        chunk = chunk_rows(Hq, P)
        parts += [
            Part("policy inputs", ((2, ""), (Hq, "query heads"), (P, "positions"), (D, "dims"))),
            Part("attention chunks", ((2, ""), (Hq, "query heads"), (chunk, "rows"), (P, "keys"))),
            Part("kept masks", ((m, "queries"), (Hkv, "KV heads"), (P, "positions")), item_bytes=1),
        ]
    if seeds and view.ensemble == "seeds" and m > 1:
        parts.append(Part("seed traces", ((m - 1, "more traces"), (trace_bytes(trace), "bytes")), item_bytes=1))
    return Work("this comparison", tuple(parts), lower="the ensemble size or the source's size")


# --- ensembles ------------------------------------------------------------------------

Member = tuple[Trace, Spec, int, int, int]  # trace, spec, layer, head, query index


def ensemble_members(
    trace: Trace, spec: Spec, view: View, qi: int, trace_for_seed: Callable[[int], Trace] | None = None
) -> list[Member]:
    """The rows behind the error bars; the primary row comes first."""
    size = view.ensemble_size
    primary = (trace, spec, view.layer, view.head, qi)
    if view.ensemble is None:
        return [primary]
    if view.ensemble == "heads":
        n = min(size, trace.n_q_heads)
        return [(trace, spec, view.layer, (view.head + i) % trace.n_q_heads, qi) for i in range(n)]
    if view.ensemble == "layers":
        n = min(size, trace.n_layers)
        return [(trace, spec, (view.layer + i) % trace.n_layers, view.head, qi) for i in range(n)]
    if view.ensemble == "steps":
        evaluated = list(trace.evaluated_queries)
        at = evaluated.index(qi)
        return [(trace, spec, view.layer, view.head, q) for q in evaluated[max(0, at - size + 1) : at + 1][::-1]]
    # seeds: repeated random draws (noise, random scorer, and the source itself if it can)
    members = [primary]
    for r in range(1, size):
        t = trace_for_seed(r) if trace_for_seed is not None else trace
        members.append(
            (t, spec.with_(seed=spec.seed + r), view.layer, view.head, qi if t is trace else _same_step(trace, t, qi))
        )
    return members


def _same_step(a: Trace, b: Trace, qi: int) -> int:
    evaluated_a, evaluated_b = list(a.evaluated_queries), b.evaluated_queries
    return int(evaluated_b[min(evaluated_a.index(qi), len(evaluated_b) - 1)])


@small_blas()  # the rows' own contexts nest inside it: BLAS's thread count set once a comparison
def evaluate_members(members: list) -> list[RowResult]:
    """The rows of an ensemble's members (trace, spec, layer, query head, query), in their order.

    Members mostly share one trace and one spec object: they are grouped by identity. The policy decides
    once per (trace, eviction settings, layer), for all the positions needed there (and the KV heads the
    rows read there: a scorer that scores each KV head alone scores only those); rows sharing (trace, spec,
    layer, query) are evaluated together across heads."""
    traces = {id(t): t for t, *_ in members}
    specs = {id(s): s for _, s, *_ in members}
    eviction = {sid: s.eviction_key for sid, s in specs.items()}
    wanted: dict[tuple, tuple[Spec, set[int], set[int]]] = {}
    for t, s, layer, head, q in members:
        _, positions, kv = wanted.setdefault((id(t), eviction[id(s)], layer), (s, set(), set()))
        positions.add(int(t.query_positions[q]))
        kv.add(t.kv_head(head))
    masks: dict[tuple, tuple[list[int], np.ndarray | None]] = {}
    for key, (s, positions, kv) in wanted.items():
        checkpoint()
        positions = sorted(positions)
        masks[key] = positions, view_masks(traces[key[0]], s, key[2], positions, sorted(kv))
    batches: dict[tuple[int, int, int, int], list[int]] = {}
    for i, (t, s, layer, head, q) in enumerate(members):
        batches.setdefault((id(t), id(s), layer, q), []).append(i)
    rows: list[RowResult | None] = [None] * len(members)
    quantized: dict = {}
    for (tid, sid, layer, q), which in batches.items():
        t, s = traces[tid], specs[sid]
        positions, m = masks[(tid, eviction[sid], layer)]
        p = int(t.query_positions[q])
        kept_kv = None if m is None else m[positions.index(p)]
        checkpoint()
        # rows of one KV head together
        which.sort(key=lambda i: members[i][3] // t.group_size)
        heads = [members[i][3] for i in which]
        with small_blas():
            evaluated = evaluate_rows(t, s, layer, heads, q, kept_kv, quantized.setdefault((tid, sid), {}))
        for i, row in zip(which, evaluated):
            rows[i] = row
    return rows


def _error_rows(rows: list[RowResult], n: int, complete: bool) -> np.ndarray:
    """(members, n) the members' per-token errors; earlier steps see fewer tokens: NaN marks what a member
    cannot see."""
    if complete:
        return np.stack([r.error for r in rows])
    errors = np.full((len(rows), n), np.nan)
    for i, r in enumerate(rows):
        m = min(n, len(r.error))
        errors[i, :m] = r.error[:m]
    return errors


def compare(
    trace: Trace, spec: Spec, view: View = View(), trace_for_seed: Callable[[int], Trace] | None = None
) -> Comparison:
    """Compute one configuration: the primary row, its ensemble and the summaries."""
    if spec.positions != "true":
        raise SpecError(
            "re-rotating keys to their cache slots needs the model's RoPE: it applies to real-model "
            "decoding (Model lab, kvviz eval), not to attention traces"
        )
    qi = check_view(trace, view)
    compare_work(trace, spec.evicts, view, seeds=trace_for_seed is not None).check()
    members = ensemble_members(trace, spec, view, qi, trace_for_seed)
    rows = evaluate_members(members)
    primary = rows[0]
    n = primary.position + 1
    complete = all(len(r.error) == n for r in rows)
    errors = _error_rows(rows, n, complete)
    notes = () if trace.has_later_queries else (NO_LATER_QUERIES_NOTE,)
    notes += tuple(filter(None, [sliding_note(trace, view), merge_note(trace, spec)]))
    return Comparison(
        spec=spec,
        view=view,
        ensemble=view.ensemble,
        tokens=tuple(trace.tokens[:n]),
        primary=primary,
        members=tuple(rows),
        spread=spread(errors, complete),
        memory=memory_for(trace, spec, n, None if budget_is_exact(spec) else kept_counts(trace, spec, qi)),
        notes=notes,
        primary_source=str(trace.meta.get("source", "")),
        layer_number=trace.layer_numbers[view.layer],
        layer_window=trace.layer_windows[view.layer],
        layer_numbers=trace.layer_numbers,
    )


def head_grid(trace: Trace, spec: Spec, step: int | None = None, metric: str = "tv_distance") -> np.ndarray:
    """One row metric for every (layer, query head) at one query: shape (layers, q_heads).

    The overview that points at the heads compression hurts most (or, with
    metric="mass_retained", the heads whose mass it keeps).
    """
    if metric not in RowMetrics.__dataclass_fields__:
        raise SpecError(f"unknown metric {metric!r}")
    grid = np.zeros((trace.n_layers, trace.n_q_heads))
    for layer in range(trace.n_layers):
        view = View(layer=layer, head=0, step=step, ensemble="heads", ensemble_size=trace.n_q_heads)
        for row in compare(trace, spec, view).members:
            grid[layer, row.head] = getattr(row.metrics, metric)
    return grid
