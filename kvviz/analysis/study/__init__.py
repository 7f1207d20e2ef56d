"""Studies: one study file (TOML) describing a grid of cells, run on this machine or on Ray, each
finished cell kept at once as a Parquet part file, resumable, read back by status, export and the app.

    schema   the study file: keys, types, checks (StudyError names the key), cell ids
    grid     the cells: the product of the file's lists, each checked as its command would
    cells    running one cell (synthetic -> analysis.sweep, model -> decode, needle -> analysis.needle)
    engines  local (this process or a process pool) and Ray (tasks; model actors loading once)
    store    the results folder: part files, the resume rule, status, export
    runner   run_study: plan, run what is left, write parts as they finish
    frontier mean and 95% t-interval over seeds / texts / prompts, and the Pareto frontier

May import: the core, sources, policies, analysis (sweep, needle), decode and models (lazily, for
model cells); pyarrow and Ray lazily, Ray in engines only. Never plotly or Streamlit.
"""

from kvviz.analysis.study.engines import ENGINES, RAY_MISSING
from kvviz.analysis.study.runner import RunReport, plan, run_study
from kvviz.analysis.study.grid import cells, load_study, parse_study
from kvviz.analysis.study.schema import Cell, Study, StudyError
from kvviz.analysis.study.store import StudyDir

__all__ = [
    "Cell",
    "ENGINES",
    "cells",
    "RAY_MISSING",
    "RunReport",
    "Study",
    "StudyDir",
    "StudyError",
    "load_study",
    "parse_study",
    "plan",
    "run_study",
]
