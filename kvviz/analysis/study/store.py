"""A study's folder: one Parquet part file per finished cell, and what the folder was run with.

    DIR/study.toml       the study file of the last run, as written
    DIR/study.json       its name, kind, fixed settings and cell ids (what status, export and the app read)
    DIR/parts/ID.parquet one row per finished cell: written to a hidden temporary name, then renamed,
                         so a killed run leaves whole parts or none
    DIR/failed.json      the cells that failed in the last run, with their one-line errors

The resume rule: a folder holds one study under one set of fixed settings (its name, its kind and
every [source] key that is not a list). Rerunning with the same fixed settings skips the finished
cells; the lists (seeds, texts, models, scorers, budgets, ...) may grow or shrink: new cells run,
cells no longer listed stay on disk but are left out of status, export and the app. A file whose
fixed settings differ is refused, naming the key: its numbers would not be comparable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvviz.analysis.study.schema import FORMAT, Cell, Study, StudyError

STUDY_TOML = "study.toml"
STUDY_JSON = "study.json"
PARTS = "parts"
FAILED = "failed.json"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class StudyDir:
    """One study's results folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # -- what the folder was run with ---------------------------------------------------------------

    def meta(self) -> dict:
        """study.json; StudyError when the folder holds no study."""
        try:
            meta = json.loads((self.path / STUDY_JSON).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StudyError(
                f"{self.path} holds no study (no {STUDY_JSON}): run `kvviz study run FILE --out {self.path}` first"
            ) from None
        except (OSError, ValueError) as exc:
            raise StudyError(f"{self.path / STUDY_JSON} is unreadable ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("cells"), list):
            raise StudyError(f"{self.path / STUDY_JSON} is not a kvviz study record (format {FORMAT})")
        return meta

    def exists(self) -> bool:
        return (self.path / STUDY_JSON).is_file()

    def prepare(self, study: Study, cells: list[Cell]) -> None:
        """Create the folder, or check that it holds this study under the same fixed settings; then
        record the study file and its cells. Refuses (StudyError) a folder of another study or of
        other fixed settings, and changes nothing then."""
        if self.path.exists() and not self.path.is_dir():
            raise StudyError(f"--out {self.path} is a file, not a folder")
        if self.exists():
            old = self.meta()
            mismatch = _first_difference(old["fixed"], study.fixed())
            if mismatch is not None:
                key, was, now = mismatch
                where = key if key in ("name", "kind") else f"[source] {key}"
                raise StudyError(
                    f"{self.path} holds study {old['fixed'].get('name')!r} run with {where} = "
                    f"{_toml(was)}; this study file says {_toml(now)}. Results under other fixed "
                    "settings would mix with incomparable ones: use a new --out folder (or move "
                    "the old one aside). Lists (seeds, texts, models, scorers, budgets, ...) may "
                    "change; other keys may not."
                )
        elif self.path.exists() and any(p for p in self.path.iterdir() if not p.name.startswith(".")):
            raise StudyError(f"--out {self.path} is a folder with other files in it; give a new or empty folder")
        (self.path / PARTS).mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT,
            "name": study.name,
            "kind": study.kind,
            "description": study.description,
            "fixed": study.fixed(),
            "axes": study.axes(),
            "cells": [{"id": c.id, **c.settings} for c in cells],
        }
        _atomic_write(self.path / STUDY_TOML, study.text.encode("utf-8"))
        _atomic_write(self.path / STUDY_JSON, json.dumps(meta, indent=1).encode("utf-8"))

    # -- parts -------------------------------------------------------------------------------------

    def done_ids(self) -> set[str]:
        parts = self.path / PARTS
        if not parts.is_dir():
            return set()
        return {p.stem for p in parts.glob("*.parquet") if not p.name.startswith(".")}

    def write_part(self, cell_id: str, row: dict) -> Path:
        """One finished cell, written whole or not at all (a temporary name, then a rename)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        final = self.path / PARTS / f"{cell_id}.parquet"
        tmp = final.with_name(f".{cell_id}.{os.getpid()}.tmp")
        pq.write_table(pa.Table.from_pylist([row]), tmp)
        os.replace(tmp, final)
        return final

    def write_failures(self, failures: list[dict]) -> None:
        _atomic_write(self.path / FAILED, json.dumps(failures, indent=1).encode("utf-8"))

    def failures(self) -> list[dict]:
        try:
            out = json.loads((self.path / FAILED).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return out if isinstance(out, list) else []

    # -- reading -----------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        meta = self.meta()
        ids = {c["id"] for c in meta["cells"]}
        done = self.done_ids()
        return {
            "cells": len(ids),
            "done": len(ids & done),
            "to_run": len(ids - done),
            "extra": len(done - ids),
            "failed": len({f.get("cell") for f in self.failures()} - done),
        }

    def status_line(self) -> str:
        c = self.counts()
        return f"study {self.meta()['name']}: {c['cells']} cells, {c['done']} done, {c['to_run']} to run"

    def rows(self):
        """The finished cells of the recorded study, one row each (a pandas DataFrame), in grid order."""
        import pandas as pd
        import pyarrow.parquet as pq

        meta = self.meta()
        done = self.done_ids()
        frames = []
        for c in meta["cells"]:
            if c["id"] not in done:
                continue
            part = self.path / PARTS / f"{c['id']}.parquet"
            try:
                frames.append(pq.read_table(part).to_pandas())
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise StudyError(
                    f"{part} is unreadable ({str(exc).splitlines()[0][:200]}); delete it and rerun "
                    "the study to compute that cell again"
                ) from None
        if not frames:
            return pd.DataFrame()
        return pd.concat(frames, ignore_index=True)

    def export_csv(self, dest: str | Path | None = None) -> tuple[Path, int]:
        rows = self.rows()
        out = Path(dest) if dest else self.path / f"{self.meta()['name']}.csv"
        rows.to_csv(out, index=False)
        return out, len(rows)


def _first_difference(old: dict, new: dict) -> tuple[str, Any, Any] | None:
    for key in ("name", "kind", *sorted(set(old) | set(new))):
        if old.get(key) != new.get(key):
            return key, old.get(key), new.get(key)
    return None


def _toml(v: Any) -> str:
    if v is None:
        return "(not set)"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def row_for(study: Study, cell: Cell, result: dict, engine: str) -> dict:
    """A part file's row: study, cell id, the cell's settings, the fixed settings, metrics, versions,
    wall time."""
    fixed = {k: v for k, v in study.fixed().items() if k != "name"}
    return {
        "study": study.name,
        "cell": cell.id,
        **cell.settings,
        **fixed,
        **result["metrics"],
        **result["versions"],
        "wall_time_s": result["seconds"],
        "engine": engine,
    }
