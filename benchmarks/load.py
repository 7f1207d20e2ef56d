"""Load probe: N sessions x M slider moves against a `streamlit run app.py` this script starts on loopback.

    python benchmarks/load.py 30 20            # a class: 30 sessions, 20 moves each
    python benchmarks/load.py 10 50            # 10 sessions, 50 moves each
    python benchmarks/load.py 3 5 --timeout 300
    python benchmarks/load.py 10 50 --root ../main          # the same probe against another checkout
    python benchmarks/load.py 1 60                          # one student: the server's CPU per move

Each session is a websocket client that speaks Streamlit's own protocol (the BackMsg / ForwardMsg
protobufs from the streamlit package), as the browser does: it opens the Explorer, waits until every
named slider has arrived, then moves one slider at a time (one step left or right) and waits for
that rerun to finish before the next move. A client this light leaves the machine's two cores to the
server, where ten Chromium tabs would compete with it. Meanwhile one thread asks the health endpoint
(/_stcore/health) and a static file (the page's index.html) every 0.1 s and records how long each
answer took.

Printed: the server process's CPU time per move, each student's wait per move (from sending the moved value
until that run has finished;
`wait per move  mean X s, p95 Y s`), exceptions (shown in a page, and tracebacks in the server's log),
missing sliders, the server's resident memory (VmRSS of its process, /proc/<pid>/status) before and
after, and the latency percentiles. Exits 1 when a target is missed: wait per move mean <= 1 s and
p95 <= 2 s, 0 exceptions, 0 missing sliders, RSS growth < 100 MB, health p99 < 1 s. Bounded in time
(--timeout, default 900 s); never leaves loopback.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import targets_met

ROOT = Path(__file__).resolve().parents[1]
SLIDERS = ("Sink tokens", "Recent window", "Heavy-hitter budget", "Quantization bits", "Ensemble size")
TARGETS = {
    "exceptions": 0,
    "missing": 0,
    "rss_growth_mb": 100.0,
    "health_p99_s": 1.0,
    "wait_mean_s": 1.0,
    "wait_p95_s": 2.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (s), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB, from /proc/<pid>/status (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextmanager
def served(log: Path, root: Path = ROOT, env: dict | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`streamlit run app.py` of `root` on a free loopback port: yield (url, process) once it is healthy
    (the body may stop it itself); stop it afterwards."""
    from kvviz.app.serve import local_command

    port = free_port()
    cmd = local_command(port, root / "app.py")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "KVVIZ_WARMUP": "0", **(env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def get(url: str, timeout: float = 10.0) -> float:
    """Seconds for a GET to answer in full; the timeout when it does not."""
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
    except OSError:
        return timeout
    return time.perf_counter() - t0


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 90) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        if get(f"{url}/_stcore/health", 2) < 2:
            return
        time.sleep(0.3)
    raise SystemExit(f"the server was not healthy within {seconds:.0f} s")


