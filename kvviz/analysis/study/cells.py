"""Running one cell: a synthetic cell through `kvviz.analysis.sweep`, a model cell through
`kvviz.decode` (eval_sweep's methods, quality against the full cache), a needle cell through
`kvviz.analysis.needle`.

A cell travels as a plain dict (a *job*: the kind, the fixed settings, the cell's own settings and,
for a model cell, the text itself, so a Ray worker on another machine needs no file of the driver's).
`execute(job)` never raises: it returns {"metrics": {...}} or {"error": "one line"}, so a bad model
path fails its own cells and nothing else. A `ModelWorker` loads each model once and keeps the last
text's full-cache reference, so the cells of one (model, text) share one prefill. torch lazily.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvviz.analysis.study.grid import FULL, model_spec, synthetic_tokens
from kvviz.analysis.study.schema import Cell, Study, setting_axes
from kvviz.spec import Spec, View


def job_for(study: Study, cell: Cell) -> dict:
    """What a worker needs to run `cell` (plain data)."""
    job = {"kind": study.kind, "id": cell.id, "source": dict(study.source), "settings": dict(cell.settings)}
    if study.kind == "model":
        from kvviz.analysis.study.grid import text_of

        job["text"] = text_of(study, cell.settings["text"])
    return job


def versions(kind: str, model_revision: str = "") -> dict:
    """kvviz and numpy versions; torch's and transformers' for the cells that run them (model and needle:
    the installed versions, read from package metadata; "" for a synthetic cell, which never uses
    them), so a row does not depend on what else its process had imported; the model's revision."""
    from importlib.metadata import PackageNotFoundError, version

    import numpy

    from kvviz.version import __version__

    def installed(name: str) -> str:
        try:
            return version(name) if kind != "synthetic" else ""
        except PackageNotFoundError:
            return ""

    return {
        "kvviz_version": __version__,
        "numpy_version": numpy.__version__,
        "torch_version": installed("torch"),
        "transformers_version": installed("transformers"),
        "model_revision": model_revision,
    }


# --- synthetic ----------------------------------------------------------------------------------

_TRACES: dict[tuple, Any] = {}


def _synthetic_trace(source: dict, seed: int):
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

    knobs = {k: v for k, v in source.items() if k not in ("kind", "seeds", "layer", "ensemble")}
    key = (tuple(sorted(knobs.items())), seed)
    if key not in _TRACES:
        if len(_TRACES) >= 4:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = make_synthetic(SyntheticSpec(**knobs, seed=seed))
    return _TRACES[key]


def run_synthetic(source: dict, settings: dict) -> dict:
    """One sweep point (kvviz.analysis.sweep) on the seeded synthetic trace; errors averaged over the
    ensemble (`[source] ensemble`: the query heads of `layer` by default)."""
    from kvviz.analysis.sweep import METRIC_COLUMNS, sweep

    trace = _synthetic_trace(source, settings["seed"])
    size = {"heads": source["q_heads"], "layers": source["layers"], "steps": max(1, min(source["steps"], 256))}
    view = View(layer=source["layer"], ensemble=source["ensemble"], ensemble_size=size[source["ensemble"]])
    fmt, bits = settings["format"], settings["bits"]
    # budget 1: the sweep's "full" point (any scorer: it keeps everything)
    scorer = settings["scorer"] if settings["scorer"] != FULL else Spec().scorer
    # the grid's Spec-setting axes
    base = Spec(**{k: v for k, v in settings.items() if k in setting_axes()})
    rows = sweep(
        trace,
        [scorer],
        [settings["budget"]],
        [bits] if fmt == "int" else [],
        view,
        base=base,
        formats=[fmt] if fmt != "int" else [],
    )
    (row,) = rows
    assert row["method"] == settings["scorer"] or row["method"] == FULL, (row["method"], settings)
    n = synthetic_tokens(source)
    assert row["budget"] == min(max(1, int(round(settings["budget"] * n))), n)
    # the sweep's memory and error columns (kvviz.analysis.sweep)
    recorded = ("memory_ratio", "compression_ratio", "memory_read_ratio", "saves", *METRIC_COLUMNS)
    return {**{k: row[k] for k in recorded}, "budget_tokens": row["budget"], "members": size[source["ensemble"]]}


# --- real models --------------------------------------------------------------------------------


def model_revision(name: str, model: Any) -> str:
    """What pins the weights: the bundled GGUF's sha256, a local file's, or the hub commit."""
    from kvviz.models import BUNDLED, BUNDLED_FILE, bundled_model_file, file_sha256

    if name == BUNDLED:
        gguf = bundled_model_file()
        return f"{BUNDLED_FILE} sha256:{file_sha256(gguf)[:16]}" if gguf else BUNDLED
    local = Path(name).expanduser()
    if local.is_file():
        return f"{local.name} sha256:{file_sha256(local)[:16]}"
    if (local / "config.json").is_file():
        return f"local folder, config.json sha256:{file_sha256(local / 'config.json')[:16]}"
    return str(getattr(model.config, "_commit_hash", None) or "unknown")


