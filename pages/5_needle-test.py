"""Needle test: the pass key hidden at each depth of each length; which policies still find it, and why not."""

import streamlit as st

from kvviz.analysis import needle

from kvviz.app.charts import chart
from kvviz.app.layout import page_setup, progress_status
from kvviz.app.router import run_page
from kvviz.app.store import notice, show_notices, state
from kvviz.plots.style import CHART_CONFIG, projector
from kvviz.plots.needle import grid_figure, grids_figure, heads_figure, needle_tokens_html, scorer_label
from kvviz.settings import SETTINGS
from kvviz.spec import SpecError

LIVE = "needle_live_grid"


@st.cache_resource(show_spinner=False)
def _shipped(path: str):
    return needle.load_grids(path)


def _grids() -> tuple:
    """This session's live grid alone, else the shipped grids (both compression points, query-agnostic first)."""
    live = st.session_state.get(LIVE)
    return (live,) if live is not None else _shipped(str(needle.DEFAULT_FILE))


def _encode(cell: tuple, grids: tuple) -> str:
    """scorer:length:depth, and where the compression happened when the page shows more than one grid."""
    return f"{cell[0]}:{cell[1]}:{cell[2]:g}" + (f":{cell[3]}" if len(grids) > 1 else "")


def _grid_of(grids: tuple, where: str):
    return next((g for g in grids if needle.protocol(g) == where), None)


def _decode(text: str, grids: tuple) -> tuple | None:
    """The cell a link names ("scorer:length:depth[:agnostic|aware]"), if a grid has it; without the last part,
    the query-aware grid (the one page links named before both were shipped), else the only one."""
    try:
        scorer, length, depth, *where = text.split(":")
        if len(where) > 1:
            return None
        aware = _grid_of(grids, "aware")
        grid = _grid_of(grids, where[0]) if where else (aware if aware is not None else grids[0])
        grid.cell(scorer, int(length), float(depth))
        return scorer, int(length), float(depth), needle.protocol(grid)
    except (ValueError, KeyError, AttributeError):
        return None


def _select(cell: tuple | None, grids: tuple = ()) -> None:
    """Open a cell (None = the classic failure) on the head that wanted the needle most."""
    store = state()
    store["nd_cell"] = "" if cell is None else _encode(cell, grids)
    store["nd_layer"] = store["nd_head"] = -1
    st.session_state.pop("needle_layer", None)
    st.session_state.pop("needle_head", None)


def _answer_card(where, title: str, answer: str, right: bool, about: str) -> None:
    """An answer in a bordered card that wraps (a metric would cut a long answer at 1024 px)."""
    shown = answer.strip().replace("`", "'").replace("\n", " ⏎ ") or "(empty)"
    mark = ":blue[**✓ right**]" if right else ":orange[**✗ wrong**]"
    where.container(border=True).markdown(f"{title}  \n`{shown}`  \n{mark}", help=about)


def _picked(key: str, param: str, loudest: int) -> None:
    """A head picker's on_change: the new value into the store before the run (so the link follows)."""
    state()[param] = -1 if st.session_state[key] == loudest else int(st.session_state[key])


def _head_picker(where, key: str, param: str, label: str, n: int, loudest: int) -> int:
    """A layer / KV head box whose default is the loudest one (kept in the link only when changed). A number
    typed or linked out of 0..n-1 is clamped with the notice a link gets: the box has no browser-side
    min / max, which would keep it in a red box and send nothing."""
    store, ss = state(), st.session_state
    stored = store[param]
    value = ss[key] if key in ss else (stored if stored >= 0 else loudest)
    if not 0 <= value <= n - 1:
        clamped = min(max(int(value), 0), n - 1)
        notice(f"{label} {value} is out of range (0-{n - 1}); clamped to {clamped}.")
        value = clamped
    ss[key] = value
    value = int(
        where.number_input(
            label,
            key=key,
            step=1,
            on_change=_picked,
            args=(key, param, loudest),
            help=f"Range 0-{n - 1}; a number outside it is clamped.",
        )
    )
    store[param] = -1 if value == loudest else value
    return value


