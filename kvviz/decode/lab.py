"""The Model lab's compute, without Streamlit: one run of a real model with a compressed cache.

A run (kvviz.decode.labsettings.LabSettings) is
    the full-cache side, once per text (it does not depend on the spec):
        one forward over prompt + continuation: the reference logits and every layer's
        q, k, v (kvviz.decode.loop.Prefill), then the full cache's greedy continuation
    the compressed side, per spec, starting from that prefill:
        teacher-forced quality (one masked pass for one-shot policies, the step loop for
        H2O / TOVA / the oracle) and the compressed greedy continuation, token by token
        (on_token streams it; a callback that raises stops the run).

Its result (kvviz.decode.labstore.LabResult) goes to JSON so the default settings' result can be precomputed
(`python -m kvviz.decode.lab --precompute`, run by `make venv`, or in the background on the
app's first start) and the page opens on it at once; labstore also keeps the times runs take, from which
the page says how long the next one will. torch is imported lazily.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvviz.decode.labsettings import LabSettings, default_settings, fit_to_text, one_pass
from kvviz.decode.labstore import LabResult, record_time, load_result, record_run, result_path, save_result
from kvviz.spec import Spec

Progress = Callable[[float, str], None]
_FULL: OrderedDict = OrderedDict()  # full-cache side per (model, ids, n, m, greedy)
_FULL_LOCK = threading.Lock()
_FULL_SIZE = 8


class Cancelled(Exception):
    """Raised by a progress / token callback to stop a run."""


# --- the run -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FullSide:
    """What the full cache does on one text: the reference and its greedy continuation."""

    ref: Any  # kvviz.decode.quality.Reference (with its Prefill)
    greedy_ids: tuple[int, ...]
    seconds: float


def run(
    model,
    tokenizer,
    label: str,
    settings: LabSettings,
    progress: Progress | None = None,
    on_full_token: Callable[[int, int], None] | None = None,
    on_token: Callable[[int, int], None] | None = None,
) -> LabResult:
    """One Model lab run (LabResult).

    One prefill of prompt + continuation (kept per text); then, in one batched decode
    loop (kvviz.decode.loop.decode_many), the full cache's greedy text (once per text), the
    compressed greedy text and, for H2O / TOVA / the oracle, the teacher-forced steps;
    one-shot policies score the continuation in one masked pass instead.
    on_full_token / on_token(i, id) stream the full and the compressed greedy text; any
    callback may raise (Cancelled) to stop the run, leaving the model as it was.
    """
    from kvviz.decode.quality import evaluate, quality_from, tokenize

    say = progress or (lambda f, m: None)
    t0 = time.perf_counter()
    ids = tokenize(tokenizer, settings.text)
    asked, settings = settings, fit_to_text(settings, len(ids))
    spec = settings.spec
    key = _full_key(model, ids, settings)
    with _FULL_LOCK:
        full = _FULL.get(key)
    ref = full.ref if full is not None else _reference(model, tokenizer, ids, settings, say)
    n = ref.prompt_len
    # every run starts at the compression point c; the question's q tokens (before-question) are fed first
    c = ref.compression_point(settings.question_point)
    q = n - c
    runs = _runs(ref, settings, full, c, on_full_token, on_token)
    t1 = time.perf_counter()
    got = _decode_runs(model, ref, runs, c, q, on_full_token, on_token, say)
    if full is None:
        full = FullSide(ref=ref, greedy_ids=_greedy_ids(got["full"], q) if "full" in got else (), seconds=0.0)
        with _FULL_LOCK:
            _FULL[key] = full
            while len(_FULL) > _FULL_SIZE:
                _FULL.popitem(last=False)
    pair = _side_by_side(tokenizer, ref, spec, full, got, q) if settings.greedy_tokens else None
    if "forced" in got:
        logits, _, cache = got["forced"]
        quality = quality_from(ref, spec, logits[q:], cache, t1, compressed_at=c)
    else:
        say(0.9, "teacher-forced quality in one masked pass")
        quality = evaluate(model, ref, spec, question_point=settings.question_point)
    say(1.0, "done")
    seconds = time.perf_counter() - t0
    record_run(settings, seconds)
    return LabResult(
        quality=quality,
        pair=pair,
        model=label,
        n_text_tokens=len(ref.ids),
        prompt_text="".join(ref.tokens[:n]),
        seconds=seconds,
        asked=None if asked is settings else asked,
    )


def _reference(model, tokenizer, ids, settings: LabSettings, say):
    """The full cache's side of a text: one forward pass over prompt + continuation."""
    from kvviz.decode.quality import reference

    say(0.0, "full cache: one forward pass over prompt + continuation")
    ref = reference(model, tokenizer, ids, settings.prompt_tokens, settings.continuation, settings.question)
    record_time("forward_token", ref.seconds / len(ref.ids))
    return ref