class Session:
    """One browser-like session over Streamlit's websocket protocol."""

    def __init__(self, url: str, seed: int):
        from contextlib import ExitStack

        from websockets.sync.client import connect

        host = url.split("//", 1)[1]
        self.stack = ExitStack()
        self.ws = self.stack.enter_context(
            connect(
                f"ws://{host}/_stcore/stream", subprotocols=["streamlit"], origin=url, max_size=None, open_timeout=60
            )
        )
        self.rng = random.Random(seed)
        self.sliders: dict[str, object] = {}  # label -> the latest Slider proto
        self.values: dict[str, object] = {}  # widget id -> WidgetState the client holds
        self.exceptions: list[str] = []
        self.metrics: dict[str, str] = {}  # card label -> the value shown (the moves change them)
        self.alerts: list[tuple[float, str]] = []  # (perf_counter, text) of warnings, errors and notes shown
        self.radios: dict[str, object] = {}  # label -> the latest Radio proto
        self.moves = 0

    def close(self) -> None:
        try:
            self.stack.close()
        except Exception:  # noqa: BLE001 - a closed socket is closed
            pass

    def rerun(self, timeout: float, query: str = "", page: str = "") -> bool:
        """Ask for a rerun (of page, by its URL path; "" = the Explorer) with the widget values held;
        read until it finishes. True when it did."""
        from streamlit.proto.BackMsg_pb2 import BackMsg

        msg = BackMsg()
        msg.rerun_script.query_string = query
        msg.rerun_script.page_script_hash = ""
        msg.rerun_script.page_name = page
        for state in self.values.values():
            msg.rerun_script.widget_states.widgets.append(state)
        self.ws.send(msg.SerializeToString())
        return self.read_until_finished(timeout)

    def read_until_finished(self, timeout: float) -> bool:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                return False
            try:
                data = self.ws.recv(timeout=left)
            except TimeoutError:
                return False
            fm = ForwardMsg()
            fm.ParseFromString(data)
            kind = fm.WhichOneof("type")
            if kind == "delta" and fm.delta.WhichOneof("type") == "new_element":
                el = fm.delta.new_element
                what = el.WhichOneof("type")
                if what == "slider":
                    self.sliders[el.slider.label] = el.slider
                elif what == "metric":
                    self.metrics[el.metric.label] = el.metric.body
                elif what == "radio":
                    self.radios[el.radio.label] = el.radio
                elif what == "exception":
                    self.exceptions.append(f"{el.exception.type}: {el.exception.message}")
                elif what == "alert":
                    self.alerts.append((time.perf_counter(), el.alert.body))
            elif kind == "script_finished" and fm.script_finished == ForwardMsg.FINISHED_SUCCESSFULLY:
                return True

    def keep_reading(self) -> None:
        """Read (and drop) whatever arrives, in a helper thread, as a browser tab does while it waits:
        a client that stops reading stalls the server's sends and its shutdown's close handshake."""

        def drain():
            try:
                while True:
                    self.ws.recv()
            except Exception:  # noqa: BLE001 - closed: done
                pass

        threading.Thread(target=drain, daemon=True).start()

    def missing(self) -> list[str]:
        return [s for s in SLIDERS if s not in self.sliders]

    def move(self) -> str:
        """One step of one named slider, left or right within its range; returns what moved."""
        from streamlit.proto.WidgetStates_pb2 import WidgetState

        label = self.rng.choice([s for s in SLIDERS if s in self.sliders])
        sl = self.sliders[label]
        state = WidgetState(id=sl.id)
        if sl.options:  # select_slider: the option's text
            current = (
                list(self.values[sl.id].string_array_value.data)
                if sl.id in self.values
                else [sl.options[int(sl.value[0] if sl.value else sl.default[0])]]
            )
            i = list(sl.options).index(current[0])
            i = min(max(i + self.rng.choice((-1, 1)), 0), len(sl.options) - 1)
            state.string_array_value.data.append(sl.options[i])
        else:
            current = (
                self.values[sl.id].double_array_value.data[0]
                if sl.id in self.values
                else (sl.value[0] if sl.value else sl.default[0])
            )
            step = sl.step or 1
            v = min(max(current + self.rng.choice((-1, 1)) * step, sl.min), sl.max)
            state.double_array_value.data.append(v)
        self.values[sl.id] = state
        self.moves += 1
        return label


