"""Where the cells run: this process, a pool of processes, or Ray. Each reports every finished cell
at once (`on_result(cell, result)`), so the driver writes its part file before the next one ends.

local, workers = 1   this process, one cell after the other (nothing extra needed)
local, workers = N   a spawn-started process pool (concurrent.futures); each process loads a model
                     once for its own cells
ray                  a local Ray started on demand (`ray.init(num_cpus=N, include_dashboard=False)`)
                     or an existing cluster (`address="auto"`, `"ray://host:10001"`). Synthetic cells
                     are tasks (`max_retries`: a task whose worker died runs again); model and needle
                     cells go to actors that load their model once (`num_gpus` per actor from the
                     study's `gpus`, or 1 for device cuda / auto; `max_restarts` and
                     `max_task_retries` for a lost actor). Ray is imported here only, lazily.

A cell's own error (a bad model path, a text too short) is a result, not an exception: it is not
retried and does not stop the others. A lost worker loses only the cells in flight.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from kvviz.analysis.study.cells import ModelWorker, execute, job_for
from kvviz.analysis.study.schema import Cell, Study, StudyError

ENGINES = ("local", "ray")
RETRIES = 2
RAY_MISSING = (
    "the Ray engine needs Ray, an optional extra: pip install 'kvviz[ray]' (or `pip install ray`; "
    "`make dev` installs it), or run with --engine local"
)

OnResult = Callable[[Cell, dict], None]


def run(
    study: Study,
    cells: list[Cell],
    on_result: OnResult,
    engine: str = "local",
    workers: int = 1,
    address: str | None = None,
) -> None:
    """Run `cells` of `study` on an engine, reporting each finished cell through on_result."""
    if engine not in ENGINES:
        raise StudyError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if workers < 1:
        raise StudyError(f"--workers must be at least 1, got {workers}")
    if engine == "ray":
        run_ray(study, cells, on_result, workers, address)
    elif workers == 1:
        worker = ModelWorker()
        for cell in cells:
            on_result(cell, execute(job_for(study, cell), worker))
    else:
        run_pool(study, cells, on_result, workers)


def run_pool(study: Study, cells: list[Cell], on_result: OnResult, workers: int) -> None:
    """A process pool (spawn: no fork of a process that may hold torch or numba threads)."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    todo = list(cells)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {}
        while todo or pending:
            # a bounded window: memory stays flat
            while todo and len(pending) < 2 * workers:
                cell = todo.pop(0)
                pending[pool.submit(execute, job_for(study, cell))] = cell
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                cell = pending.pop(fut)
                try:
                    result = fut.result()
                except BrokenProcessPool as exc:
                    result = {"id": cell.id, "error": f"worker process died: {exc}", "seconds": 0.0}
                on_result(cell, result)


def start_ray(ray, workers: int, address: str | None = None) -> bool:
    """Connect to `address`, or start a local Ray with `workers` CPUs. True if we started it."""
    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise StudyError(f"cannot reach the Ray cluster at {address!r}: {str(exc).splitlines()[0]}") from None
        return True
    # workers import kvviz from where this driver does (an editable checkout is not on their path otherwise)
    root = str(Path(__file__).resolve().parents[3])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=workers,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    return True


def run_ray(study: Study, cells: list[Cell], on_result: OnResult, workers: int = 1, address: str | None = None) -> None:
    try:
        import ray
    except ImportError:
        raise StudyError(RAY_MISSING) from None
    started = start_ray(ray, workers, address)
    try:
        if study.kind == "synthetic":
            _ray_tasks(ray, study, cells, on_result, workers)
        else:
            _ray_actors(ray, study, cells, on_result, workers)
    finally:
        if started:
            ray.shutdown()


def _ray_error(cell: Cell, exc: BaseException) -> dict:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return {
        "id": cell.id,
        "error": f"lost on Ray after {RETRIES} retries: {type(exc).__name__}: {first[:300]}",
        "seconds": 0.0,
    }


def _ray_tasks(ray, study: Study, cells: list[Cell], on_result: OnResult, workers: int) -> None:
    task = ray.remote(num_cpus=1, max_retries=RETRIES)(execute)
    todo, pending = list(cells), {}
    window = 4 * max(workers, int(ray.cluster_resources().get("CPU", 1)))
    while todo or pending:
        while todo and len(pending) < window:
            cell = todo.pop(0)
            pending[task.remote(job_for(study, cell))] = cell
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            cell = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:
                result = _ray_error(cell, exc)
            on_result(cell, result)


def gpus_per_actor(source: dict) -> float:
    """GPUs each model actor asks Ray for: `gpus` in the study file, else 1 for device cuda / auto."""
    if source.get("gpus"):
        return float(source["gpus"])
    return 1.0 if source.get("device") in ("cuda", "auto") else 0.0


def _ray_actors(ray, study: Study, cells: list[Cell], on_result: OnResult, workers: int) -> None:
    """Per model: up to `workers` actors, each loading the model once; cells dealt to idle actors;
    a model's actors are released when its cells are done (so the next model's can start)."""
    actor_cls = ray.remote(
        num_cpus=1, num_gpus=gpus_per_actor(study.source), max_restarts=RETRIES, max_task_retries=RETRIES
    )(ModelWorker)
    by_model: dict[str, list[Cell]] = {}
    for cell in cells:
        by_model.setdefault(cell.settings["model"], []).append(cell)
    for model, queue in by_model.items():
        actors = [actor_cls.remote() for _ in range(min(workers, len(queue)))]
        idle, pending = list(actors), {}
        while queue or pending:
            while queue and idle:
                actor, cell = idle.pop(0), queue.pop(0)
                pending[actor.run.remote(job_for(study, cell))] = (cell, actor)
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                cell, actor = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    result = _ray_error(cell, exc)
                on_result(cell, result)
                idle.append(actor)
        for actor in actors:
            ray.kill(actor)