def run_live(request: needle.GridRequest, model_name: str) -> None:
    from kvviz.app.sources import shared_model

    with progress_status("Running the needle grid…") as say:
        say(0.0, "Loading the model (the first time takes ~15-40 s: converting the GGUF weights)…")
        model, tokenizer, _ = shared_model(model_name)
        grid = needle.run_grid(model, tokenizer, model_name, request, progress=say)
        say(1.0, f"Finished: {len(grid.cells)} cells")
    st.session_state[LIVE] = grid
    _select(None)


def live_controls() -> None:
    """A form for a grid of your own, run live with progress; its cells join the disk cache."""
    with st.expander("Run it live (your own lengths, depths, policies, budget, bits)"):
        with st.form("needle_form"):
            lengths, depths, scorers = _grid_choices()
            c4, c5, c6 = st.columns(3)
            budget = c4.slider("Budget (share of the prompt's tokens)", 0.05, 1.0, needle.DEFAULT_BUDGET, 0.05)
            bits = c5.selectbox("K/V bits", [16, 8, 4, 3, 2], format_func=lambda b: "16 (off)" if b == 16 else str(b))
            qac = c6.toggle(
                "Question after compression (query-agnostic)",
                help="Off: the cache is compressed after the question (kvpress's compress_questions). On: right "
                "after the haystack, then the question arrives through the compressed cache (kvpress's "
                "pipeline default).",
            )
            every = SETTINGS["compress_every"]  # its declaration: label, range, help (kvviz.policies.decoding)
            c7, c8 = st.columns(2)
            compress_every = c7.number_input(
                every.label,
                int(every.lo),
                int(every.hi),
                int(every.default),
                step=1,
                key="needle_compress_every",
                help=every.help + " Here: the one-shot caches among those picked (SnapKV); the others compress as "
                "they always do.",
            )
            model_name = c8.text_input("Model", "bundled").strip() or "bundled"
            go = st.form_submit_button("Run live", type="primary")
        st.caption(
            "Every cell is cached on disk, so a rerun of the same settings is instant. On a laptop CPU a "
            "1024-token prompt takes tens of seconds per policy."
        )
    if not go:
        return
    if not lengths or not depths or not scorers:
        st.error("Pick at least one length, one depth and one cache.")
        return
    request = needle.GridRequest(
        lengths=sorted(lengths),
        depths=sorted(depths),
        scorers=scorers,
        budgets=[budget],
        bits=[bits],
        question_after_compression=qac,
        compress_every=int(compress_every),
    )
    from kvviz.models import ModelError

    try:
        run_live(request, model_name)
    except SpecError as e:
        st.error(f"Cannot run: {e}")
    except (ModelError, OSError) as e:  # a model that cannot load: one clear line
        st.error(f"The model could not be loaded: {e}")


def _grid_choices() -> tuple[list, list, list]:
    """The lengths, depths and caches: pills, not multiselects, so every choice stays visible on a 1024 px
    projector."""
    lengths = st.pills("Prompt lengths (tokens)", [192, 320, 640, 1024, 2048], selection_mode="multi", default=[320])
    depths = st.pills(
        "Needle depths",
        [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0],
        selection_mode="multi",
        default=[0.0, 0.5, 1.0],
        format_func=lambda d: f"{d:.0%}",
    )
    scorers = st.pills(
        "Caches",
        list(needle.SCORER_NAMES),
        selection_mode="multi",
        default=list(needle.DEFAULT_SCORERS),
        format_func=scorer_label,
    )
    return lengths or [], depths or [], scorers or []


