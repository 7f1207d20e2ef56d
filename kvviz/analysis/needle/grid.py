"""The needle grid: lengths x depths x policies, cells cached on disk as JSON, the shipped default
grid, CSV and text tables, and the cell the page opens on."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.analysis.needle.cell import NeedleCell, _first_answer_attention, prefill, run_cell
from kvviz.analysis.needle.tasks import NEEDLE_TEMPLATE, PRIMER, QUESTION, TASKS
from kvviz.analysis.needle.prompt import (
    DEFAULT_BUDGET,
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_SCORERS,
    DEFAULT_SEED,
    FILLER,
    FORMAT_VERSION,
    FULL,
    HAYSTACKS,
    INSTRUCTION,
    SCORER_NAMES,
    NeedlePrompt,
    Progress,
    budget_tokens,
    build_prompt,
    min_length,
    spec_for,
)
from kvviz.limits import checkpoint
from kvviz.models.config import model_dims, prefill_work
from kvviz.settings import SETTINGS, shown
from kvviz.spec import FULL_BITS, Spec, SpecError

# the longest prompt asked for at all; the model's positions and the work budget decide
MAX_LENGTH = 131072


DEFAULT_FILE = Path(__file__).resolve().parents[2] / "data" / "needle_default.json.gz"


# --- the disk cache ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """$KVVIZ_CACHE_DIR/needle, else $XDG_CACHE_HOME/kvviz/needle (next to the app's trace cache)."""
    env = os.environ.get("KVVIZ_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "needle"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvviz" / "needle"


def cell_key(
    model_id: str,
    prompt: NeedlePrompt,
    spec: Spec,
    question_after_compression: bool,
    new_tokens: int,
) -> str:
    """sha256 of everything that changes a cell's numbers."""
    from kvviz.version import __version__

    blob = json.dumps(
        {
            "model": model_id,
            "ids": list(prompt.ids),
            "needle": [prompt.needle_start, prompt.needle_end],
            "question_start": prompt.question_start,
            "key": prompt.key,
            # the settings away from their defaults: a setting added later leaves every older key as it was
            "spec": {k: v for k, v in spec.__dict__.items() if v != SETTINGS[k].default},
            "question_after_compression": question_after_compression,
            "new_tokens": new_tokens,
            "format": FORMAT_VERSION,
            "kvviz": __version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write(path: Path, d: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        # a read-only cache folder: results are still returned
        pass


# --- the grid ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeedleGrid:
    """Every cell of a needle run, with the prompts they were run on."""

    model: str
    settings: dict
    prompts: tuple[NeedlePrompt, ...]
    cells: tuple[NeedleCell, ...]

    def prompt(self, length: int, depth: float) -> NeedlePrompt:
        for p in self.prompts:
            if p.length == length and abs(p.depth - depth) < 1e-9:
                return p
        raise KeyError((length, depth))

    def cell(self, scorer: str, length: int, depth: float) -> NeedleCell:
        for c in self.cells:
            if c.scorer == scorer and c.length == length and abs(c.depth - depth) < 1e-9:
                return c
        raise KeyError((scorer, length, depth))

    @property
    def scorers(self) -> list[str]:
        return list(dict.fromkeys(c.scorer for c in self.cells))

    @property
    def lengths(self) -> list[int]:
        return sorted({c.length for c in self.cells})

    @property
    def depths(self) -> list[float]:
        return sorted({c.depth for c in self.cells})

    def as_dict(self, kept: bool = False, prompts: bool = False) -> dict:
        d: dict[str, Any] = {
            "model": self.model,
            "settings": self.settings,
            "cells": [c.as_dict(kept=kept) for c in self.cells],
        }
        if prompts:
            d["prompts"] = [p.as_dict() for p in self.prompts]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NeedleGrid":
        return cls(
            model=d["model"],
            settings=dict(d.get("settings", {})),
            prompts=tuple(NeedlePrompt.from_dict(p) for p in d.get("prompts", [])),
            cells=tuple(NeedleCell.from_dict(c) for c in d["cells"]),
        )

    def save(self, path: str | Path) -> None:
        blob = json.dumps(self.as_dict(kept=True, prompts=True), separators=(",", ":")).encode(
            "utf-8"
        )
        Path(path).write_bytes(gzip.compress(blob, mtime=0))

    @classmethod
    def load(cls, path: str | Path) -> "NeedleGrid":
        return cls.from_dict(json.loads(gzip.decompress(Path(path).read_bytes()).decode("utf-8")))


def protocol(grid: NeedleGrid) -> str:
    """Where the grid's caches were compressed: "agnostic" (after the haystack, before the question: kvpress's
    pipeline default) or "aware" (after the question: kvpress's compress_questions=True)."""
    return "agnostic" if grid.settings.get("question_after_compression") else "aware"


PROTOCOL_TITLES = {
    "agnostic": "Compressed before the question (query-agnostic, kvpress's pipeline default)",
    "aware": "Compressed after the question (query-aware, kvpress's compress_questions=True)",
}


def save_grids(path: str | Path, grids: Sequence[NeedleGrid]) -> None:
    """Several grids in one file (the shipped default holds both protocols): {"grids": [...]}."""
    blob = {"grids": [g.as_dict(kept=True, prompts=True) for g in grids]}
    Path(path).write_bytes(
        gzip.compress(json.dumps(blob, separators=(",", ":")).encode("utf-8"), mtime=0)
    )


def load_grids(path: str | Path | None = None) -> tuple[NeedleGrid, ...]:
    """Every grid of a file (one for a file `NeedleGrid.save` wrote), agnostic first; () if it is missing."""
    try:
        d = json.loads(gzip.decompress(Path(path or DEFAULT_FILE).read_bytes()).decode("utf-8"))
        grids = (
            tuple(NeedleGrid.from_dict(g) for g in d["grids"])
            if "grids" in d
            else (NeedleGrid.from_dict(d),)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return tuple(sorted(grids, key=lambda g: protocol(g) != "agnostic"))


def load_default(
    path: str | Path | None = None, question_after_compression: bool = False
) -> NeedleGrid | None:
    """The shipped precomputed default grid (bundled model) of one protocol (default: compressed after the
    question), or None if the file is missing or does not hold it."""
    want = "agnostic" if question_after_compression else "aware"
    return next((g for g in load_grids(path) if protocol(g) == want), None)


def check_lengths(
    lengths: Sequence[int], max_positions: int | None, new_tokens: int, minimum: int
) -> None:
    for n in lengths:
        if n < minimum:
            raise SpecError(
                f"length {n} is too short: a needle prompt needs at least {minimum} tokens for this "
                "model (frame, needle and question)"
            )
        if max_positions is not None and n + new_tokens > max_positions:
            raise SpecError(
                f"length {n} + {new_tokens} answer tokens is past the model's {max_positions} "
                f"positions; use lengths up to {max_positions - new_tokens}"
            )


def max_positions(model) -> int | None:
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


def prompt_key(
    model_id: str, length: int, depth: float, seed: int, haystack: str, task: str = "passkey"
) -> str:
    """sha256 of what decides a prompt's tokens (the model's tokenizer by its name, the task, and the texts)."""
    from kvviz.version import __version__

    shown = (
        {}
        if task == "passkey"
        else {"task": task, "instance": TASKS[task].instance(seed, length, depth).__dict__}
    )
    blob = json.dumps(
        {
            **shown,
            "model": model_id,
            "length": length,
            "depth": depth,
            "seed": seed,
            "haystack": haystack,
            "texts": [NEEDLE_TEMPLATE, QUESTION, PRIMER, INSTRUCTION, FILLER],
            "format": FORMAT_VERSION,
            "kvviz": __version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class GridRequest:
    """What a needle grid runs: every (length, depth) prompt x every (scorer, budget, bits) cell, and how each
    cell's cache is compressed and decoded. Lists become tuples; `check` says what is wrong in one line."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    scorers: tuple[str, ...] = DEFAULT_SCORERS
    budgets: tuple[float, ...] = (DEFAULT_BUDGET,)
    bits: tuple[int, ...] = (FULL_BITS,)
    # query-agnostic: compressed right after the haystack, the question decoded through the compressed cache
    question_after_compression: bool = False
    # the one-shot scorers' caches compressed again every N decode steps (kvviz.policies.decoding; 0 = once);
    # the other caches compress as they always do
    compress_every: int = 0
    new_tokens: int = DEFAULT_NEW_TOKENS
    seed: int = DEFAULT_SEED
    haystack: str = "filler"
    task: str = "passkey"  # what is hidden and asked (kvviz.analysis.needle.tasks)

    def __post_init__(self) -> None:
        for name in ("lengths", "depths", "scorers", "budgets", "bits"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def check(self) -> None:
        """SpecError naming what is wrong, before any model loads."""
        lengths = self.lengths
        if not lengths or not self.depths or not self.scorers:
            raise SpecError("give at least one length, one depth and one scorer")
        if not 1 <= min(lengths) <= max(lengths) <= MAX_LENGTH:
            raise SpecError(f"lengths are token counts of 1-{MAX_LENGTH:,}, got {max(lengths):,}")
        from kvviz.decode.eval_sweep import SWEEP_METHODS

        bad = [s for s in self.scorers if s not in SCORER_NAMES and s not in SWEEP_METHODS]
        if bad:
            raise SpecError(f"unknown scorer {bad[0]!r}; choose from {', '.join(SCORER_NAMES)}")
        if not 1 <= self.new_tokens <= 64:
            raise SpecError(f"new tokens must be 1-64, got {self.new_tokens}")
        for b in self.budgets:
            budget_tokens(b, 1000)
        for b in self.bits:
            Spec(key_bits=b, value_bits=b)
        problem = SETTINGS["compress_every"].problem(self.compress_every)
        if problem:
            raise SpecError(problem)
        if self.task not in TASKS:
            raise SpecError(f"unknown task {self.task!r}; choose from {', '.join(TASKS)}")
        if self.haystack not in HAYSTACKS:
            raise SpecError(
                f"unknown haystack {self.haystack!r}; choose from {', '.join(HAYSTACKS)}"
            )
        for scorer in (
            self.scorers
        ):  # compressing again: refused where its rule refuses it (ChunkKV's chunks)
            self.spec(scorer, self.budgets[0] if self.budgets else DEFAULT_BUDGET, FULL_BITS, 1000)

    def spec(self, scorer: str, fraction: float, bits: int, length: int) -> Spec:
        """A cell's Spec: spec_for's, compressed again every `compress_every` steps where the scorer takes the
        setting (the scorers whose Advanced section shows it: kvviz.settings.shown)."""
        spec = spec_for(scorer, fraction, bits, length)
        if not self.compress_every or not shown(SETTINGS["compress_every"], {"scorer": scorer}):
            return spec
        try:
            return spec.with_(compress_every=self.compress_every)
        except SpecError as exc:
            raise SpecError(f"{scorer}: {exc}") from None

    def settings(self) -> dict:
        """The grid's settings as NeedleGrid keeps them (compress_every only when set)."""
        out = {
            "lengths": list(self.lengths),
            "depths": [float(x) for x in self.depths],
            "scorers": list(self.scorers),
            "budgets": [float(b) for b in self.budgets],
            "bits": list(self.bits),
            "question_after_compression": self.question_after_compression,
            "new_tokens": self.new_tokens,
            "seed": self.seed,
            "haystack": self.haystack,
        }
        if self.compress_every:
            out["compress_every"] = self.compress_every
        if self.task != "passkey":
            out["task"] = self.task
        return out


def run_grid(
    model,
    tokenizer,
    model_id: str = "bundled",
    request: GridRequest | None = None,
    use_cache: bool = True,
    progress: Progress | None = None,
    stats: dict | None = None,
    load: Callable[[], tuple[Any, Any]] | None = None,
) -> NeedleGrid:
    """Every (length, depth) prompt x every (scorer, budget, bits) cell of `request` (default: GridRequest()).

    One prefill per prompt, only when some cell of it is not on disk yet. With
    model = tokenizer = None and a `load` function, the model is loaded only when a
    prompt or a cell is not on disk (a fully cached rerun needs no model at all).
    `stats`, if given, receives counts of cells computed and read from the cache, and
    the seconds.
    """
    req = request if request is not None else GridRequest()
    req.check()
    lengths, depths, scorers, budgets, bits = (
        req.lengths,
        req.depths,
        req.scorers,
        req.budgets,
        req.bits,
    )
    new_tokens, seed, haystack, task = req.new_tokens, req.seed, req.haystack, req.task
    if model is None and load is None:
        raise ValueError("run_grid needs a model and tokenizer, or a load function")
    say = progress or (lambda f, m: None)
    folder = cache_dir()
    held = {"model": model, "tokenizer": tokenizer}

    def need_model():
        if held["model"] is None:
            held["model"], held["tokenizer"] = load()
        return held["model"], held["tokenizer"]

    jobs = [(n, d) for n in lengths for d in depths]
    stored = {}
    for n, d in jobs:
        hit = (
            _read(folder / "prompts" / f"{prompt_key(model_id, n, d, seed, haystack, task)}.json")
            if use_cache
            else None
        )
        if hit is not None:
            stored[(n, d)] = hit
    if len(stored) == len(jobs) and held["model"] is None:
        limits = stored[jobs[0]]
        check_lengths(lengths, limits["max_positions"], new_tokens, limits["min_length"])
    else:
        m, tok = need_model()
        check_lengths(lengths, max_positions(m), new_tokens, min_length(tok, task))
        prefill_work(model_dims(m), max(lengths), "the longest needle prompt").check()
    prompts, cells = [], []
    computed = cached = 0
    t0 = time.perf_counter()
    variants = [
        (s, b, q) for s in scorers for b in (budgets if s != FULL else (1.0,)) for q in bits
    ]
    variants = list(dict.fromkeys(variants))
    total = len(jobs) * (len(variants) + 1)
    done = 0
    full_spec = Spec()
    for n, d in jobs:
        if (n, d) in stored:
            prompt = NeedlePrompt.from_dict(stored[(n, d)]["prompt"])
        else:
            m, tok = need_model()
            prompt = build_prompt(tok, n, d, seed=seed, haystack=haystack, task=task)
            _write(
                folder / "prompts" / f"{prompt_key(model_id, n, d, seed, haystack, task)}.json",
                {
                    "prompt": prompt.as_dict(),
                    "max_positions": max_positions(m),
                    "min_length": min_length(tok, task),
                },
            )
        prompts.append(prompt)
        pre = attn = None

        def get(spec: Spec, qac: bool, what: str) -> dict:
            nonlocal pre, attn, computed, cached
            checkpoint()
            path = folder / f"{cell_key(model_id, prompt, spec, qac, new_tokens)}.json"
            hit = _read(path) if use_cache else None
            if hit is not None:
                cached += 1
                return hit
            if pre is None:
                if held["model"] is None:
                    say(done / total, "loading the model")
                m, _ = need_model()
                say(done / total, f"length {n}, depth {d:.0%}: prefill")
                pre = prefill(m, prompt.ids, logits_at=[prompt.question_start - 1])
                attn = _first_answer_attention(pre, n - 1)
            say(done / total, f"length {n}, depth {d:.0%}: {what}")
            m, tok = need_model()
            out = run_cell(m, tok, prompt, pre, spec, qac, new_tokens, attention=attn)
            computed += 1
            _write(path, out)
            return json.loads(json.dumps(out))  # exactly what a later read returns

        full = get(full_spec, False, "full cache")
        done += 1
        for scorer, frac, b in variants:
            spec = req.spec(scorer, frac, b, n)
            qac = req.question_after_compression and spec != full_spec
            out = full if (spec == full_spec) else get(spec, qac, f"{scorer} {frac:g} {b}-bit")
            done += 1
            cells.append(
                NeedleCell.from_dict(
                    {
                        **out,
                        "scorer": scorer,
                        "length": n,
                        "depth": float(d),
                        "budget": 1.0 if scorer == FULL else frac,
                        "bits": b,
                        "question_after_compression": qac,
                        "full_answer": full["answer"],
                        "full_correct": full["correct"],
                    }
                )
            )
    say(1.0, f"{len(cells)} cells: {computed} computed, {cached} from the cache")
    if stats is not None:
        stats.update(computed=computed, cached=cached, seconds=time.perf_counter() - t0)
    settings = req.settings()
    return NeedleGrid(model=model_id, settings=settings, prompts=tuple(prompts), cells=tuple(cells))


CSV_FIELDS = (
    "scorer",
    "length",
    "depth",
    "budget",
    "bits",
    "question_after_compression",
    "budget_tokens",
    "key",
    "correct",
    "answer",
    "full_answer",
    "full_correct",
    "needle_kept",
    "wanted_mass",
    "kept_mass",
    "spec",
)


def to_csv(grid: NeedleGrid) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for c in grid.cells:
        d = c.as_dict()
        w.writerow(
            {
                k: (f"{v:.6g}" if isinstance(v, float) else v)
                for k, v in d.items()
                if k in CSV_FIELDS
            }
        )
    return buf.getvalue()


def format_grid(grid: NeedleGrid) -> str:
    """Plain-text grid: one block per scorer (and budget/bits), rows = depth, columns = length."""
    lines = []
    groups = list(dict.fromkeys((c.scorer, c.budget, c.bits) for c in grid.cells))
    lengths = grid.lengths
    for scorer, budget, bits in groups:
        title = scorer if scorer == FULL else f"{scorer} {budget:g}"
        if bits != FULL_BITS:
            title += f" {bits}-bit"
        lines.append(f"{title:<18}" + "".join(f"{n:>14}" for n in lengths))
        for d in grid.depths:
            row = []
            for n in lengths:
                c = next(
                    (
                        c
                        for c in grid.cells
                        if (c.scorer, c.budget, c.bits, c.length) == (scorer, budget, bits, n)
                        and abs(c.depth - d) < 1e-9
                    ),
                    None,
                )
                row.append(
                    "" if c is None else f"{'ok' if c.correct else 'MISS'} {c.needle_kept:4.0%}"
                )
            lines.append(f"  depth {d:>4.0%}      " + "".join(f"{r:>14}" for r in row))
        n_ok = sum(
            c.correct for c in grid.cells if (c.scorer, c.budget, c.bits) == (scorer, budget, bits)
        )
        n_all = sum(1 for c in grid.cells if (c.scorer, c.budget, c.bits) == (scorer, budget, bits))
        lines.append(f"  correct {n_ok}/{n_all}")
    lines.append(
        "cells: ok/MISS = the key exactly right or not; % = needle tokens kept over all layers x KV heads"
    )
    return "\n".join(lines)


# --- what the page opens on ----------------------------------------------------------------------


def classic_failure(grid: NeedleGrid) -> tuple[str, int, float] | None:
    """The classic failure to show in one click: StreamingLLM (else any policy) wrong where the
    full cache is right, the needle nearest the start, at the shortest such length."""
    for scorer in ("streaming", *[s for s in grid.scorers if s not in ("streaming", FULL)]):
        bad = [c for c in grid.cells if c.scorer == scorer and not c.correct and c.full_correct]
        if bad:
            c = min(bad, key=lambda c: (c.depth, c.length))
            return c.scorer, c.length, c.depth
    return None


def loudest_head(cell: NeedleCell) -> tuple[int, int]:
    """(layer, KV head) where the full model wanted the needle most (where a loss hurts most)."""
    w = np.asarray(cell.wanted_mass_by_head)
    layer, head = np.unravel_index(int(np.argmax(w)), w.shape)
    return int(layer), int(head)
