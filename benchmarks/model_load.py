"""Loading the bundled model: from the converted-weights cache against the first GGUF conversion.

In one process, with a fresh, empty weights cache folder (a temporary directory): the
first load converts the GGUF file (dequantizing every tensor) and saves the converted
weights; the next loads read them back (and check their sha256). torch and transformers
are imported before either is timed. It prints

    cached load / first conversion = ratio      (target <= 0.2)

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/model_load.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _common import offline, within

offline()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="cached loads timed (median)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch
    import transformers  # noqa: F401 - imported before timing

    from kvviz.models import load_model

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="kvviz-weights-") as tmp:
        os.environ["KVVIZ_WEIGHTS_DIR"] = tmp
        phases: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        load_model("bundled", progress=lambda f, m: phases.append((time.perf_counter() - t0, m)))
        first = time.perf_counter() - t0
        cached = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            load_model("bundled")
            cached.append(time.perf_counter() - t0)
    c = statistics.median(cached)
    print(
        f"first load (GGUF conversion + saving the cache): {first:.2f} s; "
        f"cached load: {c:.2f} s (median of {len(cached)}: {', '.join(f'{x:.2f}' for x in cached)})"
    )
    within(f"cached load / first conversion = {c / first:.3f}", c / first, 0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
