"""The Model lab's compute, without Streamlit: one run of a real model with a compressed cache.

A run (LabSettings) is
    the full-cache side, once per text (it does not depend on the spec):
        one forward over prompt + continuation: the reference logits and every layer's
        q, k, v (kvviz.decode.loop.Prefill), then the full cache's greedy continuation
    the compressed side, per spec, starting from that prefill:
        teacher-forced quality (one masked pass for one-shot policies, the step loop for
        H2O / TOVA / the oracle) and the compressed greedy continuation, token by token
        (on_token streams it; a callback that raises stops the run).

Results go to JSON (never pickle) so the default settings' result can be precomputed
(`python -m kvviz.decode.lab --precompute`, run by `make venv`, or in the background on the
app's first start) and the page opens on it at once. `estimate` says how long a run will
take: the median of the last runs of the same size on this server (`record_run`), else from the per-step
times measured on this machine. torch is imported lazily.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvviz.spec import Spec

if TYPE_CHECKING:
    from kvviz.decode.quality import Quality
    from kvviz.decode.sidebyside import SideBySide

Progress = Callable[[float, str], None]
LAB_FORMAT = 1
DEFAULT_MODEL = "bundled"
DEFAULT_PROMPT, DEFAULT_CONTINUATION, DEFAULT_GREEDY = 206, 57, 32
_FULL: OrderedDict = OrderedDict()  # full-cache side per (model, ids, n, m, greedy)
_FULL_LOCK = threading.Lock()
_FULL_SIZE = 8


class Cancelled(Exception):
    """Raised by a progress / token callback to stop a run."""


@dataclass(frozen=True)
class LabSettings:
    model: str
    text: str
    prompt_tokens: int
    continuation: int
    greedy_tokens: int
    spec: Spec
    device: str = "cpu"  # where the model and its compressed cache run (cpu, cuda:N, mps)
    # the weights' dtype, which the cache keeps (float32, bfloat16, float16)
    dtype: str = "float32"
    # a question after the prompt's first prompt_tokens tokens (kvviz.decode.quality.reference); "" = none
    question: str = ""
    # where the cache is compressed when there is a question: before it (query-agnostic, kvpress's pipeline
    # default) or after it (query-aware); kvviz.decode.quality.QUESTION_POINTS
    question_point: str = "before-question"

    def key(self) -> tuple:
        return (
            self.model,
            self.text,
            self.prompt_tokens,
            self.continuation,
            self.greedy_tokens,
            tuple(sorted(self.spec.__dict__.items())),
            self.device,
            self.dtype,
            self.question,
            self.question_point if self.question else "",
        )


def default_settings(spec: Spec | None = None) -> LabSettings:
    """The page's opening settings: the sample text, 206 + 57 tokens, 32 greedy, the sidebar's default spec
    (what a link without settings describes, kvviz.links: the app's defaults, not Spec()'s)."""
    from kvviz import links
    from kvviz.decode.quality import sample_text

    spec = spec or links.spec_from_values(links.defaults())
    return LabSettings(
        DEFAULT_MODEL, sample_text(), DEFAULT_PROMPT, DEFAULT_CONTINUATION, DEFAULT_GREEDY, spec
    )


def fit_to_text(settings: LabSettings, n_ids: int) -> LabSettings:
    """The settings a text of n_ids tokens can run. Unchanged where the text is longer than the prompt;
    otherwise the prompt is shortened so that the asked continuation, at most half the text, is left to
    score (a 177-token story against the page's 206-token default prompt: 120 + 57). A text of fewer than
    two tokens cannot be split and is left to the run's own error."""
    if n_ids > settings.prompt_tokens or n_ids < 2:
        return settings
    continuation = max(1, min(settings.continuation, n_ids // 2))
    return dataclasses.replace(
        settings, prompt_tokens=n_ids - continuation, continuation=continuation
    )


# --- the run -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LabResult:
    """One Model lab run: the teacher-forced quality, the greedy texts side by side, and what they ran on."""

    quality: Quality  # kvviz.decode.quality.Quality
    pair: SideBySide | None  # the greedy continuations (None when no greedy tokens were asked for)
    model: str  # the model's label
    n_text_tokens: int  # tokens of prompt (question included) + continuation
    prompt_text: str  # the prompt as its tokens read
    seconds: float
    precomputed: bool = False  # read back from disk (load_result), not run in this process
    # the settings asked for, where the text was too short for them and the run used fit_to_text's instead
    asked: LabSettings | None = None


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
        full = FullSide(
            ref=ref, greedy_ids=_greedy_ids(got["full"], q) if "full" in got else (), seconds=0.0
        )
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
    ref = reference(
        model, tokenizer, ids, settings.prompt_tokens, settings.continuation, settings.question
    )
    _record("forward_token", ref.seconds / len(ref.ids))
    return ref


def _runs(
    ref, settings: LabSettings, full, c: int, on_full_token, on_token
) -> list[tuple[str, Spec, int, Any]]:
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
        _record("step", (time.perf_counter() - t1) / total)
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


def one_pass(spec: Spec) -> bool:
    """Does teacher forcing under this spec run as one masked pass (see CompressedCache.block_ok)?"""
    from kvviz.policies import get_policy

    policy = get_policy(spec.scorer)
    return not (spec.evicts and (policy.streaming or policy.needs_query or spec.compress_every))


# --- how long a run takes ----------------------------------------------------------------------


def _timings_path() -> Path:
    return lab_cache_dir() / "timings.json"


def _timings() -> dict:
    try:
        d = json.loads(_timings_path().read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _record(kind: str, seconds: float) -> None:
    """Remember a measured time (exponential average with the previous ones)."""
    try:
        d = _timings()
        old = d.get(kind)
        d[kind] = (
            float(seconds)
            if not isinstance(old, (int, float))
            else 0.5 * old + 0.5 * float(seconds)
        )
        lab_cache_dir().mkdir(parents=True, exist_ok=True)
        _timings_path().write_text(json.dumps(d))
    except OSError:
        pass


# run size -> the last few runs' seconds, in this process (this server)
_RUNS: OrderedDict = OrderedDict()
_RUNS_LOCK = threading.Lock()
RUNS_KEPT = 5  # per size: the median of the last five


def run_size(settings: LabSettings) -> tuple:
    """What a run's time depends on: prompt, continuation and greedy tokens, and whether the teacher-forced
    tokens go in one masked pass or step by step."""
    return (
        settings.prompt_tokens,
        settings.continuation,
        settings.greedy_tokens,
        one_pass(settings.spec),
    )


def record_run(settings: LabSettings, seconds: float) -> None:
    """Remember how long a finished run of this size took (kept in memory for this server process)."""
    size = run_size(settings)
    with _RUNS_LOCK:
        last = _RUNS.pop(size, [])
        _RUNS[size] = (last + [float(seconds)])[-RUNS_KEPT:]
        while len(_RUNS) > 64:
            _RUNS.popitem(last=False)


def recent_runs(settings: LabSettings) -> tuple[float | None, int]:
    """(median seconds, how many runs) of the last runs of this size on this server; (None, 0) before any."""
    with _RUNS_LOCK:
        last = list(_RUNS.get(run_size(settings), ()))
    return (float(np.median(last)), len(last)) if last else (None, 0)


def estimate(settings: LabSettings, full_cached: bool = False) -> float | None:
    """Expected seconds of a run from the times measured here before (None before any run): the median
    of the last runs of the same size on this server, else the per-step times measured on this machine."""
    median, _ = recent_runs(settings)
    if median is not None:
        return median
    return step_estimate(settings, full_cached)


def step_estimate(settings: LabSettings, full_cached: bool = False) -> float | None:
    """Expected seconds of a run from the per-token and per-step times measured here (None before any run)."""
    d = _timings()
    step, tok = d.get("step"), d.get("forward_token")
    if step is None or tok is None:
        return None
    n, m, g = settings.prompt_tokens, settings.continuation, settings.greedy_tokens
    # one batched decode loop as long as its longest run, plus the prefill and the masked pass
    seconds = 0.0 if full_cached else tok * (n + m)
    seconds += step * max(g - 1, 0 if one_pass(settings.spec) else m - 1, 0)
    if one_pass(settings.spec):
        seconds += tok * 1.5 * m
    return seconds


def full_cached(model, tokenizer, settings: LabSettings) -> bool:
    from kvviz.decode.quality import tokenize

    return _full_key(model, tokenize(tokenizer, settings.text), settings) in _FULL


# --- results on disk (JSON, no pickle) ---------------------------------------------------------


def lab_cache_dir() -> Path:
    """$KVVIZ_LAB_DIR, else $XDG_CACHE_HOME/kvviz/lab."""
    env = os.environ.get("KVVIZ_LAB_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvviz" / "lab"


def result_path(settings: LabSettings) -> Path:
    """Where the result of these settings is stored: keyed by the settings, the model file and the code."""
    from kvviz.version import __version__
    from kvviz.models import BUNDLED, bundled_model_file, file_sha256

    model_id = settings.model
    if settings.model == BUNDLED and bundled_model_file() is not None:
        model_id = file_sha256(bundled_model_file())
    where = (
        []
        if (settings.device, settings.dtype) == ("cpu", "float32")
        else [settings.device, settings.dtype]
    )
    blob = json.dumps(
        [
            LAB_FORMAT,
            __version__,
            model_id,
            settings.text,
            settings.prompt_tokens,
            settings.continuation,
            settings.greedy_tokens,
            settings.spec.as_dict(),
            *where,
            *([settings.question, settings.question_point] if settings.question else []),
        ],
        sort_keys=True,
    )
    return lab_cache_dir() / f"result-{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"


def result_to_json(result: LabResult) -> dict:
    q, pair = result.quality, result.pair
    qd = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
    qd["spec"] = q.spec.as_dict()
    qd["tokens"] = list(q.tokens)
    for k in ("nll", "nll_full", "kl"):
        qd[k] = [float(x) for x in qd[k]]
    for k in ("top1", "top1_full"):
        qd[k] = [int(x) for x in qd[k]]
    pd = None
    if pair is not None:
        pd = {f.name: getattr(pair, f.name) for f in dataclasses.fields(pair)}
        pd["spec"] = pair.spec.as_dict()
        for k in ("full_ids", "compressed_ids", "full_tokens", "compressed_tokens"):
            pd[k] = list(pd[k])
    return {
        "format": LAB_FORMAT,
        "quality": qd,
        "pair": pd,
        **{k: getattr(result, k) for k in ("model", "n_text_tokens", "prompt_text", "seconds")},
    }


def result_from_json(d: dict) -> LabResult:
    from kvviz.decode.quality import Quality
    from kvviz.decode.sidebyside import SideBySide

    q = dict(d["quality"])
    q["spec"] = Spec(**q["spec"])
    q["tokens"] = tuple(q["tokens"])
    for k in ("nll", "nll_full", "kl"):
        q[k] = np.asarray(q[k], dtype=np.float64)
    for k in ("top1", "top1_full"):
        q[k] = np.asarray(q[k], dtype=np.int64)
    pair = None
    if d.get("pair") is not None:
        p = dict(d["pair"])
        p["spec"] = Spec(**p["spec"])
        for k in ("full_ids", "compressed_ids", "full_tokens", "compressed_tokens"):
            p[k] = tuple(p[k])
        pair = SideBySide(**p)
    return LabResult(
        quality=Quality(**q),
        pair=pair,
        model=d["model"],
        n_text_tokens=d["n_text_tokens"],
        prompt_text=d["prompt_text"],
        seconds=d["seconds"],
        precomputed=True,
    )


def save_result(settings: LabSettings, result: LabResult) -> Path | None:
    path = result_path(settings)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result_to_json(result)))
        tmp.replace(path)
        return path
    except OSError:
        return None


def load_result(settings: LabSettings) -> LabResult | None:
    """The stored result of these settings, or None (missing, unreadable, another format)."""
    try:
        d = json.loads(result_path(settings).read_text())
        if not isinstance(d, dict) or d.get("format") != LAB_FORMAT:
            return None
        return result_from_json(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def precompute(
    settings: LabSettings | None = None,
    progress: Progress | None = None,
    loader: Callable[..., tuple] | None = None,
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
    p.add_argument(
        "--precompute", action="store_true", help="compute and store the default settings' result"
    )
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
