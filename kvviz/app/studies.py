"""The Studies page's parts: which study folders the browser may open, the shipped example, the
frontier chart, and the click that opens a point's setting in the Explorer or the Model lab.

The browser never names an arbitrary file: the `study` link parameter is a folder *under* the
studies root ($KVVIZ_STUDIES_DIR, default `runs/` in the working directory), checked after
resolving `..` and symlinks; anything else is refused with a notice and nothing is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from kvviz.analysis.study import StudyDir, StudyError, cells, load_study, run_study
from kvviz.analysis.study.frontier import METRICS, X_COLUMN, frontier
from kvviz import links
from kvviz.analysis.sweep import split_budget
from kvviz.app.charts import chart
from kvviz.app.layout import PAGES
from kvviz.app.params import PARAMS
from kvviz.app.store import STORE, notice, relink, state, w_choice
from kvviz.plots.style import CHART_CONFIG, projector
from kvviz.plots.study import frontier_figure
from kvviz.spec import FULL_BITS, Spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "studies"
# the Explorer's synthetic knobs a link can carry (study key -> URL name): the link's own table, read
# backwards (a study names a knob as SyntheticSpec does), and the layer the study evaluates
SYNTHETIC_PARAMS = {field: name for name, field in links.SYNTHETIC_PARAMS.items()} | {"layer": "layer"}


def studies_root() -> Path:
    """Where the browser may open studies: $KVVIZ_STUDIES_DIR, else ./runs."""
    return Path(os.environ.get("KVVIZ_STUDIES_DIR") or Path.cwd() / "runs").expanduser().resolve()


def resolve_study(name: str, root: Path | None = None) -> Path:
    """The folder a link names, inside the root; StudyError (nothing read) otherwise."""
    root = root or studies_root()
    text = (name or "").strip()
    if not text or "\x00" in text:
        raise StudyError("no study named")
    path = (root / text).resolve()
    if path != root and not path.is_relative_to(root):
        raise StudyError(
            f"`{text}` is outside the studies folder {root} (set KVVIZ_STUDIES_DIR to change it); open a study under it"
        )
    if not (path / "study.json").is_file():
        raise StudyError(
            f"`{text}` is not a study folder under {root}: run `kvviz study run FILE --out {root / 'NAME'}` first"
        )
    return path


def list_studies(root: Path | None = None) -> list[str]:
    """Study folders under the root (one and two levels down), as names relative to it."""
    root = root or studies_root()
    if not root.is_dir():
        return []
    found = [p.parent for p in (*root.glob("*/study.json"), *root.glob("*/*/study.json"))]
    return sorted(str(p.relative_to(root)) for p in found if p.resolve().is_relative_to(root))


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.toml"))


@st.cache_data(show_spinner=False, max_entries=16)
def _rows(path: str, stamp: tuple):
    """A study folder's rows, re-read when a part file is added (stamp: the parts' count and newest time)."""
    return StudyDir(path).rows()


def _stamp(path: Path) -> tuple:
    parts = list((path / "parts").glob("*.parquet"))
    return len(parts), max((p.stat().st_mtime_ns for p in parts), default=0)


def load_rows(path: Path):
    return _rows(str(path), _stamp(path))


# --- the shipped example ---------------------------------------------------------------------------


def example_section(root: Path) -> None:
    """The shipped examples: the command that runs each, and a button that runs a synthetic one into
    the root (the only thing the browser may write, and only there)."""
    for ex in examples():
        try:
            study = load_study(ex)
        except StudyError as exc:
            st.error(f"{ex.name}: {exc}")
            continue
        rel = ex.relative_to(EXAMPLES.parents[1])
        st.markdown(f"**{study.name}** — {study.description or study.kind} ({len(cells(study))} cells, {study.kind})")
        st.code(f"kvviz study run {rel} --out {root / study.name}", language="bash")
        if study.kind == "synthetic" and not (root / study.name / "study.json").exists():
            if st.button(
                f"Run {study.name} here (seconds)", key=f"run_example_{study.name}", icon=":material/play_circle:"
            ):
                bar = st.progress(0.0, text="starting")
                counts = {}

                def start(report) -> None:
                    counts["total"] = max(report.to_run, 1)
                    counts["done"] = 0

                def cell(c, result) -> None:
                    counts["done"] += 1
                    bar.progress(counts["done"] / counts["total"], text=f"{counts['done']} of {counts['total']} cells")

                root.mkdir(parents=True, exist_ok=True)
                run_study(ex, root / study.name, on_start=start, on_cell=cell)
                state()["study"] = study.name
                # the picker takes the store's value when it renders
                st.session_state.pop("study", None)
                st.rerun()


# --- the chart and the click ----------------------------------------------------------------------


def frontier_section(path: Path, present: bool = False) -> None:
    folder = StudyDir(path)
    meta = folder.meta()
    kind = meta["kind"]
    counts = folder.counts()
    st.caption(
        f"{meta['name']}: {counts['cells']} cells, {counts['done']} done, {counts['to_run']} to run"
        + (f" — {meta['description']}" if meta.get("description") else "")
    )
    rows = load_rows(path)
    if rows.empty:
        st.info("No cell has finished yet: run the study (`kvviz study run`), then reload.", icon=":material/info:")
        return
    metrics = METRICS[kind]
    # a link of another kind of study, or none: its first measure
    if state()["st_metric"] not in metrics:
        state()["st_metric"] = next(iter(metrics))
        st.session_state.pop("st_metric", None)
        relink()
    metric = w_choice(st, "st_metric", "Measure", tuple(metrics), widget="radio", format_func=lambda m: metrics[m][0])
    fr = frontier(rows, kind, metric)
    fig = frontier_figure(
        fr,
        X_COLUMN[kind],
        title=f"{meta['name']}: {metrics[metric][0]} vs "
        + ("memory" if X_COLUMN[kind] == "memory_ratio" else "budget"),
    )
    if present:  # a projector's text sizes, the methods' legend beside the plot
        fig = projector(fig, height=470, legend_right=True)
    picked = chart(fig, key="study_chart", config=CHART_CONFIG, selectable=kind != "needle")
    points = [p for p in picked if p.get("customdata")] if kind != "needle" else []
    if points:
        hit = rows[rows["cell"] == points[0]["customdata"][0]]
        if len(hit):
            open_cell(hit.iloc[0].to_dict())
    if not present:
        st.caption(
            f"Each point is the mean over the study's {fr.replicates} (N on hover); the bars a 95% "
            "t-interval for that mean. The dashed line is the Pareto frontier of the real policies (the "
            "oracle is the bound). "
            + {
                "synthetic": "Click a point to open its first seed in the Explorer.",
                "model": "Click a point to open its setting on its first text in the Model lab.",
                "needle": "Open a cell on the Needle test page with `kvviz needle`.",
            }[kind]
        )
        with st.expander("All cells"):
            st.dataframe(rows, hide_index=True, key="study_rows")


def values_from_spec(spec: Spec) -> dict:
    """The compression controls' stored values (URL names) that describe `spec` (the inverse of
    kvviz.app.compression.spec_from_values): every setting a link carries, from the settings table, and the
    bits slider."""
    from kvviz.links import NOT_IN_LINKS
    from kvviz.settings import SETTINGS

    split = spec.key_bits != spec.value_bits
    values = {
        s.url_name: s.none_as if getattr(spec, s.name) is None else getattr(spec, s.name)
        for s in SETTINGS.values()
        if s.name not in NOT_IN_LINKS
    }
    return values | dict(split=split, bits=spec.key_bits if not split else FULL_BITS)


def _setting_values(row: dict) -> dict:
    """The Spec-setting axes a study row names (a column other cells leave empty is not the row's)."""
    import math

    from kvviz.analysis.study.schema import setting_axes
    from kvviz.settings import SETTINGS

    out = {}
    for k in setting_axes():
        v = row.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if SETTINGS[k].kind == "int" and isinstance(v, float) and v.is_integer():
            v = int(v)
        out[k] = SETTINGS[k].coerce(v)
    return out


def cell_values(row: dict) -> tuple[dict, str, list[str]]:
    """(store values, page, notes) that open a study row's setting: a synthetic cell in the
    Explorer, a model cell in the Model lab. Notes say what the page cannot reproduce."""
    notes: list[str] = []
    if row["kind"] == "synthetic":
        values = {"source": "synthetic", "ensemble": row.get("ensemble", "heads")}
        values.update({url: row[k] for k, url in SYNTHETIC_PARAMS.items() if k in row})
        for k in ("shift_at", "n_shift_tokens"):
            from kvviz.sources.synthetic import SyntheticSpec

            if k in row and row[k] != getattr(SyntheticSpec(), k):
                notes.append(f"the Explorer has no control for `{k}` ({row[k]}); it uses the default")
        scorer = row["scorer"]
        evict = dict(sink=0, recent=0, heavy=0) if scorer == "full" else split_budget(scorer, int(row["budget_tokens"]))
        fmt = row.get("format", "int")
        # every compression control as the study's Spec had it (the app's own defaults differ: partial groups)
        values.update({k: v for k, v in values_from_spec(Spec()).items() if k != "scorer"})
        values.update(
            evict, bits=int(row["bits"]) if fmt == "int" else FULL_BITS, split=False, key_fmt=fmt, value_fmt=fmt
        )
        if scorer != "full":
            values["scorer"] = scorer
        return values, "explorer", notes
    from kvviz.analysis.study.grid import model_spec

    spec = model_spec(
        row["method"], float(row["budget"]), int(row["bits"]), int(row["prompt_tokens"]), _setting_values(row)
    )
    values = values_from_spec(spec)
    cont = row.get("scored_tokens") or 57
    values.update(lab_prompt=int(row["prompt_tokens"]), lab_cont=int(cont), lab_text="sample")
    if isinstance(row.get("question"), str) and row["question"].strip():
        values.update(lab_question=row["question"], lab_point=row.get("question_point") or "before-question")
    if row.get("text") != "sample":
        notes.append(
            f"the Model lab opens on its sample text, not the study's text {row.get('text')!r} "
            "(paste it under Your own text)"
        )
    return values, "model_lab", notes


def open_cell(row: dict) -> None:
    """Set the controls to a clicked cell's setting and go to its page."""
    values, page, notes = cell_values(row)
    for name, value in values.items():
        if name not in PARAMS:
            continue
        # clamped to what a link may carry
        value, note = PARAMS[name].parse(PARAMS[name].encode(value))
        if note:
            notes.append(note)
        st.session_state[STORE][name] = value
        # the widget takes the store's value when it renders
        st.session_state.pop(name, None)
    if page == "model_lab":
        st.session_state["lab_model"] = row.get("model", "bundled")
    for n in notes:
        notice(n)
    if page in PAGES:
        st.switch_page(PAGES[page])
