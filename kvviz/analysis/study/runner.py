"""`run_study`: check the file, prepare the folder (the resume rule), run what is left, write each
finished cell's part file the moment it arrives, record the failures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvviz.analysis.study.engines import run
from kvviz.analysis.study.grid import cells as grid_cells
from kvviz.analysis.study.grid import load_study
from kvviz.analysis.study.schema import Cell, Study
from kvviz.analysis.study.store import StudyDir, row_for


@dataclass
class RunReport:
    """What one run did: the counts before it, and the cells it finished and failed."""

    name: str
    cells: int
    done_before: int
    to_run: int
    finished: int = 0
    failures: list[dict] = field(default_factory=list)

    def start_line(self) -> str:
        return f"study {self.name}: {self.cells} cells, {self.done_before} done, {self.to_run} to run"


def plan(study: Study | str | Path, out: str | Path) -> tuple[Study, StudyDir, list[Cell], RunReport]:
    """The checked study, its prepared folder, the cells left to run, and the counts (nothing runs)."""
    study = study if isinstance(study, Study) else load_study(study)
    cells = grid_cells(study)
    folder = StudyDir(out)
    folder.prepare(study, cells)
    done = folder.done_ids()
    todo = [c for c in cells if c.id not in done]
    return study, folder, todo, RunReport(study.name, len(cells), len(cells) - len(todo), len(todo))


def run_study(
    study: Study | str | Path,
    out: str | Path,
    engine: str = "local",
    workers: int = 1,
    address: str | None = None,
    on_start: Callable[[RunReport], None] | None = None,
    on_cell: Callable[[Cell, dict], None] | None = None,
) -> RunReport:
    """Run the cells of `study` not yet in `out`; each finished cell is a part file at once."""
    study, folder, todo, report = plan(study, out)
    if on_start is not None:
        on_start(report)

    def finished(cell: Cell, result: dict) -> None:
        if "error" in result:
            report.failures.append({"cell": cell.id, "settings": cell.settings, "error": result["error"]})
        else:
            folder.write_part(cell.id, row_for(study, cell, result, engine))
            report.finished += 1
        if on_cell is not None:
            on_cell(cell, result)

    try:
        if todo:
            run(study, todo, finished, engine=engine, workers=workers, address=address)
    finally:
        folder.write_failures(report.failures)
    return report