class ModelWorker:
    """Loads one model at a time (the last one asked for) and runs its cells; the Ray engine's actor.

    `device = "auto"` loads through accelerate with device_map="auto" (layers spread over every
    visible GPU, then the CPU) for models larger than one device; "cuda" puts the model on the
    GPU Ray assigned to this actor. (Neither GPU path can run on this CPU-only machine.)
    """

    def __init__(self) -> None:
        self.name: tuple | None = None
        self.model = self.tokenizer = None
        self.error: str | None = None
        self.revision = ""
        self.ref_key: tuple | None = None
        self.ref = None

    def _load(self, source: dict, name: str) -> None:
        key = (name, source["dtype"], source["device"])
        if self.name == key:
            return
        from kvviz.models import load_model

        # one torch thread per worker, as Ray gives each actor (OMP_NUM_THREADS=1 for num_cpus=1): on a
        # busy 2-core machine 2 threads per process ran this study's cells ~10x slower (docs/studies.md);
        # KVVIZ_TORCH_THREADS set by the user wins
        os.environ.setdefault("KVVIZ_TORCH_THREADS", "1")
        self.name, self.model, self.tokenizer, self.ref, self.ref_key, self.error = (key, None, None, None, None, None)
        try:
            auto = source["device"] == "auto"
            self.model, self.tokenizer, _ = load_model(
                name,
                device="cpu" if auto else source["device"],
                dtype=source["dtype"],
                device_map="auto" if auto else None,
            )
            self.revision = model_revision(name, self.model)
        except Exception as exc:  # noqa: BLE001 - the load error fails this model's cells, one line each
            self.error = one_line(exc)

    def run(self, job: dict) -> dict:
        return execute(job, self)

    def model_cell(self, job: dict) -> dict:
        from kvviz.decode.quality import QUALITY_FIELDS, evaluate, reference

        src, s = job["source"], job["settings"]
        self._load(src, s["model"])
        if self.error:
            raise RuntimeError(self.error)
        question = src.get("question", "")
        key = (s["text_sha256"], src["prompt_tokens"], src["continuation_tokens"], question)
        if self.ref_key != key:
            self.ref = reference(
                self.model,
                self.tokenizer,
                job["text"],
                src["prompt_tokens"],
                src["continuation_tokens"],
                question or None,
            )
            self.ref_key = key
        spec = model_spec(
            s["method"],
            s["budget"],
            s["bits"],
            src["prompt_tokens"],
            {k: v for k, v in s.items() if k in setting_axes()},
        )
        point = s.get("question_point", "before-question")
        d = evaluate(self.model, self.ref, spec, question_point=point).as_dict()
        d["scored_tokens"] = d["continuation_tokens"]
        d["budget_tokens"] = spec.sink + spec.recent + spec.heavy if spec.evicts else self.ref.prompt_len
        return {k: d[k] for k in ("budget_tokens", "spec", *QUALITY_FIELDS, "scored_tokens")}

    def needle_cell(self, job: dict) -> dict:
        from kvviz.analysis.needle import ANSWER_FIELDS, GridRequest, run_grid

        src, s = job["source"], job["settings"]
        self._load(src, s["model"])
        if self.error:
            raise RuntimeError(self.error)
        # as kvviz needle keys it
        model_id = s["model"] if src["dtype"] == "float32" else f"{s['model']} ({src['dtype']})"
        request = GridRequest(
            lengths=[s["length"]],
            depths=[s["depth"]],
            scorers=[s["scorer"]],
            budgets=[s["budget"]],
            bits=[s["bits"]],
            question_after_compression=(
                s["protocol"] == "query-agnostic" if "protocol" in s else src["question_after_compression"]
            ),
            compress_every=s.get("compress_every", 0),
            new_tokens=src["new_tokens"],
            seed=src["seed"],
            haystack=src["haystack"],
            task=s.get("task", "passkey"),
        )
        grid = run_grid(self.model, self.tokenizer, model_id, request)
        (c,) = grid.cells
        d = {**c.as_dict(), "ratio_reached": float(1.0 - c.kept().mean())}
        return {k: d[k] for k in ("budget_tokens", "spec", *ANSWER_FIELDS, "ratio_reached")}


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


_WORKER: ModelWorker | None = None  # this process's model (the local engine and its pool)


def execute(job: dict, worker: ModelWorker | None = None) -> dict:
    """Run one job: {"metrics", "versions", "seconds"} or {"error", "seconds"}; never raises."""
    global _WORKER
    t0 = time.perf_counter()
    try:
        if job["kind"] == "synthetic":
            metrics, revision = run_synthetic(job["source"], job["settings"]), ""
        else:
            if worker is None:
                _WORKER = worker = _WORKER or ModelWorker()
            metrics = worker.model_cell(job) if job["kind"] == "model" else worker.needle_cell(job)
            revision = worker.revision
        return {
            "id": job["id"],
            "metrics": metrics,
            "versions": versions(job["kind"], revision),
            "seconds": time.perf_counter() - t0,
            "pid": os.getpid(),
        }
    except Exception as exc:  # noqa: BLE001 - one cell's failure is reported, the rest go on
        return {"id": job["id"], "error": one_line(exc), "seconds": time.perf_counter() - t0, "pid": os.getpid()}
