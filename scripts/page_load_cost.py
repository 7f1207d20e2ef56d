#!/usr/bin/env python3
"""What one page load costs, page by page, as the browser tests open a page.

Starts the app as the browser tests do (`streamlit run app.py` on a free port, tests/conftest.py) and opens
each page a live-link test starts on (all seven) in a new page of one Chromium context (Debian's
/usr/bin/chromium through Playwright), with the tests' page probe, waiting as they wait (tests/conftest.py's
`idle`). The first load of each page warms the server's caches and is not counted; the median of the next
`--loads` is printed:

- wall: seconds from `goto` until the app is idle;
- CPU: seconds of processor time spent meanwhile by Chromium's processes (the renderer alone beside it)
  and by the app server;
- script: the renderer's JavaScript time (CDP Performance.getMetrics ScriptDuration, Streamlit's
  frontend and plotly.js).

Then what the live-link tests' page loads cost (tests/test_browser.py): each opens its page once, reads the
address bar after every move in that page (no load), and opens the link its last move left in a new page
once: two loads a page, times that page's CPU per load (a lower bound: the pages as first opened, before
the moves add results to them), and what that is on this machine's cores.

    .venv/bin/python scripts/page_load_cost.py            # --loads 3
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import CHROMIUM, CHROMIUM_ARGS, PAGE_PROBE_JS, TIMEOUT, idle, serve_app  # noqa: E402


class Load(NamedTuple):
    """One page load: wall seconds, processor seconds (Chromium, its renderers among them, the server) and
    the renderer's script seconds."""

    wall: float
    chromium: float
    renderer: float
    server: float
    script: float


def live_link_moves() -> dict[str, int]:
    """Page path -> `live.act(...)` calls of the live-link test that starts there, read from
    tests/test_browser.py: each test opens `LiveLink(page, f"{app_url}/PATH")`. Read from the source so a
    renamed or added test cannot be left out."""
    found = {}
    for f in ast.parse((ROOT / "tests" / "test_browser.py").read_text()).body:
        if not isinstance(f, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(f) if isinstance(n, ast.Call)]
        start = next((c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "LiveLink"), None)
        if start is None:
            continue
        url = start.args[1]  # app_url, or f"{app_url}/PATH"
        path = url.values[-1].value.lstrip("/") if isinstance(url, ast.JoinedStr) and len(url.values) > 1 else ""
        found[path] = sum(isinstance(c.func, ast.Attribute) and c.func.attr == "act" for c in calls)
    return found


def cpu_seconds(procs) -> dict[str, float]:
    """Processor seconds so far of the Chromium processes (all, and the renderers) and of the server."""
    out = {"chromium": 0.0, "renderer": 0.0, "server": 0.0}
    for kind, proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # a renderer that exited meanwhile
            continue
        out[kind] += t.user + t.system
        if kind == "renderer":  # a Chromium process too
            out["chromium"] += t.user + t.system
    return out


def processes(server_port: int) -> list[tuple[str, psutil.Process]]:
    """This process's descendants by kind: the app server on `server_port`, Chromium's renderers, and
    Chromium's other processes (each command line read once, here)."""
    me = psutil.Process()
    found = []
    for proc in me.children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if f"--server.port {server_port}" in line:
            found.append(("server", proc))
        elif "chrom" in proc.name() or "chromium" in line.split(" ", 1)[0]:
            found.append(("renderer" if "--type=renderer" in line else "chromium", proc))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=3, help="loads counted per page (after one warm-up load)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    os.environ.setdefault("KVVIZ_WARMUP", "0")
    rows = {}
    with serve_app(ROOT / "test-artifacts" / "page-load-cost-server.log") as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.add_init_script(PAGE_PROBE_JS)
        port = int(url.rsplit(":", 1)[1])
        moves = live_link_moves()
        for path in moves:
            found = []
            for i in range(args.loads + 1):
                page = context.new_page()
                page.set_default_timeout(TIMEOUT)
                cdp = context.new_cdp_session(page)
                cdp.send("Performance.enable")
                procs = processes(port)
                before, start = cpu_seconds(procs), time.perf_counter()
                page.goto(f"{url}/{path}")
                idle(page)
                wall = time.perf_counter() - start
                seen = {proc.pid for _, proc in procs}  # and the renderer the new page started
                after = cpu_seconds(procs + [(k, q) for k, q in processes(port) if q.pid not in seen])
                metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
                page.close()
                if i:
                    found.append(
                        Load(
                            wall,
                            after["chromium"] - before["chromium"],
                            after["renderer"] - before["renderer"],
                            after["server"] - before["server"],
                            metrics.get("ScriptDuration", 0.0),
                        )
                    )
            rows[path] = Load(*(statistics.median(c) for c in zip(*found)))
        browser.close()

    print(f"{'page':16} {'wall s':>7} {'Chromium CPU s':>15} {'renderer':>9} {'server CPU s':>13} {'script s':>9}")
    for path, (wall, chromium, renderer, server, script) in rows.items():
        print(f"{path or 'explorer':16} {wall:7.2f} {chromium:15.2f} {renderer:9.2f} {server:13.2f} {script:9.2f}")

    total, loads = 0.0, 0
    for path in moves:
        total += 2 * (rows[path].chromium + rows[path].server)  # the page's first load, the last link's
        loads += 2
    cores = os.cpu_count() or 1
    print(
        f"live-link tests: {sum(moves.values())} moves read in place, {loads} page loads, at least {total:.0f} "
        f"CPU-s of Chromium and server = {total / cores:.0f} s of this machine's {cores} cores fully busy"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
