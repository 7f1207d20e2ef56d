"""The decode loops: prefill once, compress at the end of the prompt, then step token by token.

`decode` runs one spec (teacher-forced or greedy), `decode_many` several specs in one batch
(each row on its own cache), `plain_decode` the model's own DynamicCache (the reference
path the tests compare against), `masked_reference_logits` transformers' eager attention
with a mask with holes. torch is imported lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvviz.decode.cache import Progress
from kvviz.decode.hook import compressed_cache
from kvviz.decode.place import placement
from kvviz.decode.ragged import cache_class  # allocations over heads / layers: ragged caches
from kvviz.decode.forward import _forward, new_cache
from kvviz.decode.reconstruct import prepare
from kvviz.limits import checkpoint
from kvviz.models.config import rope_inv_freq
from kvviz.spec import Spec, SpecError


@dataclass(frozen=True, eq=False)
class Prefill:
    """One full-cache forward pass over a text, kept so every later run can start from it.

    Attention is full and causal, so the first n positions' q, k, v are exactly what a
    prefill of the first n tokens alone gives: a compressed run (any spec) over a prompt
    of n <= len(ids) tokens starts from here instead of running the prompt again.
        logits  (N, vocab) float32   the full-cache logits at every position (on the model's device)
        k, v    (L, kv_heads, N, D)  post-RoPE, as a cache holds them (the model's device and dtype)
        q       (L, q_heads, N, D)   for the policies' Trace of the prompt: float32 numpy for a float32
                                     CPU model, else on the model's device in its dtype (never copied
                                     to the host: kvviz.decode.devtrace)
    """

    ids: tuple[int, ...]
    logits: Any
    k: Any
    v: Any
    q: Any
    seconds: float

    def covers(self, prompt_ids: Sequence[int]) -> bool:
        n = len(prompt_ids)
        return 0 < n <= len(self.ids) and tuple(int(i) for i in prompt_ids) == self.ids[:n]


def prefill(model, ids: Sequence[int]) -> Prefill:
    """The full-cache forward over ids, keeping every layer's q, k, v (see Prefill)."""
    import torch

    ids = [int(i) for i in ids]
    if not ids:
        raise SpecError("the prompt is empty")
    cache = new_cache(model, Spec(), len(ids))
    t0 = time.perf_counter()
    with torch.inference_mode(), compressed_cache(model, cache):
        logits = _forward(model, ids, 0)
    return Prefill(
        ids=tuple(ids), logits=logits, k=cache.k, v=cache.v, q=_stack(cache.prefill_q), seconds=time.perf_counter() - t0
    )


def _stack(layers: list):
    """Per-layer queries (Hq, N, D) as one (L, Hq, N, D) array: numpy, or a tensor where they live."""
    if isinstance(layers[0], np.ndarray):
        return np.stack(layers)
    import torch

    return torch.stack(layers)


def decode(
    model,
    prompt_ids: Sequence[int],
    spec: Spec,
    steps: int,
    feed: Sequence[int] | None = None,
    mode: str = "delete",
    tokens: Sequence[str] | None = None,
    record: bool = False,
    on_step: Callable[[int, Any], None] | None = None,
    progress: Progress | None = None,
    timings: dict | None = None,
    prefix: Prefill | None = None,
    block: bool = False,
    repeat=None,
):
    """Prefill the prompt, compress, then run `steps` decode steps.

    Step i feeds feed[i] (teacher forcing) or, when feed is None or shorter than i + 1 (a question fed,
    then the answer), the greedy choice of the previous logits. Returns (logits (steps + 1, vocab) float32
    tensor — row 0 from
    the prefill, row i+1 after feeding token i — the fed tokens, the cache). `timings`,
    if given, receives the seconds of the prefill (with the policy's scoring) and of the
    decode steps.

    `prefix`: a Prefill whose ids start with prompt_ids; the prompt is not run again.
    `repeat`: KVzip's reconstruction prompt (kvviz.decode.reconstruct.repeat_prompt), for a scorer that reads
    the model's pass over it. `block=True` with teacher forcing: when the spec allows it (CompressedCache.block_ok,
    one-shot policies and quantization), all steps run as one masked pass, equal to the
    step loop; otherwise the steps run one by one as usual.
    """
    import torch

    n = len(prompt_ids)
    if n < 1:
        raise SpecError("the prompt is empty")
    inv_freq = rope_inv_freq(model)  # RoPE: re-rotation, Expected Attention
    cache = new_cache(
        model, spec, n + steps, cache_class(spec), mode=mode, tokens=tokens, record=record, inv_freq=inv_freq
    )
    say = progress or (lambda f, m: None)
    if prefix is not None and not prefix.covers(prompt_ids):
        prefix = None
    prepare(cache, model, repeat, prompt_ids)  # KVzip's reconstruction pass, where the scorer reads one
    with torch.inference_mode(), compressed_cache(model, cache):
        say(0.0, f"prefill of {n} prompt tokens")
        t0 = time.perf_counter()
        if prefix is not None:
            cache.seed(prefix, n)
            last = prefix.logits[n - 1]
        else:
            last = _forward(model, prompt_ids, 0, last_only=True)[-1]
        cache.compress()
        t1 = time.perf_counter()
        teacher_forced = feed is not None and len(feed) >= steps > 1 and on_step is None
        if block and teacher_forced and cache.block_ok():
            cache.block = True
            say(0.0, f"{steps} teacher-forced steps in one masked pass")
            fed = [int(x) for x in feed[:steps]]
            rows = [last, *_forward(model, fed, n)]
        else:
            rows, fed = _step_loop(model, n, last, steps, feed, on_step, progress)
        if timings is not None:
            timings.update(prefill=t1 - t0, decode=time.perf_counter() - t1)
    return torch.stack(rows), fed, cache


def _step_loop(model, n: int, last, steps: int, feed, on_step, progress) -> tuple[list, list[int]]:
    """`steps` decode steps one by one after the prompt's n tokens: step i feeds feed[i], or the greedy choice
    of the previous logits. Returns (the logits rows, the prefill's `last` first; the tokens fed)."""
    import torch

    rows, fed = [last], []
    for i in range(steps):
        checkpoint()
        tok = int(feed[i]) if feed is not None and i < len(feed) else int(torch.argmax(last))
        last = _forward(model, [tok], n + i)[-1]
        rows.append(last)
        fed.append(tok)
        if on_step is not None:
            on_step(i, last)
        if progress is not None and (i % 4 == 0 or i == steps - 1):
            progress((i + 1) / max(steps, 1), f"decode step {i + 1}/{steps}")
    return rows, fed


def decode_many(
    model,
    prompt_ids: Sequence[int],
    specs: Sequence[Spec],
    steps: Sequence[int],
    feeds: Sequence[Sequence[int] | None],
    prefix: Prefill | None = None,
    on_step: Callable[[int, int, Any], None] | None = None,
    tokens: Sequence[str] | None = None,
    repeat=None,
):
    """Several decode runs of one prompt side by side, one batched forward a step.

    Run r has its own spec and cache, runs steps[r] steps and feeds feeds[r][i] (teacher
    forcing) or, when feeds[r] is None or has run out, its own greedy choice. Each batch row attends over
    its own cache only, so every run gives what decode() gives it alone (the weights are
    read once a step for all of them: on a CPU a batch of 2-3 costs about one step).
    on_step(r, i, logits) after run r's step i. Returns [(logits, fed, cache)] per run.
    """
    import torch

    n = len(prompt_ids)
    if n < 1:
        raise SpecError("the prompt is empty")
    if prefix is None or not prefix.covers(prompt_ids):
        prefix = prefill(model, prompt_ids)
    R = len(specs)
    device = placement(model)[0]
    # PyramidKV / AdaKV: their own
    caches = [
        new_cache(
            model,
            spec,
            n + st,
            cache_class(spec),
            tokens=tokens,
            inv_freq=rope_inv_freq(model) if spec.positions == "cache" else None,
        )
        for spec, st in zip(specs, steps)
    ]
    for c in caches:
        prepare(c, model, repeat, prompt_ids)
    rows = [[prefix.logits[n - 1]] for _ in range(R)]
    fed: list[list[int]] = [[] for _ in range(R)]
    active: list = []
    with torch.inference_mode(), compressed_cache(model, active):
        for c in caches:
            c.seed(prefix, n)
            c.compress()
        for i in range(max(steps, default=0)):
            checkpoint()
            live = [r for r in range(R) if steps[r] > i]
            toks = [
                int(feeds[r][i]) if feeds[r] is not None and i < len(feeds[r]) else int(torch.argmax(rows[r][-1]))
                for r in live
            ]
            active[:] = [caches[r] for r in live]
            x = torch.tensor([[t] for t in toks], dtype=torch.long, device=device)
            pos = torch.full((len(live), 1), n + i, dtype=torch.long, device=device)
            logits = model(input_ids=x, position_ids=pos, use_cache=False).logits[:, -1].float()
            for j, r in enumerate(live):
                rows[r].append(logits[j])
                fed[r].append(toks[j])
                if on_step is not None:
                    on_step(r, i, logits[j])
    return [(torch.stack(rows[r]), fed[r], caches[r]) for r in range(R)]


def plain_decode(
    model, prompt_ids: Sequence[int], steps: int, feed: Sequence[int] | None = None, timings: dict | None = None
):
    """The plain full-cache baseline: transformers' DynamicCache, one token a step.

    Returns (logits (steps + 1, vocab), fed tokens). Used by the benchmark and as an
    independent check of the compressed path with compression off.
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    rows, fed = [], []
    device = placement(model)[0]
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(
            input_ids=torch.tensor([list(prompt_ids)], device=device),
            past_key_values=cache,
            use_cache=True,
            # the prompt's last logits, as generate() asks
            logits_to_keep=1,
        )
        last = out.logits[0, -1].float()
        t1 = time.perf_counter()
        rows.append(last)
        for i in range(steps):
            tok = int(feed[i]) if feed is not None and i < len(feed) else int(torch.argmax(last))
            out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
            last = out.logits[0, -1].float()
            rows.append(last)
            fed.append(tok)
        if timings is not None:
            timings.update(prefill=t1 - t0, decode=time.perf_counter() - t1)
    return torch.stack(rows), fed


def masked_reference_logits(model, ids: Sequence[int], prompt_len: int, evicted: Callable[[int], Sequence[int]]):
    """transformers' own eager attention with a 2-D mask with holes and explicit position_ids.

    The full DynamicCache is kept; at decode position p the mask zeroes `evicted(p)`.
    Returns logits (len(ids) - prompt_len + 1, vocab): the same rows `decode` returns.
    The independent check that deleting cache entries equals masking them.
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    rows = []
    device = placement(model)[0]
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([list(ids[:prompt_len])], device=device),
            past_key_values=cache,
            use_cache=True,
            position_ids=torch.arange(prompt_len, device=device)[None],
        )
        rows.append(out.logits[0, -1].float())
        for p in range(prompt_len, len(ids)):
            mask = torch.ones(1, p + 1, dtype=torch.long)
            mask[0, list(evicted(p))] = 0
            out = model(
                input_ids=torch.tensor([[ids[p]]], device=device),
                past_key_values=cache,
                use_cache=True,
                attention_mask=mask.to(device),
                position_ids=torch.tensor([[p]], device=device),
            )
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)