def main() -> None:
    present = page_setup(
        "Needle test: does the compressed cache still find the pass key?",
        "A pass key hides at a depth of a filler text; the model is asked for it. Each square is one prompt: "
        "blue ✓ when the greedy answer is exactly the key, vermillion ✗ when not. Click a square to see which "
        "needle tokens that cache evicted, in which layer and KV head.",
    )
    if not present:
        live_controls()
    grids = _grids()
    if not grids:
        st.info("No precomputed grid is shipped with this copy: open *Run it live* above.", icon=":material/info:")
        return
    if not present:  # a projector's first screen is the grid's: the explanations are in the intro it leaves out
        about_grids(grids)
    sel = selected(grids)
    grid_chart(grids, sel, present)
    grid = _grid_of(grids, sel[3]) or grids[0]
    cell = grid.cell(*sel[:3])
    cell_cards(cell, sel, len(grids))
    head_view(cell, grid.prompt(cell.length, cell.depth) if grid.prompts else None)
    if not present:
        all_cells(grids)


def about_grids(grids: list) -> None:
    """Where the grid comes from and where its caches were compressed."""
    grid, s = grids[0], grids[0].settings
    source = "this session's live run" if st.session_state.get(LIVE) is not None else "the shipped precomputed grid"
    if len(grids) == 1:
        where = (
            "after the haystack, before the question (query-agnostic)"
            if s.get("question_after_compression")
            else "after the question (kvpress's compress_questions=True)"
        )
        if s.get("compress_every"):
            where += f", and the one-shot caches again every {s['compress_every']} decode steps"
        st.caption(
            f"{source}: model {grid.model}, {len(grid.cells)} cells; compressed {where}; greedy "
            f"{s.get('new_tokens')} tokens; true positions; {s.get('haystack')} haystack."
        )
        return
    st.caption(
        f"{source}s, one per compression point: model {grid.model}, {len(grid.cells)} cells each; greedy "
        f"{s.get('new_tokens')} tokens; true positions; {s.get('haystack')} haystack. Top: the cache is "
        "compressed right after the haystack and the question arrives through it (what kvpress's "
        "pipeline does by default). Bottom: compressed after the question, so the scorer sees it "
        "(kvpress's compress_questions=True; its FAQ warns this favours methods such as SnapKV). Each "
        "column is one cache; the full cache is never compressed, so its two rows agree."
    )


def selected(grids: list) -> tuple:
    """The open cell (scorer, length, depth, protocol): the link's, else the classic failure (with its
    button), else the first."""
    grid = grids[0]
    classic = needle.classic_failure(grid)
    classic = classic and (*classic, needle.protocol(grid))
    if classic:
        st.button(
            "Show the classic failure",
            icon=":material/bolt:",
            key="needle_classic",
            on_click=_select,
            args=(None, grids),
            help="StreamingLLM keeps the first tokens and a recent window: a needle early in "
            "the text falls out of the cache.",
        )
    store = state()
    sel = _decode(store["nd_cell"], grids) if store["nd_cell"] else None
    if store["nd_cell"] and sel is None:
        notice(f"The link's cell `{store['nd_cell']}` is not in this grid; showing the classic failure.")
        _select(None)
    show_notices()
    first = grid.cells[0]
    return sel or classic or (first.scorer, first.length, first.depth, needle.protocol(grid))


def grid_chart(grids: list, sel: tuple, present: bool) -> None:
    """The grid (one per protocol), the open cell outlined; a click opens another cell."""
    if len(grids) == 1:
        figure = grid_figure(grids[0].cells, selected=sel[:3])
    else:

        def title(g) -> str:  # presenting, the short half of the title: it has to fit at 18 px
            full = needle.PROTOCOL_TITLES[needle.protocol(g)]
            return full.split(" (")[0] if present else full

        figure = grids_figure([(needle.protocol(g), title(g), g.cells) for g in grids], selected=sel)
    if present:
        figure = projector(figure)
    picked = chart(figure, key="needle_grid_chart", config=CHART_CONFIG, selectable=True)
    points = [p for p in picked if len(p.get("customdata") or []) >= 3]
    if points:
        scorer, length, depth, *where = points[0]["customdata"]
        picked = (scorer, int(length), float(depth), where[0] if where else needle.protocol(grids[0]))
        if picked != sel:
            _select(picked, grids)
            st.rerun()


