"""The needle test's cache on disk: where it lives, the keys of a prompt and of a cell (sha256 of
everything that changes its tokens or its numbers), and JSON records read and written atomically. A
rerun of a grid reads its prompts and cells from here (kvviz.analysis.needle.grid)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvviz.analysis.needle.prompt import FILLER, FORMAT_VERSION, INSTRUCTION, NeedlePrompt
from kvviz.analysis.needle.tasks import NEEDLE_TEMPLATE, PRIMER, QUESTION, TASKS
from kvviz.settings import SETTINGS
from kvviz.spec import Spec


def cache_dir() -> Path:
    """$KVVIZ_CACHE_DIR/needle, else $XDG_CACHE_HOME/kvviz/needle (next to the app's trace cache)."""
    env = os.environ.get("KVVIZ_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "needle"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvviz" / "needle"


def cell_key(model_id: str, prompt: NeedlePrompt, spec: Spec, question_after_compression: bool, new_tokens: int) -> str:
    """sha256 of everything that changes a cell's numbers."""
    from kvviz.version import __version__

    blob = json.dumps(
        {
            "model": model_id,
            "ids": list(prompt.ids),
            "needle": [prompt.needle_start, prompt.needle_end],
            "question_start": prompt.question_start,
            "key": prompt.key,
            # the settings away from their defaults: a setting added later leaves every older key as it was
            "spec": {k: v for k, v in spec.__dict__.items() if v != SETTINGS[k].default},
            "question_after_compression": question_after_compression,
            "new_tokens": new_tokens,
            "format": FORMAT_VERSION,
            "kvviz": __version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write(path: Path, d: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        # a read-only cache folder: results are still returned
        pass


def prompt_key(model_id: str, length: int, depth: float, seed: int, haystack: str, task: str = "passkey") -> str:
    """sha256 of what decides a prompt's tokens (the model's tokenizer by its name, the task, and the texts)."""
    from kvviz.version import __version__

    shown = {} if task == "passkey" else {"task": task, "instance": TASKS[task].instance(seed, length, depth).__dict__}
    blob = json.dumps(
        {
            **shown,
            "model": model_id,
            "length": length,
            "depth": depth,
            "seed": seed,
            "haystack": haystack,
            "texts": [NEEDLE_TEMPLATE, QUESTION, PRIMER, INSTRUCTION, FILLER],
            "format": FORMAT_VERSION,
            "kvviz": __version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
