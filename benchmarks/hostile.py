"""A hostile link against a server this script starts on loopback: the huge link on every page, then
SIGTERM while a long computation runs.

    python benchmarks/hostile.py
    python benchmarks/hostile.py --only sigterm --root ../main     # the shutdown part against another checkout

After one ordinary page view (so the server has done its imports, as a server in use has):
1. Every page opens `/?source=synthetic&context=1000000000&steps=1000000000&layers=100000&q_heads=100000&
   kv_heads=100000` in a fresh session (websocket clients as in load.py); printed per page: seconds until
   the work-budget notice is shown (pages with a source) and until the page has finished, and the server's
   peak resident memory (VmRSS, /proc/<pid>/status, sampled every 0.1 s) over all of it.
2. A session opens a link whose computation takes long but fits the budget (a 33k-token synthetic
   pattern, H2O over all of its context); 3 s later the visitor switches the source to the handbook
   example: printed, seconds until that rerun has finished (the long computation must stop first).
3. The same long computation again; 3 s in, the server gets SIGTERM; printed: seconds until the
   process has exited.
Exits 1 when a notice takes 5 s or more, the peak RSS reaches 2 GB, the rerun or the stop take 5 s or more.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import targets_met  # noqa: E402
from load import ROOT, Session, rss_mb, served  # noqa: E402

HUGE = "source=synthetic&context=1000000000&steps=1000000000&layers=100000&q_heads=100000&kv_heads=100000"
PAGES = {
    "": "Explorer",
    "trade-offs": "Trade-offs",
    "concentration": "Concentration",
    "model-lab": "Model lab",
    "decode-timeline": "Decode timeline",
    "needle-test": "Needle test",
}
USES_THE_SOURCE = {"", "trade-offs", "concentration", "decode-timeline"}
LONG = "source=synthetic&context=32768&steps=512&sink=4&recent=2000&heavy=2000&scorer=h2o"
NOTICE_S, RSS_MB, STOP_S = 5.0, 2048.0, 5.0


def sample_rss(pid: int, stop: threading.Event, peak: list) -> None:
    while not stop.is_set():
        try:
            peak[0] = max(peak[0], rss_mb(pid))
        except (OSError, RuntimeError):
            return
        stop.wait(0.1)


def huge_link(url: str) -> list[str]:
    """The huge link on every page; returns what missed."""
    missed = []
    for path, name in PAGES.items():
        s = Session(url, seed=0)
        t0 = time.perf_counter()
        finished = s.rerun(timeout=120, query=HUGE, page=path)
        done = time.perf_counter() - t0
        notices = [t - t0 for t, text in s.alerts if "Too big for this server" in text]
        s.close()
        shown = f"notice after {notices[0]:.1f} s, " if notices else ""
        print(
            f"  {name:<16} {shown}page finished after {done:.1f} s"
            + ("" if finished else " (did not finish)")
            + (f"; exceptions: {s.exceptions}" if s.exceptions else "")
        )
        if s.exceptions or not finished or (path in USES_THE_SOURCE and (not notices or notices[0] >= NOTICE_S)):
            missed.append(f"huge link on {name}")
    return missed


def rerun_during(url: str) -> float:
    """Seconds from a rerun - the visitor switches the source to the handbook example - sent 3 s into a
    long computation, until that rerun has finished: the long computation must stop first."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.WidgetStates_pb2 import WidgetState

    s = Session(url, seed=3)
    msg = BackMsg()
    msg.rerun_script.query_string = LONG
    s.ws.send(msg.SerializeToString())
    s.read_until_finished(timeout=3)  # the sidebar's widgets arrive; the computation runs on
    source = s.radios["Attention source"]
    s.values[source.id] = WidgetState(id=source.id, string_value="Handbook example")
    t0 = time.perf_counter()
    finished = s.rerun(timeout=600, query=LONG)
    seconds = time.perf_counter() - t0 if finished else float("inf")
    shown = s.metrics.get("Tokens kept")
    s.close()
    if not (shown or "").endswith("/ 64"):  # the handbook example has 64 tokens
        raise SystemExit(f"the rerun did not show the handbook example (Tokens kept: {shown})")
    return seconds


def sigterm(url: str, proc) -> float:
    """Seconds from SIGTERM, sent 3 s into a long computation, until the server process has exited."""
    s = Session(url, seed=1)
    from streamlit.proto.BackMsg_pb2 import BackMsg

    msg = BackMsg()
    msg.rerun_script.query_string = LONG
    s.ws.send(msg.SerializeToString())
    s.read_until_finished(timeout=3)
    s.keep_reading()
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=600)
        return time.perf_counter() - t0
    finally:
        s.close()  # after the clock: closing waits out the dead server's close handshake


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose app.py is served")
    p.add_argument("--only", choices=("huge", "sigterm"), default=None)
    a = p.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="kvviz-hostile-")) / "server.log"
    missed, peak, stop = [], [0.0], threading.Event()
    with served(log, root=a.root.resolve()) as (url, proc):
        warm = Session(url, seed=2)  # a server that has served a page: imports done, as in use
        warm.rerun(timeout=180)
        warm.close()
        threading.Thread(target=sample_rss, args=(proc.pid, stop, peak), daemon=True).start()
        if a.only != "sigterm":
            print(f"huge link on every page ({url}/?{HUGE})")
            missed += huge_link(url)
            print(f"  server peak RSS {peak[0]:.0f} MB")
            if peak[0] >= RSS_MB:
                missed.append("RSS")
        if a.only is None:
            seconds = rerun_during(url)
            print(f"a rerun 3 s into that long computation (/?{LONG}) finished after {seconds:.1f} s")
            if seconds >= STOP_S:
                missed.append("rerun")
        if a.only != "huge":
            seconds = sigterm(url, proc)
            print(
                f"SIGTERM 3 s into a long computation (/?{LONG}): the server exited after {seconds:.1f} s "
                f"(status {proc.returncode})"
            )
            if seconds >= STOP_S:
                missed.append("SIGTERM")
        stop.set()
    return targets_met("targets (notice < 5 s, peak RSS < 2 GB, rerun < 5 s, stop < 5 s)", missed, log)


if __name__ == "__main__":
    sys.exit(main())
