"""Decode-step cost of kvviz's attention on the bundled model: compressed step / plain step.

The Model lab's shape: the bundled SmolLM2-135M, the sample text's first 206 tokens
as the prompt and its next 57 as the continuation, teacher-forced (56 decode steps), one torch
thread, CPU, float32. "plain" is transformers' eager attention with its own DynamicCache;
"compressed" is kvviz's decode loop (kvviz's attention function over a CompressedCache, the
policy deciding at every step), for

    lab default   the Model lab's opening spec: H2O, 4 sinks + 8 recent + 2 heavy
    no compression  Spec(): kvviz's attention over the whole cache (its own overhead alone)
    h2o 64, 4-bit   4 + 28 + 32 tokens with 4-bit K/V

Decode steps only (the compression point is printed apart). Each time is the median of
several runs, plain and compressed interleaved so that background load hits both alike.
Prints `NAME: compressed X ms/step, plain Y ms/step, ratio R`, then the worst ratio of the
first two (the Model lab's step and kvviz's attention alone, the two that set a step's speed) with
its target (<= 1.1), and exits 1 when it is missed. The 4-bit line is printed for
information: it also pays for quantizing the kept K/V at every step.

Then, at 2,048 tokens: the sample text repeated to a 2,048-token
prompt, the compressed decode step for snapkv, h2o, streaming (each keeping 256 tokens) and 4-bit
KIVI (keys per channel, values per token, groups of 32, 128 recent tokens exact) against transformers'
own decode step with its DynamicCache at the same length (the full 2,048-token cache). Target: each
<= 1.3x; the run exits 1 when one is missed. `--dtype bfloat16` runs both sides in bfloat16.

    python benchmarks/decode.py [--profile] [--long 2048] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import bundled_model, decode_times, exit_status, kivi_4bit, offline

offline()

TARGET = 1.1
LONG_TARGET = 1.3
PROMPT, CONTINUATION = 206, 57


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile the lab default's decode steps")
    ap.add_argument("--long", type=int, default=2048, help="prompt tokens of the long-context check (0 = skip)")
    ap.add_argument("--long-steps", type=int, default=16, help="decode steps timed at that length")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--short", type=int, default=1, help="1 = also the Model lab's short check (0 = skip)")
    a = ap.parse_args()

    import torch

    from threadpoolctl import threadpool_limits

    from kvviz.decode import decode, plain_decode, sample_text, tokenize
    from kvviz.sources import handbook
    from kvviz.spec import Spec

    threadpool_limits(a.threads)  # numpy's BLAS too: one thread on both sides (torch's: bundled_model)
    model, tokenizer, info, _ = bundled_model(a.threads, dtype=a.dtype)
    print(
        f"model: {info.name} ({info.n_layers} layers, {info.n_q_heads} q / {info.n_kv_heads} kv heads); "
        f"torch threads {torch.get_num_threads()}, attention {model.config._attn_implementation}"
    )
    ids = tokenize(tokenizer, sample_text())
    prompt, feed = ids[:PROMPT], ids[PROMPT : PROMPT + CONTINUATION]
    steps = CONTINUATION - 1
    print(f"prompt {len(prompt)} tokens + continuation {len(feed)} tokens: {steps} teacher-forced decode steps")
    specs = {
        "lab default (h2o 4+8+2)": Spec(sink=handbook.SINK, recent=handbook.RECENT, heavy=handbook.HEAVY, scorer="h2o"),
        "no compression": Spec(),
        "h2o 4+28+32, 4-bit K/V": Spec(sink=4, recent=28, heavy=32, scorer="h2o", key_bits=4, value_bits=4),
    }
    if not a.short:
        return long_check(model, tokenizer, a)
    plain_decode(model, prompt, 4, feed=feed)  # warm-up (numba kernels, torch)
    for spec in specs.values():
        decode(model, prompt, spec, 4, feed=feed)

    if a.profile:
        import cProfile
        import pstats

        spec = next(iter(specs.values()))
        pr = cProfile.Profile()
        t: dict = {}
        pr.enable()
        decode(model, prompt, spec, steps, feed=feed, timings=t)
        pr.disable()
        print(f"profile of the lab default, {steps} steps ({t['decode'] * 1e3 / steps:.1f} ms/step incl. profiling):")
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)

    plain, comp, point = decode_times(model, prompt, feed, specs, steps, a.repeats)
    base = statistics.median(plain) / steps
    worst = 0.0
    for i, name in enumerate(specs):
        c = statistics.median(comp[name]) / steps
        if i < 2:  # the lab's step and kvviz's attention alone
            worst = max(worst, c / base)
        print(
            f"{name}: compressed {c * 1e3:.1f} ms/step, plain {base * 1e3:.1f} ms/step, ratio {c / base:.2f} "
            f"(+{(c - base) * 1e3:.1f} ms/step; prefill + compression point {statistics.median(point[name]):.2f} s)"
        )
    print(f"worst ratio {worst:.2f} (target <= {TARGET:g}; lab default and no compression)")
    ok = worst <= TARGET
    if a.long:
        ok = long_check(model, tokenizer, a) == 0 and ok
    return 0 if ok else 1


def long_specs(n: int) -> dict:
    from kvviz.spec import Spec

    keep = dict(sink=4, recent=124, heavy=128)
    return {
        "snapkv 256": Spec(**keep, scorer="snapkv"),
        "h2o 256": Spec(**keep, scorer="h2o"),
        "streaming 256": Spec(sink=4, recent=252, scorer="streaming"),
        "kivi 4-bit": kivi_4bit(),
    }


def long_check(model, tokenizer, a) -> int:
    """The compressed decode step against transformers' own (DynamicCache) at a.long tokens."""
    from kvviz.decode import decode, plain_decode, prefill, sample_text, tokenize

    text = sample_text()
    ids: list[int] = []
    while len(ids) < a.long + a.long_steps:
        ids += tokenize(tokenizer, text)
    prompt, feed = ids[: a.long], ids[a.long : a.long + a.long_steps]
    steps = a.long_steps
    print(f"\n{a.long}-token prompt, {steps} teacher-forced decode steps, {a.dtype}:")
    pre = prefill(model, prompt)  # the compressed runs start from one prefill
    specs = long_specs(a.long)
    plain_decode(model, prompt[:64], 2, feed=feed)  # warm-up
    for spec in specs.values():
        decode(model, prompt, spec, 2, feed=feed, prefix=pre)
    plain: list[float] = []
    comp: dict[str, list[float]] = {k: [] for k in specs}
    for _ in range(a.repeats):
        tp: dict = {}
        plain_decode(model, prompt, steps, feed=feed, timings=tp)
        plain.append(tp["decode"] / steps)
        for name, spec in specs.items():
            tc: dict = {}
            decode(model, prompt, spec, steps, feed=feed, timings=tc, prefix=pre)
            comp[name].append(tc["decode"] / steps)
    base = statistics.median(plain)
    worst = 0.0
    for name in specs:
        c = statistics.median(comp[name])
        worst = max(worst, c / base)
        print(
            f"{name}: compressed {c * 1e3:.1f} ms/step, transformers DynamicCache {base * 1e3:.1f} ms/step, "
            f"ratio {c / base:.2f}"
        )
    return exit_status(f"worst ratio at {a.long} tokens {worst:.2f}", worst, LONG_TARGET)


if __name__ == "__main__":
    sys.exit(main())
