"""The Explorer in a real browser, as a lecturer meets it: the first paint, the first move, later moves,
and whether the address bar's link reproduces the view after each move.

Starts the app as `make run` does (`python -m kvviz.app.serve`, on a free port), opens it in headless Chromium
(Debian's /usr/bin/chromium through Playwright) and measures the first visit of a freshly started server,
five times (a fresh server each time; the median is printed): the first paint is the moment the metric cards
are on screen, the charts follow once the browser has reported that paint (kvviz.app.charts). The same first
visit of a plain `streamlit run app.py` is measured as often beside it, in the same run. On the last fresh
server it then makes 12 single keyboard moves of the four headline sliders (the first: Quantization bits
16 -> 8, which needs the quantization kernel), in a 1024x768 page as a projector shows it, each once the
server is quiet (its background warm-up, the bundled model's load, and the previous move's link check done:
a move's figures are the move's own; many sessions at once are benchmarks/load.py's). A move's time runs
from the key press until the app is idle again: its script run done and the page's metrics and charts no
longer changing. Each move is split into its parts: key press -> the page sends the new value, sent -> the
server's last message of the run has arrived, last message -> the charts are redrawn; beside them the
server process's CPU time for the move (/proc/<pid>/stat) and what the run sent (messages, kB). After each
move the address bar's link is opened in a new page, which must show the same widgets, metrics, headings and
charts.

    python benchmarks/browser.py          # KVVIZ_WARMUP=0 also skips the bundled model's background load

Prints `first paint S s` (and the plain command's beside it), `plain / make run first paint P` (target
P <= 1.2: both start through app.py's st.App start-up hook, kvviz/app/serve.py), `charts drawn S s`
(target <= 2.5 s), each move's parts, `move -> charts redrawn: median S s, worst W s` (targets 0.3 s and
0.8 s), `server CPU per move: median C ms` (target <= 40 ms), `first move / median move ratio R` (target
R <= 2) and `URL reproduces the view after K of N moves`; exits 1 when a target is missed (the first
paint's median over 2 s, P > 1.2, ...) or K < N. The absolute targets hold for a quiet 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from _common import targets_met  # noqa: E402
from load import cpu_seconds  # noqa: E402  (the server's CPU time, from /proc)

WARMUP = os.environ.get("KVVIZ_WARMUP", "1")  # the app's default; tests/conftest sets 0 on import
sys.path.insert(0, str(ROOT / "tests"))
try:  # the browser tests' server and page probe (tests/conftest.py needs pytest: requirements-dev.txt)
    from conftest import (
        CHROMIUM,
        CHROMIUM_ARGS,
        PAGE_PROBE_JS,
        TIMEOUT,
        idle,
        runs,  # noqa: E402
        serve_app,
        view,
    )
    import playwright.sync_api  # noqa: E402, F401
except ImportError as missing:
    CHROMIUM = None
    MISSING = f"{missing} (pip install -r requirements-dev.txt)"

TARGET_RATIO = 2.0
TARGET_PLAIN = 1.2  # the plain `streamlit run app.py`'s first paint / make run's
TARGET_PAINT = 2.0  # s, the first paint on a quiet machine
TARGET_CHARTS = 2.5  # s, both Explorer charts drawn after the page opens
TARGET_MOVE, TARGET_WORST = 0.3, 0.8  # s, move -> charts redrawn: median and worst over the moves
TARGET_CPU = 40.0  # ms, the server's CPU time per move (median)
FRESH_VISITS, PLAIN_VISITS = 5, 5
OPENED_AFTER = 5.0  # s: the lecturer opens the page a few seconds after `make run` says it is up (both servers)
VIEWPORT = {"width": 1024, "height": 768}  # a classroom projector
# (slider label, key) -- twelve single moves of the four headline sliders, none of them cached yet
MOVES = [
    ("Quantization bits", "ArrowLeft"),
    ("Heavy-hitter budget", "ArrowRight"),
    ("Sink tokens", "ArrowRight"),
    ("Recent window", "ArrowLeft"),
    ("Quantization bits", "ArrowLeft"),
    ("Heavy-hitter budget", "ArrowRight"),
    ("Sink tokens", "ArrowRight"),
    ("Recent window", "ArrowLeft"),
    ("Quantization bits", "ArrowRight"),
    ("Heavy-hitter budget", "ArrowLeft"),
    ("Sink tokens", "ArrowLeft"),
    ("Recent window", "ArrowRight"),
]


def slider(page, label: str):
    return (
        page.locator('[data-testid="stSlider"]')
        .filter(has=page.locator('[data-testid="stWidgetLabel"]', has_text=label))
        .get_by_role("slider")
    )


def settled_at(page, since: float) -> float:
    """In-page time (ms) the app became idle after `since`: its run ended and the results stopped changing."""
    return page.evaluate(
        """(since) => Math.max(window.__kvviz.changed,
        ...window.__kvviz.samples.filter(s => s[2] >= since).map(s => s[2]))""",
        since,
    )


def reproduces(page) -> bool:
    """Does the address bar's link, opened in a new page, show the same view?"""
    shown, link = view(page), page.url
    fresh = page.context.new_page()
    fresh.set_default_timeout(TIMEOUT)
    try:
        fresh.goto(link)
        idle(fresh)
        again = view(fresh)
    finally:
        fresh.close()
        page.bring_to_front()
    if again != shown:
        diff = {k: (shown.get(k), again.get(k)) for k in set(shown) | set(again) if shown.get(k) != again.get(k)}
        print(f"  the link {link} opens another view: {diff}")
    return again == shown


