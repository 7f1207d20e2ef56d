"""The leaderboard: every method's score against the compression ratio, under both question protocols, in the
shape of kvpress's leaderboard, on a task set the uncompressed model solves.

A cell is one (task, prompt, method, ratio, protocol): the needle test's cell (kvviz.analysis.needle) with
the method's cache at budget = (1 - ratio) of the prompt, answered greedily and scored exactly.

    tasks      RULER-style retrieval (kvviz.analysis.needle.tasks): by default a pass key, a key among two,
               and a short question about a made-up fact; prompts of `lengths` tokens with the needle at
               each of `depths`
    methods    kvviz's evicting methods by their sweep names (`kvviz eval-sweep`'s split: 4 sinks, half the
               budget as the recent window, the rest heavy hitters; allocations as adakv-snapkv, ...);
               a method that keeps its own count per head (a threshold, DuoAttention) is set for the budget
               (`Policy.fit_budget`) and reports the ratio it reached
    protocols  "question-aware": the cache is compressed after the question (kvpress's compress_questions=True);
               "query-agnostic": compressed right after the context, the question then read through the
               compressed cache (kvpress's default pipeline)

A method's score is its share of right answers over the task set's prompts; `ratio_reached` is
1 - the share of the prompt's tokens its caches hold at the first answer step, over every layer and KV
head. Cells are the needle grid's, cached on disk: a rerun reads them, and a study file runs the same cells
on Ray (kvviz.analysis.study, `kind = "needle"` with `tasks`).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvviz.analysis.needle import FULL, GridRequest, run_grid
from kvviz.analysis.needle.tasks import TASKS
from kvviz.policies.registry import BOUND, get_policy, is_bound
from kvviz.spec import SCORERS, SpecError

RATIOS = (0.25, 0.5, 0.75, 0.875)  # kvpress's leaderboard columns
PROTOCOLS = ("question-aware", "query-agnostic")
TASK_SET = ("passkey", "multikey", "qa")  # the variable-tracking task is left out: SmolLM2-135M fails it uncompressed
# every built-in scorer that evicts (the registry's order), then what two wrappers buy on two scorers, then
# the bound
METHODS = (
    *(n for n in SCORERS if get_policy(n).kind == "evict" and not is_bound(n)),
    "adakv-snapkv",
    "adakv-expected_attention",
    "pyramid-snapkv",
    "pyramid-expected_attention",
    "merge-streaming",
    "merge-snapkv",
    BOUND,
)
LENGTHS = (256,)
DEPTHS = (0.25, 0.75)
NEW_TOKENS = 6
# the shipped board (`kvviz leaderboard --save`), which the Trade-offs page opens on
DEFAULT_FILE = Path(__file__).resolve().parents[1] / "data" / "leaderboard.json.gz"
FIELDS = ("task", "protocol", "method", "ratio", "length", "depth", "correct", "ratio_reached", "answer", "key")

Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class BoardRequest:
    """What a leaderboard runs; `check` names what is wrong before any model loads."""

    methods: tuple[str, ...] = METHODS
    ratios: tuple[float, ...] = RATIOS
    protocols: tuple[str, ...] = PROTOCOLS
    tasks: tuple[str, ...] = TASK_SET
    lengths: tuple[int, ...] = LENGTHS
    depths: tuple[float, ...] = DEPTHS
    new_tokens: int = NEW_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("methods", "ratios", "protocols", "tasks", "lengths", "depths"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def check(self) -> None:
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            raise SpecError(f"unknown protocol {bad[0] if bad else ''!r}; choose from {', '.join(PROTOCOLS)}")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise SpecError(f"unknown task {bad[0] if bad else ''!r}; choose from {', '.join(TASKS)}")
        if not self.ratios or any(not 0.0 <= r < 1.0 for r in self.ratios):
            raise SpecError(f"compression ratios are shares of the prompt removed, in [0, 1), got {self.ratios}")
        for task in self.tasks:
            self.grid(task, self.protocols[0]).check()

    def grid(self, task: str, protocol: str) -> GridRequest:
        """The needle grid of one task under one protocol: every method at every ratio."""
        return GridRequest(
            lengths=self.lengths,
            depths=self.depths,
            scorers=(FULL, *self.methods),
            budgets=tuple(round(1.0 - r, 6) for r in self.ratios),
            question_after_compression=protocol == "query-agnostic",
            new_tokens=self.new_tokens,
            seed=self.seed,
            task=task,
        )

    @property
    def n_cells(self) -> int:
        prompts = len(self.tasks) * len(self.lengths) * len(self.depths)
        return prompts * len(self.protocols) * (1 + len(self.methods) * len(self.ratios))


@dataclass(frozen=True)
class Board:
    """Every cell of a leaderboard run (FIELDS), and what ran it."""

    model: str
    request: BoardRequest
    cells: tuple[dict, ...] = field(repr=False)

    def scores(self) -> list[dict]:
        """One row per (protocol, method, ratio): score (share right), ratio reached, cells; the full cache
        once per protocol at ratio 0."""
        groups: dict[tuple, list[dict]] = {}
        for c in self.cells:
            groups.setdefault((c["protocol"], c["method"], c["ratio"]), []).append(c)
        return [
            {
                "protocol": protocol,
                "method": method,
                "ratio": ratio,
                "score": float(np.mean([c["correct"] for c in cells])),
                "ratio_reached": float(np.mean([c["ratio_reached"] for c in cells])),
                "cells": len(cells),
            }
            for (protocol, method, ratio), cells in groups.items()
        ]

    def full_accuracy(self) -> dict[str, float]:
        """The uncompressed model's share right, per task (over both protocols: its cells are the same)."""
        out: dict[str, list] = {}
        for c in self.cells:
            if c["method"] == FULL and c["protocol"] == self.request.protocols[0]:
                out.setdefault(c["task"], []).append(c["correct"])
        return {task: float(np.mean(v)) for task, v in out.items()}

    def as_dict(self) -> dict:
        return {"model": self.model, "request": self.request.__dict__, "cells": list(self.cells)}

    @classmethod
    def from_dict(cls, d: dict) -> "Board":
        return cls(model=d["model"], request=BoardRequest(**d["request"]), cells=tuple(d["cells"]))

    def save(self, path: str | Path) -> None:
        blob = json.dumps(self.as_dict(), separators=(",", ":")).encode("utf-8")
        Path(path).write_bytes(gzip.compress(blob, mtime=0))

    @classmethod
    def load(cls, path: str | Path) -> "Board":
        return cls.from_dict(json.loads(gzip.decompress(Path(path).read_bytes()).decode("utf-8")))

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        for c in self.cells:
            w.writerow(c)
        return buf.getvalue()


