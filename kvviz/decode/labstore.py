"""What Model lab runs leave behind: a run's result (LabResult), stored as JSON (never pickle) in the
results folder under a name made of its settings, the model file and the code, so that the default
settings' result can be precomputed and the page opens on it at once; and the times runs took, from which
`estimate` says how long the next one will take: the median of the last runs of the same size on this
server (`record_run`, in memory), else from the per-step times measured on this machine (timings.json
in the results folder).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvviz.decode.labsettings import LabSettings, one_pass
from kvviz.models.weights import read_timings, write_timing
from kvviz.spec import Spec

if TYPE_CHECKING:
    from kvviz.decode.quality import Quality
    from kvviz.decode.sidebyside import SideBySide

LAB_FORMAT = 1


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


# --- how long a run takes ----------------------------------------------------------------------


def _timings_path() -> Path:
    return lab_cache_dir() / "timings.json"


def _timings() -> dict:
    return read_timings(_timings_path())


def record_time(kind: str, seconds: float) -> None:
    """Remember a measured time (exponential average with the previous ones)."""
    write_timing(_timings_path(), kind, seconds, _running_mean)


def _running_mean(old, new: float) -> float:
    return new if not isinstance(old, (int, float)) else 0.5 * old + 0.5 * new


# run size -> the last few runs' seconds, in this process (this server)
_RUNS: OrderedDict = OrderedDict()
_RUNS_LOCK = threading.Lock()
RUNS_KEPT = 5  # per size: the median of the last five


def run_size(settings: LabSettings) -> tuple:
    """What a run's time depends on: prompt, continuation and greedy tokens, and whether the teacher-forced
    tokens go in one masked pass or step by step."""
    return (settings.prompt_tokens, settings.continuation, settings.greedy_tokens, one_pass(settings.spec))


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
    where = [] if (settings.device, settings.dtype) == ("cpu", "float32") else [settings.device, settings.dtype]
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