# what the websocket carried: when the page last sent (a widget's new value) and when the server's last
# message arrived, with the messages and bytes since the counters were reset
WIRE_JS = """
window.__wire = {sent: [], last: 0, messages: 0, bytes: 0};
const Wired = window.WebSocket;
window.WebSocket = class extends Wired {
  constructor(...args) {
    super(...args);
    this.addEventListener('message', (e) => { const w = window.__wire;
      w.messages++; w.bytes += e.data.byteLength || e.data.size || e.data.length || 0; w.last = performance.now(); });
  }
  send(data) { window.__wire.sent.push(performance.now()); return super.send(data); }
};
"""


def server_pid(port: int) -> int:
    """The pid of the Streamlit server listening on `port` (its command line names the port)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--server.port" in argv and argv[argv.index(b"--server.port") + 1] == str(port).encode():
            return int(proc.name)
    raise RuntimeError(f"no server process on port {port}")


def quiet(pid: int, window: float = 0.5, busy: float = 0.05, limit: float = 90.0) -> float:
    """Wait until the server has used under `busy` of a core over `window` seconds (its background warm-up
    -- the bundled model's load -- and the previous link check done), at most `limit` s; returns the wait.
    A move is measured from a quiet server: what else the server is doing is not the move's time (the
    class at once is benchmarks/load.py)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        cpu0 = cpu_seconds(pid)
        time.sleep(window)
        if cpu_seconds(pid) - cpu0 < busy * window:
            break
    return time.perf_counter() - t0


def move(page, label: str, key: str, pid: int) -> dict:
    """One keyboard move of a slider and its parts (s), the server's CPU (ms) and what the run sent."""
    thumb = slider(page, label)
    thumb.focus()
    page.evaluate("window.__wire.messages = 0; window.__wire.bytes = 0")
    before, cpu0, t0 = runs(page), cpu_seconds(pid), page.evaluate("performance.now()")
    thumb.press(key)
    idle(page, after=before)
    cpu = (cpu_seconds(pid) - cpu0) * 1000
    wire = page.evaluate("window.__wire")
    sent = min((t for t in wire["sent"] if t >= t0), default=t0)
    settled = settled_at(page, t0)
    return {
        "total": (settled - t0) / 1000,
        "press -> sent": (sent - t0) / 1000,
        "sent -> last message": (wire["last"] - sent) / 1000,
        "last message -> drawn": (settled - wire["last"]) / 1000,
        "server CPU ms": cpu,
        "messages": wire["messages"],
        "kB": wire["bytes"] / 1024,
    }


CHARTS_JS = """
new MutationObserver(() => {   // when the Explorer's two charts are first both drawn
  const drawn = Array.from(document.querySelectorAll('.js-plotly-plot')).filter((p) => p.querySelector('.main-svg'));
  if (!window.__chartsDrawn && drawn.length >= 2)
    window.__chartsDrawn = performance.now();
}).observe(document, {subtree: true, childList: true});
"""


def first_visit(browser, url: str):
    """(s from navigation to the Explorer's first metric on screen, s to both charts drawn, the page) in a
    fresh page."""
    context = browser.new_context(viewport=VIEWPORT)
    context.add_init_script(PAGE_PROBE_JS)
    context.add_init_script(CHARTS_JS)
    context.add_init_script(WIRE_JS)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    page.goto(url)
    page.locator('[data-testid="stMetric"]').filter(has_text="Attention mass retained").first.wait_for()
    idle(page)
    paint = (
        page.evaluate("""() => window.__kvviz.samples.find(
        s => s[0].includes('metric: Attention mass retained='))[2]""")
        / 1000
    )
    return paint, page.evaluate("window.__chartsDrawn") / 1000, page


