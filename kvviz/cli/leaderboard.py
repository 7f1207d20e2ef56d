"""`kvviz leaderboard`: every method's score against the compression ratio, under both question protocols, on
a task set the model solves uncompressed (kvviz.analysis.leaderboard).

    kvviz leaderboard [--model bundled] [--methods ...] [--ratios 0.25,0.5,0.75,0.875] \\
        [--tasks passkey,multikey,qa] [--out board.csv] [--html board.html]

torch and transformers are imported inside the handler only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvviz.cli.device import device_errors


def register(subparsers) -> None:
    from kvviz.analysis import leaderboard as lb
    from kvviz.analysis.needle.tasks import TASKS
    from kvviz.cli.device import add_model_args

    p = subparsers.add_parser(
        "leaderboard",
        help="every method's score against the compression ratio, both question protocols (kvpress's leaderboard)",
        description="Each method at each compression ratio answers a RULER-style task set (pass key, a key "
        "among two, a short question) on the model, with the question inside the compressed prompt and "
        "after it; the score is the share right. Cells are cached on disk, so a rerun is instant.",
    )
    add_model_args(p)
    p.add_argument("--methods", default=",".join(lb.METHODS), help="comma-separated (default: %(default)s)")
    p.add_argument(
        "--ratios",
        default=",".join(f"{r:g}" for r in lb.RATIOS),
        help="compression ratios: shares of the prompt removed (default %(default)s)",
    )
    p.add_argument("--protocols", default=",".join(lb.PROTOCOLS), help="default %(default)s")
    p.add_argument("--tasks", default=",".join(lb.TASK_SET), help=f"any of {', '.join(TASKS)} (default %(default)s)")
    p.add_argument(
        "--lengths", default=",".join(map(str, lb.LENGTHS)), help="prompt lengths in tokens (default %(default)s)"
    )
    p.add_argument(
        "--depths",
        default=",".join(f"{d:g}" for d in lb.DEPTHS),
        help="needle depths, fractions of the haystack (default %(default)s)",
    )
    p.add_argument("--out", help="write one CSV row per cell to this file")
    p.add_argument("--html", help="write the score-vs-ratio chart as a standalone HTML page")
    p.add_argument("--save", help="write the whole board (JSON, gzip) for the app to open")
    p.add_argument("--no-cache", action="store_true", help="recompute every cell (the disk cache is still written)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_leaderboard)


def parse(a: argparse.Namespace):
    """The checked BoardRequest, before any model loads."""
    from kvviz.analysis import leaderboard as lb
    from kvviz.cli.needle import _list

    names = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    request = lb.BoardRequest(
        methods=names(a.methods),
        ratios=_list(a.ratios, float, "ratios", "0.5,0.75"),
        protocols=names(a.protocols),
        tasks=names(a.tasks),
        lengths=_list(a.lengths, int, "lengths", "256"),
        depths=_list(a.depths, float, "depths", "0.25,0.75"),
    )
    request.check()
    return request


@device_errors
def cmd_leaderboard(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvviz.analysis import leaderboard as lb
    from kvviz.cli.device import load_from_args
    from kvviz.cli.needle import model_id

    request = parse(a)
    t0 = time.perf_counter()
    bar = None if a.quiet else tqdm(total=1000, file=sys.stderr, bar_format="{l_bar}{bar}| {elapsed} {postfix}")

    def say(fraction: float, message: str) -> None:
        if bar is not None:
            bar.n = int(fraction * 1000)
            bar.set_postfix_str(message[-90:], refresh=True)

    def load():
        model, tokenizer, _ = load_from_args(a)
        return model, tokenizer

    board = lb.run(None, None, model_id(a), request, use_cache=not a.no_cache, progress=say, load=load)
    if bar is not None:
        bar.close()
    print(f"{len(board.cells)} cells in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(lb.format_board(board))
    if a.out:
        Path(a.out).write_text(board.to_csv(), encoding="utf-8")
        print(f"wrote {len(board.cells)} rows to {a.out}", file=sys.stderr)
    if a.save:
        board.save(a.save)
        print(f"wrote the board to {a.save}", file=sys.stderr)
    if a.html:
        from kvviz.plots.leaderboard import leaderboard_figure

        leaderboard_figure(board).write_html(a.html, include_plotlyjs=True)
        print(f"wrote the chart to {a.html}", file=sys.stderr)
    return 0
