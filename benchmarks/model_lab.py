"""The Model lab's default run against the plain transformers work for the same tokens.

The default run (bundled SmolLM2-135M, the sample text: 206 prompt + 57 scored tokens, 32
greedy tokens side by side) with the model warm, through kvviz.decode.lab.run: one shared
prefill, the full-cache greedy text, the compressed greedy text and the teacher-forced
quality. The plain work for the same tokens is transformers' own: one forward over
prompt + continuation, plus plain greedy decoding (DynamicCache: the prompt's prefill,
then one token a step) of the same greedy length, twice. It prints

    <spec>: Model lab run / plain transformers work = ratio   (target <= 1.0 one-shot, <= 1.5 h2o)

Each time is the median of --repeats runs in this one process, plain and lab interleaved
so background load hits both alike (the lab's full-cache side is recomputed every time).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/model_lab.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import bundled_model, offline

offline()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch

    from kvviz.decode import lab, labsettings
    from kvviz.decode.loop import plain_decode
    from kvviz.decode.quality import tokenize
    from kvviz.spec import Spec

    model, tokenizer, info, seconds = bundled_model(a.threads)
    print(f"model: {info.label}, loaded in {seconds:.1f} s; torch threads {torch.get_num_threads()}")
    default = labsettings.default_settings()
    n, m, g = default.prompt_tokens, default.continuation, default.greedy_tokens
    ids = tokenize(tokenizer, default.text)[: n + m]
    budget = dict(sink=default.spec.sink, recent=default.spec.recent, heavy=default.spec.heavy)
    runs = {
        f"h2o {default.spec.label()} (the page's default)": default,
        "snapkv, same budget (one-shot)": labsettings.LabSettings(
            **{**default.__dict__, "spec": Spec(**budget, scorer="snapkv")}
        ),
        "streaming sink 4 + recent 10 (one-shot)": labsettings.LabSettings(
            **{**default.__dict__, "spec": Spec(sink=4, recent=10, scorer="streaming")}
        ),
        "kivi-2bit alone (one-shot)": labsettings.LabSettings(
            **{**default.__dict__, "spec": Spec(key_bits=2, value_bits=2, residual=32)}
        ),
    }

    def plain() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), use_cache=False)
        for _ in range(2):
            plain_decode(model, ids[:n], g - 1)
        return time.perf_counter() - t0

    def lab_run(settings) -> float:
        lab._FULL.clear()
        t0 = time.perf_counter()
        lab.run(model, tokenizer, info.label, settings)
        return time.perf_counter() - t0

    plain()  # warm-up
    lab_run(labsettings.LabSettings(**{**default.__dict__, "continuation": 8, "greedy_tokens": 4}))
    base: list[float] = []
    took: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.repeats):
        for name, settings in runs.items():
            base.append(plain())
            took[name].append(lab_run(settings))
    b = statistics.median(base)
    print(
        f"{n} prompt + {m} scored tokens, {g} greedy tokens; plain transformers work: {b:.2f} s (median of {len(base)})"
    )
    ok = True
    for name, settings in runs.items():
        c = statistics.median(took[name])
        target = 1.0 if labsettings.one_pass(settings.spec) else 1.5
        ok &= c / b <= target
        print(f"{name}: Model lab run / plain transformers work = {c / b:.2f} ({c:.2f} s; target <= {target})")
    print("all within target" if ok else "some OVER target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
