"""The Trade-offs page's leaderboard section: the shipped board (every method at four compression ratios, both
question protocols, on the bundled model), its table and CSV, and a live run of your own choice."""

from __future__ import annotations

import streamlit as st

from kvviz.analysis import leaderboard as lb
from kvviz.analysis.needle.tasks import TASKS
from kvviz.app.charts import chart, folded
from kvviz.app.layout import progress_status
from kvviz.plots.leaderboard import leaderboard_figure, method_look
from kvviz.plots.style import CHART_CONFIG
from kvviz.spec import SpecError

LIVE = "leaderboard_live"


@st.cache_resource(show_spinner=False)
def _shipped(path: str) -> lb.Board:
    return lb.Board.load(path)


@st.cache_data(show_spinner=False, max_entries=4)
def _figure(board_json: str):
    """The chart of a board, built once per board (boards are small: their JSON is the key)."""
    import json

    return leaderboard_figure(lb.Board.from_dict(json.loads(board_json)))


def _table(board: lb.Board, protocol: str) -> list[dict]:
    """One row per method: its score at each ratio (%), the ratio reached where a method sets its own (the
    full cache's score is in the caption)."""
    scores = [s for s in board.scores() if s["protocol"] == protocol]
    rows = []
    for method in board.request.methods:
        mine = {s["ratio"]: s for s in scores if s["method"] == method}
        if not mine:
            continue
        row = {"method": method_look(method)[0]}
        for r in board.request.ratios:
            s = mine.get(round(r, 6))
            text = "" if s is None else f"{100 * s['score']:.0f}%"
            if s is not None and abs(s["ratio_reached"] - r) >= 0.03:
                text += f" (reached {s['ratio_reached']:.2f})"
            row[f"{r:g}"] = text
        rows.append(row)
    return rows


def _run_live(request: lb.BoardRequest) -> None:
    from kvviz.app.sources import shared_model

    with progress_status("Running the leaderboard…") as say:
        say(0.0, "Loading the bundled model…")
        model, tokenizer, _ = shared_model("bundled")
        board = lb.run(model, tokenizer, "bundled", request, progress=say)
        say(1.0, f"Finished: {len(board.cells)} cells")
    st.session_state[LIVE] = board


def _live_form() -> None:
    with st.form("leaderboard_form"):
        methods = (
            st.pills(
                "Methods",
                lb.METHODS,
                selection_mode="multi",
                default=list(lb.METHODS)[:4],
                format_func=lambda m: method_look(m)[0],
            )
            or []
        )
        ratios = (
            st.pills(
                "Compression ratios",
                lb.RATIOS,
                selection_mode="multi",
                default=list(lb.RATIOS),
                format_func=lambda r: f"{r:g}",
            )
            or []
        )
        tasks = (
            st.pills(
                "Tasks",
                tuple(TASKS),
                selection_mode="multi",
                default=list(lb.TASK_SET),
                format_func=lambda t: TASKS[t].title,
            )
            or []
        )
        go = st.form_submit_button("Run live", type="primary")
    st.caption(
        "Cells are cached on disk: a rerun of cells already run is instant. On a 2-core CPU the whole "
        f"board ({len(lb.METHODS)} methods) takes about 13 minutes; four methods, about 3."
    )
    if not go:
        return
    if not methods or not ratios or not tasks:
        st.error("Pick at least one method, one ratio and one task.")
        return
    try:
        _run_live(lb.BoardRequest(methods=methods, ratios=sorted(ratios), tasks=tasks))
    except SpecError as e:
        st.error(f"Cannot run: {e}")


def leaderboard_section() -> None:
    """The folded section: drawn (and the board read) only while open."""
    section = folded(
        "Leaderboard: score against compression ratio, every method (kvpress's leaderboard)",
        key="_leaderboard_open",
        icon=":material/leaderboard:",
    )
    if not section.open:
        return
    with section:
        board = st.session_state.get(LIVE) or _shipped(str(lb.DEFAULT_FILE))
        full = board.full_accuracy()
        st.caption(
            f"{len(board.request.methods)} methods on the {board.model} model at compression ratios "
            + ", ".join(f"{r:g}" for r in board.request.ratios)
            + f"; tasks: {', '.join(TASKS[t].title for t in full)}, each at {len(board.request.depths)} needle "
            f"depths. The uncompressed model gets {sum(full.values()) / len(full):.0%} right. Question-aware: the "
            "cache is compressed after the question; query-agnostic: before it, the question read through the "
            "compressed cache. `kvviz leaderboard` prints the same board."
        )
        import json

        chart(_figure(json.dumps(board.as_dict())), key="leaderboard_chart", config=CHART_CONFIG)
        for protocol in board.request.protocols:
            st.markdown(f"**{protocol}**: % right at each compression ratio")
            st.dataframe(_table(board, protocol), hide_index=True, key=f"leaderboard_table_{protocol}")
        st.download_button(
            "Download the board's cells (CSV)",
            data=board.to_csv,
            file_name="kvviz-leaderboard.csv",
            mime="text/csv",
            on_click="ignore",
            icon=":material/download:",
        )
        _live_form()
