"""Server-side rerun time of the Explorer page after a slider move (Streamlit AppTest).

Prints the handbook example and a 4k-token synthetic pattern (H2O, error bars over heads),
each the median of three slider moves whose results are not cached yet, and a rerun
where nothing changed (served from st.cache_data).

    python benchmarks/app_rerun.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

os.environ.setdefault("KVVIZ_WARMUP", "0")  # no background model load while the Explorer is timed

APP = str(Path(__file__).resolve().parents[1] / "app.py")


def page(**params) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=300)
    for k, v in params.items():
        at.query_params[k] = str(v)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def rerun_after(at: AppTest, key: str, value) -> float:
    at.slider(key=key).set_value(value)
    t0 = time.perf_counter()
    at.run()
    return time.perf_counter() - t0


def main() -> None:
    at = page()
    handbook = np.median([rerun_after(at, "heavy", h) for h in (3, 4, 5)])
    at = page(source="synthetic", context=4096, sink=4, recent=410, heavy=410)
    synthetic = np.median([rerun_after(at, "heavy", h) for h in (400, 390, 380)])
    t0 = time.perf_counter()
    at.run()
    cached = time.perf_counter() - t0
    print(
        f"explorer rerun after a slider move: handbook {handbook * 1e3:.0f} ms, "
        f"4k-token synthetic {synthetic * 1e3:.0f} ms (h2o, heads ensemble); "
        f"rerun with nothing changed {cached * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
