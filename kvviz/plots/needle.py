"""Figure builders for the needle test (pure: data in, figure or HTML out; no Streamlit).

- `grid_figure`: one depth x length panel per policy, a square per cell: blue with a check
  mark where the key came back exactly, vermillion with a cross where it did not
  (Okabe-Ito, and the marks make it readable without colour); the answer on hover. The
  squares are scatter points so a click selects a cell (customdata = scorer, length, depth).
- `grids_figure`: several such grids one above the other (the needle page's two compression
  points), each policy in one column; customdata adds which grid.
- `heads_figure`: layer x KV head heatmap of the share of needle tokens kept (cividis).
- `needle_tokens_html`: the prompt as token chips, kept / evicted for one layer and KV head,
  the needle outlined, the question marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.plots.style import LEGEND_BELOW, OKABE_ITO, wrap

RIGHT, WRONG = OKABE_ITO["blue"], OKABE_ITO["vermillion"]


def scorer_label(scorer: str) -> str:
    """A needle cache's name for a reader: 'Full cache', or the scorer's own short name (its `short`,
    else its `title`: 'SnapKV', 'Oracle (bound)', as the app's other pages name it), never a raw id."""
    from kvviz.policies import POLICIES

    policy = POLICIES.get(scorer)
    if scorer == "full" or policy is None:
        return "Full cache" if scorer == "full" else scorer
    return policy.short or policy.title


def _title(scorer: str, budget: float, bits: int) -> str:
    t = scorer_label(scorer)
    if scorer != "full":
        t += f" {budget:.0%}"
    if bits != 16:
        t += f" {bits}-bit"
    return t


def grid_figure(cells: Sequence, selected: tuple | None = None, height: int = 330) -> go.Figure:
    """cells: NeedleCell-like objects (scorer, length, depth, budget, bits, correct, answer, key, needle_kept)."""
    return grids_figure([(None, "", cells)], selected, height)


def grids_figure(
    grids: Sequence[tuple[str | None, str, Sequence]], selected: tuple | None = None, height: int = 330
) -> go.Figure:
    """Several grids one above the other, each policy's in one column so a column compares them: grids =
    (key, title, cells) per row. A row with a key adds it to every square's customdata (scorer, length,
    depth, key) and to `selected`, so a click says which grid it was in."""
    groups = list(dict.fromkeys((c.scorer, c.budget, c.bits) for _, _, cells in grids for c in cells))
    lengths = sorted({c.length for _, _, cells in grids for c in cells})
    depths = sorted({c.depth for _, _, cells in grids for c in cells})
    cols, n_rows = max(1, len(groups)), max(1, len(grids))
    # a panel is about 100 px wide at a projector's 1024 px: its title in lines of at most 13 characters
    titles = [wrap(_title(*g), 13) for g in groups]
    lines = max((t.count("<br>") + 1 for t in titles), default=1)
    fig = make_subplots(
        rows=n_rows,
        cols=cols,
        shared_yaxes=True,
        horizontal_spacing=0.02,
        vertical_spacing=0.16 if n_rows > 1 else 0.0,
        subplot_titles=titles + [""] * (cols * (n_rows - 1)),
    )
    shown: set = set()
    for r, (key, _, cells) in enumerate(grids, start=1):
        for j, g in enumerate(groups, start=1):
            mine = [c for c in cells if (c.scorer, c.budget, c.bits) == g]
            for ok in (True, False):
                part = [c for c in mine if c.correct == ok]
                fig.add_trace(_squares(part, ok, g, key, selected, ok not in shown), row=r, col=j)
                if part:
                    shown.add(ok)
            fig.update_xaxes(
                type="category",
                categoryorder="array",
                categoryarray=[str(n) for n in lengths],
                title_text="prompt tokens" if j == (cols + 1) // 2 and r == n_rows else None,
                row=r,
                col=j,
            )
        fig.update_yaxes(title_text="needle depth", row=r, col=1)
    fig.update_yaxes(
        type="category", categoryorder="array", categoryarray=[f"{d:.0%}" for d in depths], autorange="reversed"
    )
    _row_titles(fig, [title for _, title, _ in grids], lines)
    top = 24 + 17 * lines
    # the row title above the policies' titles
    top += 5 * lines + 24 if any(t for _, t, _ in grids) else 0
    fig.update_layout(
        height=n_rows * height + 17 * (lines - 1) + (n_rows - 1) * 60,
        margin=dict(l=60, r=10, t=top, b=40),
        legend=LEGEND_BELOW,
        plot_bgcolor="#ffffff",
    )
    return fig


def _squares(part: Sequence, ok: bool, group: tuple, key, selected, legend: bool) -> go.Scatter:
    """The cells of one policy's panel that are right (or wrong): a square each, outlined when selected; its
    customdata (scorer, length, depth[, grid key]) says which cell a click opened."""
    here = [(c.scorer, c.length, c.depth) + ((key,) if key else ()) for c in part]
    return go.Scatter(
        x=[str(c.length) for c in part],
        y=[f"{c.depth:.0%}" for c in part],
        mode="markers+text",
        marker=dict(
            symbol="square",
            size=34,
            color=RIGHT if ok else WRONG,
            line=dict(color="#000000", width=[3 if selected == h else 0 for h in here]),
        ),
        text=["✓" if ok else "✗" for _ in part],
        textfont=dict(color="#ffffff", size=16),
        customdata=[list(h) for h in here],
        hovertext=[
            f"{_title(*group)} · {c.length} tokens · needle at {c.depth:.0%}<br>"
            f"key {c.key} · answer “{escape(c.answer.strip())[:40]}”<br>"
            f"{'right' if ok else 'wrong'} · needle tokens kept {c.needle_kept:.0%}"
            for c in part
        ],
        hoverinfo="text",
        name="key right" if ok else "key wrong",
        legendgroup=str(ok),
        showlegend=bool(part) and legend,
    )


def _row_titles(fig: go.Figure, titles: list[str], lines: int) -> None:
    """Each row's title above its panels (the policies' titles, `lines` lines, sit on the first row only)."""
    for r, title in enumerate(titles):
        if title:
            domain = fig.get_subplot(r + 1, 1).yaxis.domain
            fig.add_annotation(
                text=f"<b>{escape(title, quote=False)}</b>",
                xref="paper",
                yref="paper",
                x=0,
                xanchor="left",
                y=domain[1],
                yanchor="bottom",
                yshift=4 + (22 * lines if r == 0 else 0),
                showarrow=False,
                font=dict(size=13),
            )


def heads_figure(
    needle_kept_by_head,
    wanted_by_head=None,
    kept_mass_by_head=None,
    selected: tuple[int, int] | None = None,
    title: str = "Needle tokens kept, per layer and KV head",
    height: int = 420,
) -> go.Figure:
    z = np.asarray(needle_kept_by_head, dtype=float)  # (layers, kv_heads)
    L, H = z.shape
    hover = [
        [
            f"layer {layer}, KV head {h}<br>needle tokens kept {z[layer, h]:.0%}"
            + (
                f"<br>attention wanted on the needle {np.asarray(wanted_by_head)[layer, h]:.3f}"
                if wanted_by_head is not None
                else ""
            )
            + (
                f"<br>of it still in the cache {np.asarray(kept_mass_by_head)[layer, h]:.3f}"
                if kept_mass_by_head is not None
                else ""
            )
            for h in range(H)
        ]
        for layer in range(L)
    ]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"KV {h}" for h in range(H)],
            y=list(range(L)),
            zmin=0,
            zmax=1,
            colorscale="Cividis",
            colorbar=dict(title="kept", tickformat=".0%"),
            hovertext=hover,
            hoverinfo="text",
        )
    )
    if selected is not None:
        fig.add_shape(
            type="rect",
            x0=selected[1] - 0.5,
            x1=selected[1] + 0.5,
            y0=selected[0] - 0.5,
            y1=selected[0] + 0.5,
            line=dict(color=OKABE_ITO["orange"], width=3),
        )
    fig.update_layout(
        title=title,
        height=height,
        margin=dict(l=50, r=10, t=40, b=30),
        yaxis=dict(title="layer", autorange="reversed"),
        xaxis=dict(title="KV head"),
    )
    return fig