def _runs(ref, settings: LabSettings, full, c: int, on_full_token, on_token) -> list[tuple[str, Spec, int, Any]]:
    """The decode runs, (role, spec, steps, tokens fed): the full cache's greedy text (once per text), the
    compressed greedy text, and for a policy that cannot score the continuation in one pass its
    teacher-forced steps. The first greedy token (the prefill's) is streamed here."""
    import torch

    from kvviz.spec import Spec as _Spec

    n, m, g = ref.prompt_len, ref.n_continuation, settings.greedy_tokens
    q, question = n - c, list(ref.ids[c:n])
    first = int(torch.argmax(ref.prefill.logits[n - 1]))
    runs = []
    if g and full is None:
        runs.append(("full", _Spec(), q + g - 1, question))
        if on_full_token is not None:
            on_full_token(0, first)
    elif full is not None and on_full_token is not None:
        for i, t in enumerate(full.greedy_ids):
            on_full_token(i, t)
    if g:
        runs.append(("greedy", settings.spec, q + g - 1, question))
        if on_token is not None and q == 0:
            on_token(0, first)
    if not one_pass(settings.spec):
        runs.append(("forced", settings.spec, q + m - 1, list(ref.ids[c : n + m - 1])))
    return runs


def _decode_runs(model, ref, runs, c: int, q: int, on_full_token, on_token, say) -> dict:
    """The runs in one batched decode loop from the compression point c, streaming the greedy texts and the
    progress; role -> (logits, fed, cache)."""
    if not runs:
        return {}
    import torch

    from kvviz.decode.loop import decode_many

    total = max(r[2] for r in runs)
    t1 = time.perf_counter()

    def on_step(r: int, i: int, logits) -> None:
        role, j = runs[r][0], i + 1 - q  # j: the answer token these logits choose
        if role == "full" and on_full_token is not None and j >= 1:
            on_full_token(j, int(torch.argmax(logits)))
        elif role == "greedy" and on_token is not None and j >= 0:
            on_token(j, int(torch.argmax(logits)))
        if r == 0 and (i % 2 == 0 or i == total - 1):
            say(
                0.05 + 0.85 * (i + 1) / max(total, 1),
                f"decode step {i + 1}/{total} ({' + '.join(x[0] for x in runs if x[2] > i)})",
            )

    out = decode_many(
        model,
        ref.ids[:c],
        [r[1] for r in runs],
        [r[2] for r in runs],
        [r[3] for r in runs],
        prefix=ref.prefill,
        on_step=on_step,
        tokens=ref.tokens,
        repeat=ref.repeat,
    )
    if total:
        record_time("step", (time.perf_counter() - t1) / total)
    return {role: res for (role, *_), res in zip(runs, out)}


def _side_by_side(tokenizer, ref, spec: Spec, full, got: dict, q: int):
    """The full cache's and the compressed cache's greedy answers side by side, and where they part."""
    from kvviz.decode.quality import token_strings
    from kvviz.decode.sidebyside import SideBySide, first_divergence

    fids, comp = list(full.greedy_ids), list(_greedy_ids(got["greedy"], q))
    return SideBySide(
        spec=spec,
        prompt="".join(ref.tokens[: ref.prompt_len]),
        full_ids=tuple(fids),
        compressed_ids=tuple(comp),
        full_tokens=token_strings(tokenizer, fids),
        compressed_tokens=token_strings(tokenizer, comp),
        first_divergence=first_divergence(fids, comp),
    )


def _greedy_ids(result, fed_first: int = 0) -> tuple[int, ...]:
    """A greedy run's answer: what it chose after the `fed_first` tokens fed to it (a question)."""
    import torch

    logits, fed, _ = result
    return tuple(fed[fed_first:]) + (int(torch.argmax(logits[-1])),)


def _full_key(model, ids, settings: LabSettings) -> tuple:
    """The full-cache side depends on the text and the question, not on where a compressed run compresses."""
    return (
        id(model),
        tuple(ids),
        settings.prompt_tokens,
        settings.continuation,
        settings.greedy_tokens,
        settings.question,
    )


def full_cached(model, tokenizer, settings: LabSettings) -> bool:
    from kvviz.decode.quality import tokenize

    return _full_key(model, tokenize(tokenizer, settings.text), settings) in _FULL


# --- the default result, precomputed ---------------------------------------------------------------


def precompute(
    settings: LabSettings | None = None, progress: Progress | None = None, loader: Callable[..., tuple] | None = None
) -> Path | None:
    """Compute and store the result of `settings` (default: the page's opening settings)."""
    from kvviz.models import load_model

    settings = settings or default_settings()
    if load_result(settings) is not None:
        return result_path(settings)
    if loader is None:
        model, tokenizer, info = load_model(
            settings.model, device=settings.device, dtype=settings.dtype, progress=progress
        )
    else:
        model, tokenizer, info = loader(settings.model, progress=progress)
    label = getattr(info, "label", settings.model)
    return save_result(settings, run(model, tokenizer, label, settings, progress=progress))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m kvviz.decode.lab",
        description="Precompute the Model lab's default result (and the weights cache).",
    )
    p.add_argument("--precompute", action="store_true", help="compute and store the default settings' result")
    a = p.parse_args(argv)
    if not a.precompute:
        p.print_help()
        return 0
    from kvviz.models import ModelError

    try:
        path = precompute(progress=lambda f, m: sys.stderr.write(f"\r{100 * f:5.1f}% {m[:70]:<70}"))
    except ModelError as e:
        print(f"\nkvviz.decode.lab: skipped: {e}", file=sys.stderr)
        return 0
    print(f"\nModel lab default result: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
