"""`kvviz study run|status|export`: a grid from a study file, resumable, on this machine or on Ray.

    kvviz study run examples/studies/quarter-cache.toml --out runs/quarter [--engine local|ray]
                    [--workers N] [--address auto|ray://host:10001] [--quiet]
    kvviz study status runs/quarter
    kvviz study export runs/quarter --csv [FILE]

The file format, the resume rule and the engines: docs/studies.md.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "study",
        help="run a study file's grid (resumable, local or Ray), show its status, export it",
        description="A study file (TOML) names a grid of cells; each finished cell is kept "
        "at once as a Parquet part file under --out, so a rerun does only what is "
        "left. See docs/studies.md.",
    )
    sub = p.add_subparsers(dest="study_command", required=True, parser_class=type(p))
    r = sub.add_parser("run", help="run the cells not yet in --out")
    r.add_argument("study_file", metavar="STUDY.toml")
    r.add_argument("--out", required=True, metavar="DIR", help="the results folder (created; reused on a rerun)")
    r.add_argument(
        "--engine",
        default="local",
        choices=("local", "ray"),
        help="local: this process (or a process pool with --workers); ray: Ray tasks and model actors (default local)",
    )
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        help="local: processes; ray: CPUs of the local Ray it starts, and actors per model (default 1)",
    )
    r.add_argument(
        "--address",
        default=None,
        help="--engine ray: an existing cluster ('auto', 'ray://host:10001') instead of a local Ray",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar (failures and the summary still print)")
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("status", help="cells, done, to run (and the last run's failures)")
    s.add_argument("dir", metavar="DIR")
    s.set_defaults(func=cmd_status)
    e = sub.add_parser("export", help="every finished cell as one table")
    e.add_argument("dir", metavar="DIR")
    e.add_argument("--csv", nargs="?", const="", default=None, metavar="FILE", help="write CSV (default DIR/NAME.csv)")
    e.set_defaults(func=cmd_export)


def cmd_run(a: argparse.Namespace) -> int:
    import time

    from kvviz.analysis.study import StudyError, run_study
    from kvviz.analysis.study.engines import ENGINES

    if a.workers < 1:
        raise StudyError(f"--workers must be at least 1, got {a.workers}")
    if a.address and a.engine != "ray":
        raise StudyError("--address names a Ray cluster: use it with --engine ray")
    assert a.engine in ENGINES
    if a.engine == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            from kvviz.analysis.study import RAY_MISSING

            raise StudyError(RAY_MISSING)
    held: dict = {}
    t0 = time.perf_counter()

    def start(report) -> None:
        print(report.start_line(), file=sys.stderr if a.quiet else sys.stdout, flush=True)
        if not a.quiet and report.to_run:
            from tqdm import tqdm

            held["bar"] = tqdm(
                total=report.to_run,
                unit="cell",
                dynamic_ncols=True,
                file=sys.stderr,
                desc=f"{a.engine}",
                bar_format="{desc}: {n_fmt}/{total_fmt} cells |{bar}| {rate_fmt}, {elapsed} elapsed, ETA {remaining}",
            )

    def cell_done(cell, result) -> None:
        bar = held.get("bar")
        if "error" in result:
            line = f"FAILED {cell.label()}: {result['error']}"
            if bar is not None:
                bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        if bar is not None:
            bar.update(1)

    try:
        report = run_study(
            a.study_file,
            a.out,
            engine=a.engine,
            workers=a.workers,
            address=a.address,
            on_start=start,
            on_cell=cell_done,
        )
    finally:
        if "bar" in held:
            held["bar"].close()
    took = time.perf_counter() - t0
    failed = len(report.failures)
    print(
        f"{report.finished} cells finished, {failed} failed, {took:.1f} s wall time ({a.engine} engine"
        f"{', ' + str(a.workers) + ' workers' if a.workers > 1 else ''}); results in {a.out}",
        file=sys.stderr,
        flush=True,
    )
    if failed:
        print(f"{failed} cells failed (listed above and in {a.out}/failed.json); a rerun retries them", file=sys.stderr)
        return 1
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    from kvviz.analysis.study import StudyDir

    d = StudyDir(a.dir)
    print(d.status_line())
    c = d.counts()
    if c["extra"]:
        print(f"{c['extra']} finished cells of an earlier grid are kept in {a.dir}/parts but are not in this study")
    for f in d.failures():
        if f.get("cell") not in d.done_ids():
            settings = " ".join(f"{k}={v}" for k, v in f.get("settings", {}).items() if k != "text_sha256")
            print(f"failed in the last run: {settings}: {f.get('error')}")
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from kvviz.analysis.study import StudyDir
    from kvviz.cli.args import CliError

    if a.csv is None:
        raise CliError("say what to write: --csv [FILE]")
    out, n = StudyDir(a.dir).export_csv(a.csv or None)
    print(f"wrote {n} rows to {out}", file=sys.stderr)
    return 0