def fresh_visits(browser, times: int, launcher: bool, keep: contextlib.ExitStack | None = None):
    """The first visit of `times` freshly started servers: ([(paint, charts)], the last page, its server's
    URL). With `keep`, the last server keeps serving until `keep` closes; the others stop after their visit."""
    name = "benchmark-browser-server" if launcher else "benchmark-browser-plain-server"
    found, page, url = [], None, None
    for i in range(times):
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(
                serve_app(ROOT / "test-artifacts" / f"{name}.log", env={"KVVIZ_WARMUP": WARMUP}, launcher=launcher)
            )
            time.sleep(OPENED_AFTER)
            paint, charts, page = first_visit(browser, url)
            found.append((paint, charts))
            if keep is not None and i == times - 1:
                keep.enter_context(stack.pop_all())
            else:
                page.context.close()
    return found, page, url


def main() -> int:
    if CHROMIUM is None or not Path(CHROMIUM).is_file():
        print(f"browser benchmark not run: {MISSING if CHROMIUM is None else f'no Chromium at {CHROMIUM}'}")
        return 0
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, contextlib.ExitStack() as last_server:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        last_server.callback(browser.close)
        # the same first visit of a plain `streamlit run app.py`, in this run: what the launcher saves
        plain, _, _ = fresh_visits(browser, PLAIN_VISITS, launcher=False)
        visits, page, url = fresh_visits(browser, FRESH_VISITS, launcher=True, keep=last_server)
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        parts, linked, waited = [], 0, []
        if WARMUP != "0":  # the model's load starts once the server has had no page run for a while
            from kvviz.app.sources import QUIET_BEFORE_MODEL_S

            time.sleep(QUIET_BEFORE_MODEL_S + 1.0)
        for label, key in MOVES:
            waited.append(quiet(pid))
            parts.append(move(page, label, key, pid))
            linked += reproduces(page)
    moves = [p["total"] for p in parts]
    paint = statistics.median(v[0] for v in visits)
    plain_paint = statistics.median(v[0] for v in plain)
    median, worst = statistics.median(moves), max(moves)
    charts = statistics.median(v[1] for v in visits)
    cpu = statistics.median(p["server CPU ms"] for p in parts)
    ratio = moves[0] / median
    print(f"model warm-up in the background: {'off' if WARMUP == '0' else 'on'} (KVVIZ_WARMUP)")
    print(
        "first visits of a fresh server: "
        + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in visits)
        + " s (first paint / charts drawn)"
    )
    print("first visits of a plain `streamlit run app.py`: " + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in plain) + " s")
    print(
        f"first paint {paint:.2f} s (make run, median of {len(visits)}; target <= {TARGET_PAINT:g} s on a quiet "
        f"machine) | plain `streamlit run app.py`: {plain_paint:.2f} s (median of {len(plain)})"
    )
    print(f"plain / make run first paint {plain_paint / paint:.2f} (target <= {TARGET_PLAIN:g})")
    print(
        f"charts drawn {charts:.2f} s (median; target <= {TARGET_CHARTS:g} s; plain `streamlit run app.py`: "
        f"{statistics.median(v[1] for v in plain):.2f} s)"
    )
    print(
        f"{len(MOVES)} moves at {VIEWPORT['width']}x{VIEWPORT['height']}, each from a quiet server (waited "
        f"{waited[0]:.1f} s before the first: the background warm-up; {statistics.median(waited[1:]):.1f} s "
        "median before the others), each part's median (worst):"
    )
    for name in parts[0]:
        values = [p[name] for p in parts]
        unit = "" if name in ("server CPU ms", "messages", "kB") else " s"
        print(f"  {name:22s} {statistics.median(values):8.2f}{unit} ({max(values):.2f})")
    print("moves: " + ", ".join(f"{m:.2f}" for m in moves) + " s")
    print(f"first move {moves[0]:.2f} s")
    print(
        f"move -> charts redrawn: median {median:.2f} s, worst {worst:.2f} s (targets <= {TARGET_MOVE:g} s and "
        f"<= {TARGET_WORST:g} s)"
    )
    print(f"server CPU per move: median {cpu:.0f} ms (target <= {TARGET_CPU:g} ms; /proc counts in 10 ms ticks)")
    print(f"first move / median move ratio {ratio:.2f} (target <= {TARGET_RATIO:g})")
    print(f"URL reproduces the view after {linked} of {len(MOVES)} moves")
    met = {
        "first paint": paint <= TARGET_PAINT,
        "plain / make run": plain_paint / paint <= TARGET_PLAIN,
        "charts drawn": charts <= TARGET_CHARTS,
        "median move": median <= TARGET_MOVE,
        "worst move": worst <= TARGET_WORST,
        "server CPU": round(cpu, 1) <= TARGET_CPU,
        "first / median move": ratio <= TARGET_RATIO,
        "URL": linked == len(MOVES),
    }
    missed = [name for name, ok in met.items() if not ok]
    return targets_met("targets", missed)


if __name__ == "__main__":
    sys.exit(main())
