"""A needle run's results: `NeedleGrid` (the prompts and every cell), the gzip JSON file it is saved
in, the two protocols (where the caches were compressed) and the shipped default grid of both."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvviz.analysis.needle.cell import NeedleCell
from kvviz.analysis.needle.prompt import NeedlePrompt

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "data" / "needle_default.json.gz"


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
        blob = json.dumps(self.as_dict(kept=True, prompts=True), separators=(",", ":")).encode("utf-8")
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
    Path(path).write_bytes(gzip.compress(json.dumps(blob, separators=(",", ":")).encode("utf-8"), mtime=0))


def load_grids(path: str | Path | None = None) -> tuple[NeedleGrid, ...]:
    """Every grid of a file (one for a file `NeedleGrid.save` wrote), agnostic first; () if it is missing."""
    try:
        d = json.loads(gzip.decompress(Path(path or DEFAULT_FILE).read_bytes()).decode("utf-8"))
        grids = tuple(NeedleGrid.from_dict(g) for g in d["grids"]) if "grids" in d else (NeedleGrid.from_dict(d),)
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return tuple(sorted(grids, key=lambda g: protocol(g) != "agnostic"))


def load_default(path: str | Path | None = None, question_after_compression: bool = False) -> NeedleGrid | None:
    """The shipped precomputed default grid (bundled model) of one protocol (default: compressed after the
    question), or None if the file is missing or does not hold it."""
    want = "agnostic" if question_after_compression else "aware"
    return next((g for g in load_grids(path) if protocol(g) == want), None)
