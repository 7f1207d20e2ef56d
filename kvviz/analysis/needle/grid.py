"""The needle grid run: what it runs (`GridRequest`: lengths x depths x policies, checked before any
model loads) and `run_grid`, one prefill a prompt, reading and keeping prompts and cells in the disk
cache (kvviz.analysis.needle.store); what it returns is a `NeedleGrid` (kvviz.analysis.needle.results)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from kvviz.analysis.needle.cell import NeedleCell, _first_answer_attention, prefill, run_cell
from kvviz.analysis.needle.tasks import TASKS
from kvviz.analysis.needle.prompt import (
    DEFAULT_BUDGET,
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_SCORERS,
    DEFAULT_SEED,
    FULL,
    HAYSTACKS,
    SCORER_NAMES,
    NeedlePrompt,
    Progress,
    budget_tokens,
    build_prompt,
    min_length,
    spec_for,
)
from kvviz.analysis.needle.results import NeedleGrid
from kvviz.analysis.needle.store import _read, _write, cache_dir, cell_key, prompt_key
from kvviz.limits import checkpoint
from kvviz.models.config import model_dims, prefill_work
from kvviz.settings import SETTINGS, shown
from kvviz.spec import FULL_BITS, Spec, SpecError

# the longest prompt asked for at all; the model's positions and the work budget decide
MAX_LENGTH = 131072


# --- the grid ------------------------------------------------------------------------------


def check_lengths(lengths: Sequence[int], max_positions: int | None, new_tokens: int, minimum: int) -> None:
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
            raise SpecError(f"unknown haystack {self.haystack!r}; choose from {', '.join(HAYSTACKS)}")
        for scorer in self.scorers:  # compressing again: refused where its rule refuses it (ChunkKV's chunks)
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
    if model is None and load is None:
        raise ValueError("run_grid needs a model and tokenizer, or a load function")
    run = _GridRun(req, model_id, use_cache, progress or (lambda f, m: None), model, tokenizer, load)
    run.check_lengths()
    prompts, cells = [], []
    for n, d in run.jobs:
        prompt = run.prompt(n, d)
        prompts.append(prompt)
        cells += run.cells_of(prompt, n, d)
    run.say(1.0, f"{len(cells)} cells: {run.computed} computed, {run.cached} from the cache")
    if stats is not None:
        stats.update(computed=run.computed, cached=run.cached, seconds=time.perf_counter() - run.t0)
    return NeedleGrid(model=model_id, settings=req.settings(), prompts=tuple(prompts), cells=tuple(cells))


class _GridRun:
    """One run of a grid: the model (loaded on first need), the prompts on disk, the progress and counts."""

    def __init__(self, req: GridRequest, model_id, use_cache, say, model, tokenizer, load) -> None:
        self.req, self.model_id, self.use_cache, self.say = req, model_id, use_cache, say
        self._model, self._tokenizer, self._load = model, tokenizer, load
        self.folder = cache_dir()
        self.jobs = [(n, d) for n in req.lengths for d in req.depths]
        variants = [(s, b, q) for s in req.scorers for b in (req.budgets if s != FULL else (1.0,)) for q in req.bits]
        self.variants = list(dict.fromkeys(variants))
        self.total, self.done = len(self.jobs) * (len(self.variants) + 1), 0
        self.computed = self.cached = 0
        self.t0 = time.perf_counter()
        self.stored = {}  # (length, depth) -> the prompt's record on disk
        for n, d in self.jobs:
            hit = _read(self._prompt_path(n, d)) if use_cache else None
            if hit is not None:
                self.stored[(n, d)] = hit

    def model(self):
        if self._model is None:
            self._model, self._tokenizer = self._load()
        return self._model, self._tokenizer

    def _prompt_path(self, n: int, d: float) -> Path:
        req = self.req
        return self.folder / "prompts" / f"{prompt_key(self.model_id, n, d, req.seed, req.haystack, req.task)}.json"

    def check_lengths(self) -> None:
        """The lengths against the model's positions: from the prompts on disk if all are, else the model."""
        req = self.req
        if len(self.stored) == len(self.jobs) and self._model is None:
            limits = self.stored[self.jobs[0]]
            check_lengths(req.lengths, limits["max_positions"], req.new_tokens, limits["min_length"])
            return
        m, tok = self.model()
        check_lengths(req.lengths, max_positions(m), req.new_tokens, min_length(tok, req.task))
        prefill_work(model_dims(m), max(req.lengths), "the longest needle prompt").check()

    def prompt(self, n: int, d: float) -> NeedlePrompt:
        """The prompt of a length and depth: from disk, else built (and kept)."""
        if (n, d) in self.stored:
            return NeedlePrompt.from_dict(self.stored[(n, d)]["prompt"])
        req = self.req
        m, tok = self.model()
        prompt = build_prompt(tok, n, d, seed=req.seed, haystack=req.haystack, task=req.task)
        record = {
            "prompt": prompt.as_dict(),
            "max_positions": max_positions(m),
            "min_length": min_length(tok, req.task),
        }
        _write(self._prompt_path(n, d), record)
        return prompt

    def cells_of(self, prompt: NeedlePrompt, n: int, d: float) -> list[NeedleCell]:
        """The full cache's cell and every variant's of one prompt; one prefill, only if some cell is not on
        disk."""
        req, full_spec = self.req, Spec()
        # the prompt's prefill, made for the first cell not on disk; the progress says where it is
        shared = {"where": f"length {n}, depth {d:.0%}"}
        full = self._cell(prompt, full_spec, False, "full cache", shared)
        self.done += 1
        cells = []
        for scorer, frac, bits in self.variants:
            spec = req.spec(scorer, frac, bits, n)
            qac = req.question_after_compression and spec != full_spec
            if spec == full_spec:
                out = full
            else:
                out = self._cell(prompt, spec, qac, f"{scorer} {frac:g} {bits}-bit", shared)
            self.done += 1
            fields = {
                "scorer": scorer,
                "length": n,
                "depth": float(d),
                "budget": 1.0 if scorer == FULL else frac,
                "bits": bits,
                "question_after_compression": qac,
                "full_answer": full["answer"],
                "full_correct": full["correct"],
            }
            cells.append(NeedleCell.from_dict({**out, **fields}))
        return cells

    def _cell(self, prompt: NeedlePrompt, spec: Spec, qac: bool, what: str, shared: dict) -> dict:
        """One cell's record: from disk, else run on the prompt's prefill (made once, kept in `shared` beside
        where the prompt is in the grid); `what` names the cell in the progress."""
        checkpoint()
        path = self.folder / f"{cell_key(self.model_id, prompt, spec, qac, self.req.new_tokens)}.json"
        hit = _read(path) if self.use_cache else None
        if hit is not None:
            self.cached += 1
            return hit
        fraction = self.done / self.total
        if "prefill" not in shared:
            if self._model is None:
                self.say(fraction, "loading the model")
            m, _ = self.model()
            self.say(fraction, f"{shared['where']}: prefill")
            shared["prefill"] = prefill(m, prompt.ids, logits_at=[prompt.question_start - 1])
            shared["attention"] = _first_answer_attention(shared["prefill"], len(prompt.ids) - 1)
        self.say(fraction, f"{shared['where']}: {what}")
        m, tok = self.model()
        out = run_cell(m, tok, prompt, shared["prefill"], spec, qac, self.req.new_tokens, attention=shared["attention"])
        self.computed += 1
        _write(path, out)
        return json.loads(json.dumps(out))  # exactly what a later read returns