def cell_cards(cell, sel: tuple, n_grids: int) -> None:
    """The open cell: its title, both answers and the share of the needle its cache kept."""
    point = {"agnostic": " · compressed before the question", "aware": " · compressed after the question"}
    st.subheader(
        f"{scorer_label(cell.scorer)} · {cell.length} tokens · needle at {cell.depth:.0%}"
        + (point[sel[3]] if n_grids > 1 and cell.scorer != "full" else "")
    )
    a, b, c = st.columns(3)
    _answer_card(a, "Answer", cell.answer, cell.correct, f"The key is {cell.key}; {cell.spec}.")
    _answer_card(b, "Full cache's answer", cell.full_answer, cell.full_correct, "No compression.")
    c.metric(
        "Needle tokens kept",
        f"{cell.needle_kept:.0%}",
        border=True,
        help=f"Mean over all layers × KV heads. The full model puts {cell.wanted_mass:.3f} of its attention "
        f"on the needle at the first answer step (mean per head); {cell.kept_mass:.3f} of it is on "
        "needle tokens this cache still holds.",
    )


def head_view(cell, prompt) -> None:
    """One layer and KV head's cache over the prompt's tokens, and every head's share of the needle."""
    loud = needle.loudest_head(cell)
    c1, c2 = st.columns(2)
    layer = _head_picker(c1, "needle_layer", "nd_layer", "Layer", cell.n_layers, loud[0])
    head = _head_picker(c2, "needle_head", "nd_head", "KV head", cell.n_kv_heads, loud[1])
    if prompt is not None and cell.kept_packed:
        st.html(
            needle_tokens_html(
                prompt.tokens,
                cell.kept()[layer, head],
                (prompt.needle_start, prompt.needle_end),
                question_start=prompt.question_start,
                compression_point=prompt.question_start if cell.question_after_compression else None,
            )
        )
        st.caption(
            f"The cache layer {layer}, KV head {head} holds when the model starts answering "
            f"({cell.budget_tokens} of {cell.length} tokens). The page opens on the head where the full model "
            "wanted the needle most; pick another above or in the heatmap's hover."
        )
    chart(
        heads_figure(
            cell.needle_kept_by_head, cell.wanted_mass_by_head, cell.kept_mass_by_head, selected=(layer, head)
        ),
        key="needle_heads",
        config=CHART_CONFIG,
    )


def all_cells(grids: list) -> None:
    """What to look for, and every cell of every grid as a table and a CSV."""
    st.caption(
        "What to look for: a policy can lose the needle in the heads that wanted it while keeping it "
        "elsewhere. StreamingLLM's set is the same in every head (position only), and so is TOVA's: it "
        "makes one decision for all heads, from the last query's attention averaged over every head "
        "(hence its identical columns); H2O and SnapKV decide per KV head from attention; the oracle "
        "keeps the top of the answering query's own attention, the bound no real cache can beat."
    )
    grid = grids[0]
    every = needle.NeedleGrid(
        model=grid.model, settings=grid.settings, prompts=(), cells=tuple(c for g in grids for c in g.cells)
    )
    with st.expander("All cells"):
        st.dataframe(
            [{k: v for k, v in c.as_dict().items() if not k.endswith("_by_head")} for c in every.cells],
            hide_index=True,
            key="needle_table",
        )
    st.download_button(
        "Download the cells (CSV)",
        data=needle.to_csv(every),
        file_name="needle.csv",
        mime="text/csv",
        on_click="ignore",
        icon=":material/download:",
    )


run_page(main)
