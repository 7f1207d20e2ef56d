"""The converted-weights cache: a GGUF file dequantized once, then read back as safetensors.

Dequantizing a GGUF file costs 10-40 s on a laptop CPU, in every new process. After the first conversion
the weights are saved as safetensors (no pickle) with the config and the tokenizer in
<weights_cache_dir()>/<sha256 of the GGUF file>-<dtype>/, and later loads read them back (well under a
second). meta.json records what the folder was built from and the sha256 of model.safetensors: a folder
whose record does not match the GGUF file, the dtype, this format or its own bytes is stale or corrupt; it
is deleted and rebuilt, never loaded. timings.json keeps how long loads took here, for the app's estimate.
torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

WEIGHTS_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
META_FILE = "meta.json"
TIMINGS_FILE = "timings.json"
_HASHES: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, per process


def weights_cache_dir() -> Path:
    """$KVVIZ_WEIGHTS_DIR, else $XDG_CACHE_HOME/kvviz/weights (~/.cache/kvviz/weights)."""
    env = os.environ.get("KVVIZ_WEIGHTS_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvviz" / "weights"


def weights_cache_enabled() -> bool:
    return os.environ.get("KVVIZ_WEIGHTS_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def file_sha256(path: Path) -> str:
    """sha256 of a file (remembered per process by path, size and mtime)."""

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def weights_cache_folder(gguf: Path, dtype: str) -> Path:
    """Where the converted weights of this GGUF file in this dtype live."""
    return weights_cache_dir() / f"{file_sha256(gguf)[:32]}-{dtype}"


def _meta_for(gguf: Path, dtype: str) -> dict:
    import torch
    import transformers

    return {
        "format": WEIGHTS_FORMAT,
        "gguf_sha256": file_sha256(gguf),
        "gguf_name": gguf.name,
        "dtype": dtype,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }


def cached_weights_valid(folder: Path, gguf: Path, dtype: str) -> bool:
    """True when `folder` holds a complete, uncorrupted conversion of `gguf` in `dtype`."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        weights = folder / WEIGHTS_FILE
        if not isinstance(meta, dict) or {k: meta.get(k) for k in _meta_for(gguf, dtype)} != _meta_for(gguf, dtype):
            return False
        if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
            return False
        if weights.stat().st_size != meta.get("weights_bytes"):
            return False
        _HASHES.pop((str(weights.resolve()), weights.stat().st_size, weights.stat().st_mtime_ns), None)
        return file_sha256(weights) == meta.get("weights_sha256")
    except (OSError, ValueError):
        return False


def save_weights_cache(model: Any, tokenizer: Any, gguf: Path, dtype: str) -> Path | None:
    """Write the converted model to its cache folder (atomically: a temp folder, then a rename).
    Returns the folder, or None when the cache cannot be written (read-only disk, ...)."""
    import tempfile

    from safetensors.torch import save_model

    folder = weights_cache_folder(gguf, dtype)
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        save_model(model, str(tmp / WEIGHTS_FILE))  # shared (tied) tensors stored once
        model.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)  # plain float weights now
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        weights = tmp / WEIGHTS_FILE
        meta = {
            **_meta_for(gguf, dtype),
            "weights_bytes": weights.stat().st_size,
            "weights_sha256": file_sha256(weights),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
        return folder
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return None


def read_timings(path: Path) -> dict:
    """A timings file's {kind: seconds}: {} where it is missing, unreadable or not a JSON object."""
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def write_timing(path: Path, kind: str, seconds: float, blend: Callable[[Any, float], float]) -> None:
    """Record a measured time in the timings file at `path` (its folder made if need be): the kind's entry
    becomes blend(its old value or None, seconds). A file that cannot be written stays as it was."""
    try:
        d = read_timings(path)
        d[kind] = blend(d.get(kind), float(seconds))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d))
    except OSError:
        pass


def _timings() -> dict:
    return read_timings(weights_cache_dir() / TIMINGS_FILE)


def _record_timing(kind: str, seconds: float) -> None:
    write_timing(weights_cache_dir() / TIMINGS_FILE, kind, seconds, lambda old, new: round(new, 3))