def run(
    model,
    tokenizer,
    model_id: str = "bundled",
    request: BoardRequest | None = None,
    use_cache: bool = True,
    progress: Progress | None = None,
    load: Callable | None = None,
) -> Board:
    """Every cell of `request` (default: BoardRequest()), one needle grid per (task, protocol); the model
    is loaded (`load`) only when a cell is not on disk. `progress(fraction, message)` hears every cell, the
    message ending in the time left, estimated from the cells computed so far."""
    req = request if request is not None else BoardRequest()
    req.check()
    grids = [(task, protocol) for task in req.tasks for protocol in req.protocols]
    held = {"model": model, "tokenizer": tokenizer}
    t0 = time.perf_counter()

    def need_model():
        if held["model"] is None:
            held["model"], held["tokenizer"] = load()
        return held["model"], held["tokenizer"]

    cells: list[dict] = []
    for i, (task, protocol) in enumerate(grids):

        def say(f: float, message: str, i=i, task=task, protocol=protocol) -> None:
            if progress is None:
                return
            done = (i + f) / len(grids)
            spent = time.perf_counter() - t0
            left = f", about {spent / done * (1 - done) / 60:.0f} min left" if done > 0.02 else ""
            progress(done, f"{task}, {protocol}: {message}{left}")

        grid = run_grid(
            held["model"],
            held["tokenizer"],
            model_id,
            req.grid(task, protocol),
            use_cache=use_cache,
            progress=say,
            load=need_model if held["model"] is None else None,
        )
        for c in grid.cells:
            cells.append(
                {
                    "task": task,
                    "protocol": protocol,
                    "method": c.scorer,
                    "ratio": 0.0 if c.scorer == FULL else round(1.0 - c.budget, 6),
                    "length": c.length,
                    "depth": c.depth,
                    "correct": bool(c.correct),
                    "ratio_reached": float(1.0 - c.kept().mean()) if c.kept_packed else 0.0,
                    "answer": c.answer,
                    "key": c.key,
                }
            )
    return Board(model=model_id, request=req, cells=tuple(cells))


def format_board(board: Board) -> str:
    """The table a terminal shows: methods by rows, ratios by columns, one block per protocol."""
    full = board.full_accuracy()
    lines = [
        "full cache, share right per task: "
        + ", ".join(f"{TASKS[t].title} {v:.0%}" for t, v in full.items())
        + f" (task set {np.mean(list(full.values())):.0%})"
    ]
    scores = board.scores()
    ratios = board.request.ratios
    for protocol in board.request.protocols:
        lines += [
            "",
            f"{protocol}: score (share right) at each compression ratio; ~ the ratio reached where it differs",
        ]
        lines.append(f"{'method':28s}" + "".join(f"{r:>14.3g}" for r in ratios))
        for method in board.request.methods:
            row = {s["ratio"]: s for s in scores if s["protocol"] == protocol and s["method"] == method}
            cells = []
            for r in ratios:
                s = row.get(round(r, 6))
                if s is None:
                    cells.append(f"{'-':>14s}")
                    continue
                reached = "" if abs(s["ratio_reached"] - r) < 0.03 else f" ~{s['ratio_reached']:.2f}"
                cells.append(f"{s['score']:>6.0%}{reached:>8s}")
            lines.append(f"{method:28s}" + "".join(cells))
    return "\n".join(lines)
