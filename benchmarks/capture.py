"""Capture overhead and memory on the bundled SmolLM2-135M (sdpa attention, CPU, float32).

For 256, 1024 and 2048 prompt tokens it prints

    capture time / plain forward time = ratio          (target <= 1.3)

where "capture" is kvviz.sources.capture.capture (prefill only: tokenize, run the model while
recording q/k/v of every layer, build the Trace with readable token strings) and "plain
forward" is the same model with the same (sdpa) attention on the same token ids with no
recording (forward_only). Each
time is the median of several runs after a warm-up, measured in this one process, forward
and capture interleaved so background load hits both alike, with 1 torch thread (--threads).

Then it runs a 2048-token capture (+16 decode steps) in a fresh subprocess and prints its
peak resident memory (ru_maxrss; loading the GGUF is the high-water mark), and the peak
during the capture itself (VmHWM reset after loading), next to the resident size before it.
It exits 1 when a ratio is over 1.3 or the peak over 4 GiB.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/capture.py
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import TEXT, offline

offline()


def prompt_of(tokenizer, n: int) -> str:
    """A text of at least n tokens (capture cuts it to exactly n with max_tokens=n)."""
    text = TEXT
    while len(tokenizer(text)["input_ids"]) < n:
        text += TEXT
    return text


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB


def child(n: int) -> None:
    """Load the model, capture n tokens + 16 decode steps, print peak RSS figures."""
    from kvviz.models import load_model
    from kvviz.sources.capture import capture

    import psutil

    model, tok, info = load_model("bundled")
    prompt = prompt_of(tok, n)
    loaded = psutil.Process().memory_info().rss / 2**20  # resident now, model in memory
    reset_peak()  # so the capture's own peak shows
    trace = capture(model, tok, info, prompt, new_tokens=16, max_tokens=n)
    nbytes = sum(a.nbytes for a in (trace.q, trace.k, trace.v))
    print(f"{loaded:.0f} {capture_peak_mb():.0f} {rss_mb():.0f} {trace.n_positions} {nbytes / 2**20:.0f}")


def reset_peak() -> None:
    """Linux: writing 5 to /proc/self/clear_refs resets the peak-RSS mark (VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def capture_peak_mb() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine, 2 OpenMP threads "
        "competing with other processes make single timings swing 10x)",
    )
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    if a.child:
        child(a.child)
        return 0

    from kvviz.models import load_model
    from kvviz.sources.capture import capture, forward_only

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, bundled SmolLM2-135M, "
        "sdpa attention, float32, CPU"
    )
    model, tok, info = load_model("bundled")
    worst = 0.0
    for n in (256, 1024, 2048):
        prompt = prompt_of(tok, n)
        ids = tok(prompt)["input_ids"][:n]
        repeats = a.repeats if n <= 256 else max(3, a.repeats - 2)
        forward_only(model, ids)  # warm-up
        capture(model, tok, info, prompt, max_tokens=n)
        # interleave so load from other processes hits both alike
        t_fwd, t_cap = [], []
        for _ in range(repeats):
            t_fwd.append(median_time(lambda: forward_only(model, ids), 1))
            t_cap.append(median_time(lambda: capture(model, tok, info, prompt, max_tokens=n), 1))
        fwd, cap = statistics.median(t_fwd), statistics.median(t_cap)
        ratio = cap / fwd
        worst = max(worst, ratio)
        print(
            f"{n:5d} tokens: capture {cap * 1000:7.1f} ms / plain forward {fwd * 1000:7.1f} ms = "
            f"ratio {ratio:.2f} (target <= 1.3)"
        )

    out = subprocess.run(
        [sys.executable, __file__, "--child", "2048", "--threads", str(a.threads)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return 1
    loaded, cap_peak, peak, positions, trace_mb = out.stdout.split()[-5:]
    print(
        f" 2048 tokens (+16 decode steps, {positions} positions): peak RSS of the whole process "
        f"{peak} MiB (limit 4096 MiB); during the capture {cap_peak} MiB, from {loaded} MiB with the "
        f"model loaded; the trace's q/k/v: {trace_mb} MiB"
    )
    ok = worst <= 1.3 and float(peak) <= 4096
    print("OK" if ok else "OVER TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
