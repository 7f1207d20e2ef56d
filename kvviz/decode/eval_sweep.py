"""`kvviz eval-sweep`: named methods (eviction, KIVI, serving formats) x budgets on one text,
each scored against the full cache (perplexity, next-token KL, top-1, bytes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial


from kvviz.decode.cache import Progress
from kvviz.decode.quality import QUALITY_FIELDS, Reference, evaluate
from kvviz.policies import get_policy
from kvviz.policies.merging import merges
from kvviz.quant import kivi_residual
from kvviz.quant.formats import hf_quantized_cache
from kvviz.spec import SCORERS, Spec, SpecError


SWEEP_FIELDS = ("method", "budget", "spec", "residual", *QUALITY_FIELDS)

SINKS = 4  # a sweep's attention sinks, StreamingLLM's


def split_spec(scorer: str, budget: int) -> Spec:
    """A scorer's spec at a token budget, the sweep's split: 4 sinks; a scorer that ranks by position alone
    (StreamingLLM) spends the rest on the recent window, the others give half the budget less the sinks to the
    window (at least one token) and the rest to heavy hitters (H2O's 10% + 10%)."""
    if get_policy(scorer).window_only:
        return Spec(sink=SINKS, recent=max(budget - SINKS, 1), scorer=scorer)
    recent = max(budget // 2 - SINKS, 1)
    return Spec(sink=SINKS, recent=recent, heavy=budget - recent - SINKS, scorer=scorer)


# every scorer by its name, and the window alone (no sinks) beside the position-only scorers
SWEEP_METHODS: dict[str, Callable[[int], Spec]] = {}
for _name in SCORERS:
    SWEEP_METHODS[_name] = partial(split_spec, _name)
    if get_policy(_name).window_only:
        SWEEP_METHODS["recent-only"] = partial(lambda s_, b: Spec(sink=0, recent=b, scorer=s_), _name)
# allocations over heads / layers around the one-shot scorers they suit (Policy.allocated_in_sweeps)
SWEEP_METHODS.update(
    {
        f"{al}-{name}": partial(lambda a_, s_, b: split_spec(s_, b).with_(allocation=a_), al, name)
        for al in ("adakv", "pyramid")
        for name in SCORERS
        if get_policy(name).allocated_in_sweeps
    }
)
# evicted values merged into the kept ones instead of dropped (kvviz.policies.merging), beside each plain scorer
SWEEP_METHODS.update(
    {
        f"merge-{name}": partial(lambda s_, b: split_spec(s_, b).with_(merge=True), name)
        for name in SCORERS
        if merges(name)
    }
)
# Whole-cache quantizers as a function of the prompt length n. KIVI as published: keys per
# channel, values per token, groups of 32, float offset, the last 128 tokens at full
# precision (kivi_residual: less on a prompt too short to quantize a group otherwise).
QUANT_METHODS: dict[str, Callable[[int], Spec]] = {
    "kivi-2bit": lambda n: Spec(
        key_bits=2, value_bits=2, key_axis="channel", value_axis="token", group_size=32, residual=kivi_residual(n)
    ),
    "kv-4bit": lambda n: Spec(key_bits=4, value_bits=4, key_axis="channel", value_axis="token", group_size=32),
    "kv-8bit": lambda n: Spec(key_bits=8, value_bits=8, key_axis="channel", value_axis="token", group_size=32),
    "2bit-per-token-keys": lambda n: Spec(
        key_bits=2, value_bits=2, key_axis="token", value_axis="token", group_size=32
    ),
}
# Serving formats (kvviz.quant.formats): FP8 with FP32 scales, block-scaled FP4, Hadamard rotation
# before quantizing, and transformers' QuantizedCache (per-token groups, residual flushed every 128).
QUANT_METHODS.update(
    {
        "fp16": lambda n: Spec(),  # the full cache: the baseline row
        "fp8-e4m3-tensor": lambda n: Spec(key_format="e4m3", value_format="e4m3", fp8_scale="tensor"),
        "fp8-e4m3-head": lambda n: Spec(key_format="e4m3", value_format="e4m3", fp8_scale="head"),
        "fp8-e4m3-token": lambda n: Spec(key_format="e4m3", value_format="e4m3", fp8_scale="token"),
        "fp8-e5m2-head": lambda n: Spec(key_format="e5m2", value_format="e5m2", fp8_scale="head"),
        "nvfp4": lambda n: Spec(key_format="nvfp4", value_format="nvfp4"),
        "mxfp4": lambda n: Spec(key_format="mxfp4", value_format="mxfp4"),
        "nvfp4-rotated": lambda n: Spec(key_format="nvfp4", value_format="nvfp4", rotate="keys"),
        "kivi-2bit-rotated": lambda n: QUANT_METHODS["kivi-2bit"](n).with_(rotate="keys"),
        "2bit-per-token-keys-rotated": lambda n: QUANT_METHODS["2bit-per-token-keys"](n).with_(rotate="keys"),
        "hf-qc-4bit": lambda n: hf_quantized_cache(4),
        "hf-qc-2bit": lambda n: hf_quantized_cache(2),
    }
)


def sweep_spec(name: str, budget: int, n: int) -> Spec:
    """SWEEP_METHODS[name] at a budget of `budget` of the `n` prompt tokens; a method that keeps its own count
    per head (a threshold, DuoAttention) gets its own setting for that budget (`Policy.fit_budget`)."""
    spec = SWEEP_METHODS[name](budget)
    return get_policy(spec.scorer).fit_budget(spec, budget, n)


def sweep(
    model, ref: Reference, methods: Sequence[str], budgets: Sequence[int], progress: Progress | None = None
) -> list[dict]:
    """Quality against memory ratio: every eviction method at every budget, plus quantizers."""
    jobs: list[tuple[str, int | str, Spec]] = []
    for name in methods:
        if name in SWEEP_METHODS:
            jobs += [(name, b, sweep_spec(name, b, ref.prompt_len)) for b in budgets]
        elif name in QUANT_METHODS:
            jobs.append((name, "", QUANT_METHODS[name](ref.prompt_len)))
        else:
            raise SpecError(f"unknown sweep method {name!r}; choose from {', '.join([*SWEEP_METHODS, *QUANT_METHODS])}")
    rows = []
    for j, (name, budget, spec) in enumerate(jobs):
        if progress is not None:
            progress(j / len(jobs), f"{name} {budget}")
        q = evaluate(model, ref, spec)
        d = q.as_dict()
        rows.append({"method": name, "budget": budget, **{k: d[k] for k in SWEEP_FIELDS[2:]}})
    return rows
