"""The server's CPU time per slider move of the Explorer, one websocket session, and the same against another
checkout in the same run, move for move.

    python benchmarks/move_cpu.py                          # this checkout: 150 moves
    python benchmarks/move_cpu.py --against /tmp/before    # and a checkout of an earlier commit beside it
    python benchmarks/move_cpu.py --moves 300 --against /tmp/before

On a shared machine the speed drifts by a third within minutes, so two runs one after the other compare the
drift as much as the code. Here each checkout gets its own `streamlit run app.py` and one session (the
browser's protocol, benchmarks/load.py's Session), and the moves take turns: a move on this checkout's
server, then one on the other's, each timed by its server's CPU time (/proc, both its script run and its
event loop). The drift falls on both alike, and the printed ratio holds where the milliseconds do not.

Printed: each server's mean CPU per move, the ratio this / against with the ratio in each half of the run
(they agree when the drift is shared), and the target. Exits 1 when this checkout's mean is over 40 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import targets_met
from load import ROOT, Session, cpu_seconds, served

TARGET_MS = 40.0  # server CPU per move (the Explorer on its defaults)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, help="another checkout to run beside this one, move for move")
    p.add_argument("--moves", type=int, default=150, help="moves per server (default 150)")
    args = p.parse_args(argv)
    roots = [ROOT] + ([args.against.resolve()] if args.against else [])
    per_move: list[list[float]] = [[] for _ in roots]
    with contextlib.ExitStack() as stack:
        sessions = []
        for root in roots:
            log = Path(tempfile.mkdtemp(prefix="kvviz-move-cpu-")) / "server.log"
            url, proc = stack.enter_context(served(log, root=root))
            session = Session(url, seed=1)
            stack.callback(session.close)
            session.rerun(timeout=120)
            while session.missing():
                if not session.read_until_finished(timeout=30):
                    raise SystemExit(f"{root}: the Explorer's sliders did not arrive")
            for _ in range(10):  # warm: the first moves import and compile what later ones reuse
                session.move()
                session.rerun(timeout=60)
            sessions.append((session, proc.pid))
        time.sleep(1)
        for _ in range(args.moves):
            for i, (session, pid) in enumerate(sessions):
                before = cpu_seconds(pid)
                session.move()
                if not session.rerun(timeout=60):
                    raise SystemExit(f"{roots[i]}: a move's run did not finish within 60 s")
                per_move[i].append((cpu_seconds(pid) - before) * 1000)
    print(f"the Explorer, {args.moves} moves of its sliders per server, one websocket session each:")
    for root, values in zip(roots, per_move):
        print(f"  {root}: server CPU per move mean {statistics.mean(values):.1f} ms")
    if args.against:
        here, there = per_move
        half = len(here) // 2
        ratio = statistics.mean(here) / statistics.mean(there)
        halves = [statistics.mean(here[s]) / statistics.mean(there[s]) for s in (slice(0, half), slice(half, None))]
        print(f"ratio this / against {ratio:.2f} (first half {halves[0]:.2f}, second half {halves[1]:.2f})")
    mean = statistics.mean(per_move[0])
    print(f"server CPU per move {mean:.1f} ms (target <= {TARGET_MS:g} ms; /proc counts in 10 ms ticks, so a mean)")
    return targets_met("targets", ["server CPU per move"] if mean > TARGET_MS else [])


if __name__ == "__main__":
    sys.exit(main())
