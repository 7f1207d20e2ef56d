"""`kvviz lesson export`: the Explorer at a grid of slider settings, as one HTML page that runs offline.

The settings come from a synthetic preset (or the handbook), from the link of an app view
(`--from-url`, read with the app's own table, kvviz.links) or from a captured trace file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from kvviz.cli.args import CliError, ProgressLine

# bytes: past this a page is slow to mail or upload (the handbook lesson is ~1.2 MB)
BIG = 5_000_000
# the handbook, or kvviz.sources.synthetic.PRESETS
PRESETS = ("handbook", "realistic", "diffuse", "topic-shift")


def register(sub) -> None:
    p = sub.add_parser(
        "lesson",
        help="export a lesson: one HTML page with live sliders, no Python, no server",
        description="Lessons that run anywhere: the Explorer's charts and numbers, precomputed at "
        "a grid of slider settings, in one HTML file that opens from disk offline.",
    )
    cmds = p.add_subparsers(dest="lesson_command", required=True, metavar="export", parser_class=type(p))
    e = cmds.add_parser(
        "export",
        help="write the lesson page",
        description="Run kvviz compare at every point of a grid of the four headline sliders "
        "(sink tokens, recent window, heavy-hitter budget, bits) and write one HTML "
        "page whose sliders move over that grid in the browser.",
    )
    e.add_argument("--out", required=True, help="the page to write (.html)")
    src = e.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        choices=PRESETS,
        help="the handbook example (default) or a synthetic preset, at the app's default settings",
    )
    src.add_argument(
        "--from-url",
        metavar="LINK",
        help="an app view's link (the whole URL or its query string, e.g. 'sink=2&bits=4'): its "
        "source, compression settings, layer, head and error bars",
    )
    e.add_argument(
        "--trace",
        metavar="FILE",
        help="a trace file (kvviz capture --out FILE): a real model's lesson (with --from-url: the "
        "link's real-model or trace-file view of it)",
    )
    e.add_argument("--layer", type=int, help="layer (default: the link's, else 0)")
    e.add_argument("--head", type=int, help="query head (default: the link's, else 0)")
    e.add_argument("--step", type=int, help="which evaluated query (default: the link's, else the last)")
    e.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="SLIDER=V1,V2,...",
        help="one slider's values instead of the default (repeatable; at most 12 values each), e.g. "
        "--grid sink=0,4 --grid bits=16,4,2; sliders: sink, recent, heavy, bits",
    )
    e.add_argument("--title", default="", help="the page's title (default: 'kvviz lesson: SOURCE')")
    e.add_argument("--text", default="", help="your words for the class, shown under the title")
    e.add_argument(
        "--app-url",
        default=None,
        help="where the page's link back to the live app points "
        "(default: the --from-url link's address, else "
        "http://localhost:8501/)",
    )
    e.add_argument("--quiet", action="store_true", help="no progress line")
    e.set_defaults(func=cmd_export)


def _values(a: argparse.Namespace):
    """(link values, trace or None, app address) from --preset / --from-url / --trace."""
    from urllib.parse import urlsplit

    from kvviz.links import defaults, parse_query, synthetic_preset_values
    from kvviz.sources import load_trace

    base = None
    if a.from_url:
        values, notes = parse_query(a.from_url)
        if notes:
            raise CliError(
                "the link cannot be used as it is: "
                + "; ".join(n.rstrip(".") for n in notes)
                + " (fix it or open it in the app and copy the link again)"
            )
        parts = urlsplit(a.from_url.strip())
        if parts.scheme in ("http", "https") and parts.netloc:
            base = f"{parts.scheme}://{parts.netloc}{parts.path or '/'}"
    elif a.preset in ("realistic", "diffuse", "topic-shift"):
        values = synthetic_preset_values(a.preset.replace("-", " "))
    else:
        values = defaults()
    trace = None
    if a.trace:
        if a.preset:
            raise CliError("--preset names a built-in source; a trace file is its own source: drop one of them")
        if a.from_url and values["source"] in ("handbook", "synthetic"):
            raise CliError(
                f"the link's source is the {values['source']} one, not a trace: drop --trace, or copy "
                "the link of the Real model / Trace file view"
            )
        path = Path(a.trace)
        if not path.is_file():
            raise CliError(f"no such trace file: {path}")
        trace = load_trace(path)
        if not a.from_url:
            values["source"] = "file"
    elif values["source"] in ("real", "file"):
        raise CliError(
            "the link's source is a real model or a trace file, and the trace is not in the link: give "
            "it with --trace FILE (the app keeps its captures in ~/.cache/kvviz/traces; "
            "`kvviz capture --out FILE` makes one)"
        )
    for name in ("layer", "head", "step"):
        if getattr(a, name) is not None:
            values[name] = getattr(a, name)
    return values, trace, a.app_url or base


def cmd_export(a: argparse.Namespace) -> int:
    from kvviz.analysis.lesson import parse_grid
    from kvviz.links import source_from_values, spec_from_values, view_from_values
    from kvviz.plots.lesson import DEFAULT_APP_URL, export_lesson

    out = Path(a.out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise CliError(f"--out must end in .html, not {out.name!r}")
    if not out.parent.exists():
        raise CliError(f"folder {out.parent} does not exist")
    grid = parse_grid(a.grid)
    values, trace, app_url = _values(a)
    source = source_from_values(values, trace)
    spec, view = spec_from_values(values), view_from_values(values)
    bar = ProgressLine(not a.quiet and sys.stderr is not None)
    try:
        page, lesson = export_lesson(
            source,
            spec,
            view,
            values,
            grid,
            bars=values["bars"],
            title=a.title,
            lecturer=a.text,
            app_url=app_url or DEFAULT_APP_URL,
            progress=lambda f, m: bar(f, f"computing the lesson: {m}"),
        )
    finally:
        bar.done()
    # write next to the target, then rename: an interrupted export leaves no half page behind
    fd, tmp = tempfile.mkstemp(prefix=".kvviz-lesson-", suffix=".html", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as open() would create it (mkstemp makes it private)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    grid_text = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in lesson.grid.items())
    print(
        f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB): {source.label}, {lesson.points:,} settings "
        f"({grid_text}), {len(lesson.rows):,} distinct charts",
        file=sys.stderr,
    )
    if out.stat().st_size > BIG:
        print(
            f"kvviz: note: the page is over {BIG / 1e6:.0f} MB, slow to mail or upload; fewer values with --grid "
            "(or a shorter trace) make it smaller",
            file=sys.stderr,
        )
    return 0
