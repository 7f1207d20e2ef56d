"""Compressed-cache decoding cost on the bundled SmolLM2-135M (eager attention, CPU, float32).

For the same prompt and the same number of decode steps (teacher-forced on the same
tokens), it prints

    <spec>: compressed decode / plain full-cache decode = ratio      (target <= 1.5)

where "plain" is transformers' own decode loop with a DynamicCache and "compressed" is
kvviz.decode.loop.decode with the spec (our attention function, eviction decisions every
step, the KIVI quantizer on the kept K/V). Decode steps only; the one-off compression
point (the policy scoring the prompt) is printed separately. Each time is the median of
several runs measured in this one process, plain and compressed interleaved so background
load hits both alike, with 1 torch thread (--threads).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/generation.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import bundled_model, decode_times, offline, within

offline()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=206)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch

    from kvviz.decode.loop import decode, plain_decode
    from kvviz.decode.quality import sample_text, tokenize
    from kvviz.spec import Spec

    model, tokenizer, info, seconds = bundled_model(a.threads)
    print(
        f"model: {info.name} ({info.n_layers} layers, {info.n_q_heads} q / {info.n_kv_heads} kv heads), "
        f"loaded in {seconds:.1f} s; torch threads {torch.get_num_threads()}"
    )
    ids = tokenize(tokenizer, sample_text())
    n, m = a.prompt_tokens, a.steps
    if len(ids) < n + m:
        ids = (ids * (1 + (n + m) // len(ids)))[: n + m]
    prompt, feed = ids[:n], ids[n : n + m]
    specs = {
        "h2o sink 4 + recent 28 + heavy 32": Spec(sink=4, recent=28, heavy=32, scorer="h2o"),
        "streaming sink 4 + recent 60": Spec(sink=4, recent=60, scorer="streaming"),
        "kivi 2-bit K/V (residual 32)": Spec(key_bits=2, value_bits=2, residual=32),
        "h2o 64 + 4-bit K/V": Spec(sink=4, recent=28, heavy=32, scorer="h2o", key_bits=4, value_bits=4),
        "oracle 64 (full attention each step)": Spec(sink=4, recent=28, heavy=32, scorer="oracle"),
    }
    # warm-up
    plain_decode(model, prompt, 4, feed=feed)
    decode(model, prompt, Spec(sink=4, recent=28, heavy=32), 4, feed=feed)

    plain, comp, prefill = decode_times(model, prompt, feed, specs, m, a.repeats)
    base = statistics.median(plain)
    print(
        f"prompt {n} tokens, {m} decode steps; plain full-cache decode: {base:.3f} s "
        f"({1000 * base / m:.1f} ms/token, median of {len(plain)})"
    )
    worst = 0.0
    for name in specs:
        c = statistics.median(comp[name])
        ratio = c / base
        worst = max(worst, ratio)
        print(
            f"{name}: compressed decode / plain full-cache decode = {ratio:.2f} "
            f"({1000 * c / m:.1f} ms/token; compression point incl. prefill {statistics.median(prefill[name]):.2f} s)"
        )
    within(f"worst ratio {worst:.2f}", worst, 1.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