def needle_tokens_html(
    tokens: Sequence[str],
    kept: Sequence[bool],
    needle: tuple[int, int],
    question_start: int | None = None,
    compression_point: int | None = None,
    max_tokens: int = 1500,
) -> str:
    """The prompt as chips: kept (blue tint) or evicted (vermillion tint, struck through, dashed),
    the needle's tokens outlined in black, a marker where the question starts."""
    ns, ne = needle
    n = len(tokens)
    start = 0 if n <= max_tokens else n - max_tokens
    chips = []
    for i in range(start, n):
        t = tokens[i]
        shown = escape(t.replace("\n", "⏎")) or "&nbsp;"
        k = bool(kept[i])
        style = (
            "background:#d6e9f5;color:#000;border:1px solid #0072B2;"
            if k
            else "background:#f8ddd0;color:#555;border:1px dashed #D55E00;text-decoration:line-through;"
        )
        if ns <= i < ne:
            style += "outline:3px solid #000;outline-offset:0px;font-weight:600;"
        title = f"{i}: {t!r} · {'kept' if k else 'evicted'}" + (" · needle" if ns <= i < ne else "")
        if i == question_start:
            chips.append(
                '<span style="display:inline-block;margin:0 4px;padding:0 4px;background:#000;color:#fff;'
                'font-size:11px;border-radius:3px">question ▸</span>'
            )
        if i == compression_point and compression_point != question_start:
            chips.append(
                '<span style="display:inline-block;margin:0 4px;padding:0 4px;background:#E69F00;'
                'font-size:11px;border-radius:3px">compressed here ▸</span>'
            )
        chips.append(
            f'<span title="{escape(title)}" style="display:inline-block;margin:1px;padding:0 2px;'
            f'border-radius:3px;font-family:monospace;font-size:12px;white-space:pre;{style}">{shown}</span>'
        )
    legend = (
        '<div style="font-size:12px;margin-bottom:4px">'
        '<span style="background:#d6e9f5;border:1px solid #0072B2;padding:0 4px">kept</span> '
        '<span style="background:#f8ddd0;border:1px dashed #D55E00;text-decoration:line-through;padding:0 4px">'
        "evicted</span> "
        '<span style="outline:3px solid #000;padding:0 4px">needle</span>'
        + (f" · showing the last {max_tokens} of {n} tokens" if start else "")
        + "</div>"
    )
    return f'<div class="kvviz-needle-grid" style="line-height:1.9">{legend}{"".join(chips)}</div>'
