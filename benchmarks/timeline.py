"""Decode timeline: a step move after the first computation, against the first computation.

Server side, on the page's default demo (synthetic, 256 context tokens, 48 decode steps,
topic shift) with the handbook's budget and all four policies. The first computation is
what the page does once per setting: every policy replayed step by step
(kvviz.analysis.timeline.timeline) and the one animated figure with a frame per step, serialized
as Streamlit sends it. A step move afterwards is what the page's fragment does: copy the
step's table (the fragment holds the step slider and the table; the charts keep their own
step slider and Play, which run in the browser, plotly frames, and cost the server nothing). It prints

    step move / first computation = ratio      (target <= 0.05)

    .venv/bin/python benchmarks/timeline.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _common import within


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    import numpy as np
    import plotly.graph_objects as go

    from kvviz.plots.timeline import timeline_animation
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
    from kvviz.spec import Spec
    from kvviz.analysis.timeline import timeline

    trace = make_synthetic(SyntheticSpec(context=256, steps=48, topic_shift=12.0))
    spec = Spec(sink=4, recent=8, heavy=2)
    timeline_animation(timeline(make_synthetic(SyntheticSpec(context=32, steps=4)), spec), 0)  # warm-up imports

    def first() -> tuple[float, object, go.Figure]:
        t0 = time.perf_counter()
        tl = timeline(trace, spec, max_steps=256)
        fig = timeline_animation(tl, 0, shift_step=12)
        fig.to_json()
        return time.perf_counter() - t0, tl, fig

    def move(tl, cached: go.Figure, step: int) -> float:
        t0 = time.perf_counter()
        rows = [
            {
                "policy": name,
                "regret": round(float(pt.regret[step]), 4),
                "held": int(pt.kept[step].sum()),
                "missed": np.flatnonzero(pt.missed[step])[:12].tolist(),
            }
            for name, pt in tl.policies.items()
        ]
        json.dumps(rows)
        del cached
        return time.perf_counter() - t0

    firsts, moves = [], []
    for r in range(a.repeats):
        t, tl, fig = first()
        firsts.append(t)
        moves += [move(tl, fig, s) for s in (5 + r, 20 + r, 40 + r)]
    f, m = statistics.median(firsts), statistics.median(moves)
    print(
        f"first computation (4 policies x 48 steps + the animated figure): {f:.3f} s (median of {len(firsts)}); "
        f"step move: {1000 * m:.1f} ms (median of {len(moves)})"
    )
    within(f"step move / first computation = {m / f:.5f}", m / f, 0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
