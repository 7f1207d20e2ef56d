"""A lesson that runs anywhere: the handbook lesson's file size, time to the first chart, redraw per move.

Exports the handbook lesson at its full default grid (`kvviz lesson export --out ...`, 2,688 settings),
opens it from file:// in headless Chromium (Debian's /usr/bin/chromium through Playwright's
executable_path, network off) and prints

    file size                    target <= 5 MB
    open -> first chart painted  target <= 1 s   (median of --opens loads; the page's own clock from
                                                  navigation start to two animation frames after the
                                                  first draw)
    slider move -> redrawn       target <= 100 ms (median of --moves single moves: input event to two
                                                  animation frames later, so layout and paint count)

and exits non-zero if any misses its target.

    .venv/bin/python benchmarks/lesson.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

CHROMIUM = os.environ.get("KVVIZ_CHROMIUM", "/usr/bin/chromium")
MOVE = """async ([id, value]) => {
  const input = document.getElementById(id);
  const t0 = performance.now();
  input.value = String(value);
  input.dispatchEvent(new Event('input'));
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return performance.now() - t0;
}"""


def wait_ready(page, timeout_s: float = 60.0) -> None:
    """Poll the page's ready flag with evaluate (run through CDP, outside the page's CSP).

    page.wait_for_function compiles its predicate with eval inside the page, which the lesson's
    Content-Security-Policy (no 'unsafe-eval') refuses: an EvalError, as tests/test_lesson_browser.py found."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate("Boolean(window.kvvizLesson && window.kvvizLesson.ready)"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the lesson page did not get ready in {timeout_s:g} s")
        page.wait_for_timeout(10)


def measure(page_file: Path, opens_n: int, moves_n: int) -> tuple[list, list, list]:
    """(open times, redraw times, Playwright wall times to ready), in seconds."""
    from playwright.sync_api import sync_playwright

    opens, moves, wall = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        context = browser.new_context(viewport={"width": 1024, "height": 768}, offline=True)
        for _ in range(opens_n):
            page = context.new_page()
            t = time.perf_counter()
            page.goto(page_file.as_uri())
            wait_ready(page)
            wall.append(time.perf_counter() - t)
            opens.append(page.evaluate("kvvizLesson.firstChartMs") / 1000)
            page.close()
        page = context.new_page()
        page.goto(page_file.as_uri())
        wait_ready(page)
        sliders = page.evaluate("kvvizLesson.meta.sliders.map(s => [s.name, s.values.length])")
        rng = random.Random(0)
        for _ in range(moves_n):
            name, n = rng.choice(sliders)
            moves.append(page.evaluate(MOVE, [f"s-{name}", rng.randrange(n)]) / 1000)
        browser.close()
    return opens, moves, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opens", type=int, default=5)
    ap.add_argument("--moves", type=int, default=40)
    ap.add_argument("--keep", help="write the exported lesson here and keep it (default: a temporary folder)")
    a = ap.parse_args()

    from kvviz.cli import main as kvviz

    with tempfile.TemporaryDirectory(prefix="kvviz-lesson-bench-") as folder:
        page_file = Path(a.keep) if a.keep else Path(folder) / "handbook-lesson.html"
        t0 = time.perf_counter()
        if kvviz(["lesson", "export", "--out", str(page_file), "--quiet"]) != 0:
            return 1
        export_s = time.perf_counter() - t0
        size = page_file.stat().st_size
        opens, moves, wall = measure(page_file, a.opens, a.moves)

    open_s, move_s = statistics.median(opens), statistics.median(moves)
    checks = [
        ("file size", size / 1e6, 5.0, "MB"),
        ("open -> first chart", open_s, 1.0, "s"),
        ("median redraw", move_s * 1000, 100.0, "ms"),
    ]
    print(
        f"handbook lesson: exported in {export_s:.1f} s; opened {a.opens} times "
        f"(Playwright wall time to ready, median {statistics.median(wall):.3f} s), {a.moves} slider moves"
    )
    for label, value, target, unit in checks:
        print(
            f"{label:<22} {value:8.3f} {unit:<2} (target <= {target:g} {unit}): {'OK' if value <= target else 'OVER'}"
        )
    print(f"open times (s): {', '.join(f'{x:.3f}' for x in opens)}; slowest move {1000 * max(moves):.1f} ms")
    return 0 if all(value <= target for _, value, target, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