def poll_latency(url: str, stop: threading.Event, health: list, static: list) -> None:
    while not stop.is_set():
        health.append(get(f"{url}/_stcore/health"))
        static.append(get(f"{url}/"))
        stop.wait(0.1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def run_session(url: str, i: int, moves: int, deadline: float, out: dict) -> None:
    s = None
    try:
        s = Session(url, seed=i)
        s.rerun(timeout=120)
        while s.missing() and time.time() < deadline - 1:  # every named slider before the first move
            s.read_until_finished(timeout=min(5, deadline - time.time()))
            if s.missing():
                s.rerun(timeout=min(60, deadline - time.time()))
        out["missing"] = s.missing()
        if out["missing"]:
            return
        for _ in range(moves):
            if time.time() > deadline:
                out["timed_out"] = True
                break
            s.move()
            asked = time.perf_counter()
            if not s.rerun(timeout=min(120, max(1, deadline - time.time()))):
                out["timed_out"] = True
                break
            out.setdefault("waits", []).append(time.perf_counter() - asked)  # the student's wait
        out["moves"] = s.moves
    except Exception as e:  # noqa: BLE001 - reported as a failed session
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if s is not None:
            out["exceptions"] = s.exceptions
            s.close()


def log_exceptions(log: Path) -> list[str]:
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if re.search(r"Traceback|Exception|Error:", line)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sessions", type=int, nargs="?", default=10)
    p.add_argument("moves", type=int, nargs="?", default=50)
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole run (default 900)")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose app.py is served (to compare)")
    a = p.parse_args(argv)
    if not (1 <= a.sessions <= 50 and 1 <= a.moves <= 1000 and 10 <= a.timeout <= 3600):
        p.error("sessions 1-50, moves 1-1000, timeout 10-3600 s")

    log = Path(tempfile.mkdtemp(prefix="kvviz-load-")) / "server.log"
    with served(log, root=a.root.resolve()) as (
        url,
        proc,
    ):  # no background model load (KVVIZ_WARMUP=0): the probe is the Explorer
        started = time.time()
        warm: dict = {}
        run_session(url, 999, 5, time.time() + 180, warm)  # imports, kernels, caches: warm
        time.sleep(2)
        rss_before = rss_mb(proc.pid)
        stop, health, static = threading.Event(), [], []
        poller = threading.Thread(target=poll_latency, args=(url, stop, health, static), daemon=True)
        poller.start()
        deadline = started + a.timeout
        results = [{} for _ in range(a.sessions)]
        threads = [
            threading.Thread(target=run_session, args=(url, i, a.moves, deadline, results[i]), daemon=True)
            for i in range(a.sessions)
        ]
        t0, cpu0 = time.time(), cpu_seconds(proc.pid)
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1, deadline - time.time()))
        load_seconds, load_cpu = time.time() - t0, cpu_seconds(proc.pid) - cpu0
        stop.set()
        poller.join(15)
        time.sleep(3)
        rss_after = rss_mb(proc.pid)

    page_exceptions = [e for r in results for e in r.get("exceptions", [])]
    errors = [r["error"] for r in results if "error" in r]
    missing = sum(len(r.get("missing", SLIDERS)) for r in results)
    moves = sum(r.get("moves", 0) for r in results)
    timed_out = sum(1 for r in results if r.get("timed_out"))
    server = log_exceptions(log)
    exceptions = len(page_exceptions) + len(server) + len(errors)
    growth = rss_after - rss_before
    h99 = percentile(health, 99)
    waits = [w for r in results for w in r.get("waits", [])]
    wait_mean = sum(waits) / len(waits) if waits else float("nan")
    wait_p95 = percentile(waits, 95)
    print(f"load: {a.sessions} sessions x {a.moves} moves of {', '.join(SLIDERS)} (websocket clients, loopback)")
    print(
        f"  moves done             {moves} of {a.sessions * a.moves} in {load_seconds:.1f} s"
        + (f"; {timed_out} session(s) out of time" if timed_out else "")
    )
    print(f"  server CPU per move    {load_cpu / max(moves, 1) * 1e3:.0f} ms (the server process, over the load)")
    print(
        f"  wait per move  mean {wait_mean:.2f} s, p95 {wait_p95:.2f} s, max {max(waits, default=float('nan')):.2f} s "
        f"(a move's rerun, sent until finished, over {len(waits)} moves)"
    )
    print(
        f"  exceptions             {exceptions} (in pages {len(page_exceptions)}, server log {len(server)}, "
        f"clients {len(errors)})"
    )
    for e in (page_exceptions + server + errors)[:5]:
        print(f"    {e[:160]}")
    print(f"  missing sliders        {missing}")
    print(f"  server RSS             {rss_before:.0f} MB before, {rss_after:.0f} MB after ({growth:+.0f} MB)")
    print(
        f"  health latency         p50 {percentile(health, 50) * 1e3:.0f} ms, p99 {h99 * 1e3:.0f} ms, "
        f"max {max(health, default=float('nan')) * 1e3:.0f} ms over {len(health)} requests"
    )
    print(
        f"  static file latency    p50 {percentile(static, 50) * 1e3:.0f} ms, p99 {percentile(static, 99) * 1e3:.0f} "
        f"ms, max {max(static, default=float('nan')) * 1e3:.0f} ms over {len(static)} requests"
    )
    missed = [
        name
        for name, bad in (
            ("exceptions", exceptions > TARGETS["exceptions"]),
            ("missing sliders", missing > TARGETS["missing"]),
            ("RSS growth", growth >= TARGETS["rss_growth_mb"]),
            ("health p99", not h99 < TARGETS["health_p99_s"]),
            ("moves", moves < a.sessions * a.moves),
            ("wait per move mean", not wait_mean <= TARGETS["wait_mean_s"]),
            ("wait per move p95", not wait_p95 <= TARGETS["wait_p95_s"]),
        )
        if bad
    ]
    return targets_met(
        "  targets (0 exceptions, 0 missing, RSS growth < 100 MB, health p99 < 1 s, every move done, wait per move "
        "mean <= 1 s and p95 <= 2 s)",
        missed,
        log,
    )


if __name__ == "__main__":
    sys.exit(main())
