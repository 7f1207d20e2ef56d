"""The Trace file source: a trace file on the server (the app's capture cache, or a folder named by
$KVVIZ_TRACE_DIRS, opened in place, lazily) or an upload; and the capture cache's folder, which the Real model
source (kvviz.app.sources) writes to.

`trace_file_source(container)` renders its controls into `container` (the sidebar, usually) and returns the
Trace, or None when there is nothing to show yet.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import streamlit as st

from kvviz.sources.tracefile import load_trace, trace_from_bytes
from kvviz.sources.tracewriter import FORMAT
from kvviz.trace import Trace, TraceError

MAX_UPLOAD_MB = 500


def cache_dir() -> Path:
    """Where captured traces are kept: $KVVIZ_CACHE_DIR, else $XDG_CACHE_HOME/kvviz/traces."""
    env = os.environ.get("KVVIZ_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvviz" / "traces"


def read_header(path: Path) -> dict | None:
    """The kvviz header of a trace file (meta parsed), reading only the header; None if not a trace."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 * 1024**2:
                return None
            meta = json.loads(f.read(n).decode("utf-8")).get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            return None
        return {
            **meta,
            "meta": json.loads(meta.get("meta", "{}")),
            "n_tokens": len(json.loads(meta.get("tokens", "[]"))),
        }
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None


TRACE_DIRS_ENV = "KVVIZ_TRACE_DIRS"


def trace_dirs() -> list[Path]:
    """The server folders whose trace files the app offers: the capture cache, and the folders in
    $KVVIZ_TRACE_DIRS (separated by the path separator, ':' on Linux) - where big traces copied from a
    GPU machine go, so they open in place (lazily) instead of through an upload."""
    extra = [Path(p).expanduser() for p in os.environ.get(TRACE_DIRS_ENV, "").split(os.pathsep) if p.strip()]
    return [cache_dir(), *extra]


def saved_traces() -> list[tuple[Path, str]]:
    """(path, label) of the trace files in the server's trace folders, newest first."""
    files = []
    for folder in trace_dirs():
        try:
            files += [p for p in folder.glob("*.safetensors") if p.is_file()]
        except OSError:
            continue
    out = []
    for p in sorted(set(files), key=lambda p: p.stat().st_mtime, reverse=True):
        h = read_header(p)
        if h is None:
            continue
        m = h["meta"]
        prompt = " ".join(str(m.get("prompt", "")).split())
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.stat().st_mtime))
        label = (
            f"{m.get('model', m.get('source', 'trace'))} · {h['n_tokens']} tokens · "
            f"“{prompt[:40]}{'…' if len(prompt) > 40 else ''}” · {when}"
            + ("" if p.parent == cache_dir() else f" · {p.name}")
        )
        out.append((p, label))
    return out


@st.cache_resource(max_entries=8, show_spinner=False)
def _load_cached(path: str, mtime: float) -> Trace:
    return load_trace(path)


def _notes(container, trace: Trace) -> None:
    for note in trace.meta.get("notes", []):
        container.warning(note[0].upper() + note[1:] + ".")


def _describe(trace: Trace) -> str:
    m = trace.meta
    return (
        f"{m.get('model', 'model')}: {m.get('prompt_tokens', trace.context_len)} prompt tokens + "
        f"{m.get('new_tokens', 0)} generated, {trace.n_layers} layers × {trace.n_q_heads} heads "
        f"({trace.n_kv_heads} KV heads)"
    )


@st.cache_resource(max_entries=4, show_spinner=False)
def _parse_upload(digest: str, name: str, _data: bytes) -> Trace:
    return trace_from_bytes(_data, name=name)


def _unusable(c, name: str, e: Exception) -> None:
    c.error(
        f"**{name}** cannot be used: {e}. Pick another file, or capture it again with "
        "`kvviz capture --out FILE.safetensors`."
    )


def upload_limit_mb() -> int:
    """kvviz's limit, or Streamlit's server.maxUploadSize when that is lower (default 200 MB)."""
    try:
        return min(MAX_UPLOAD_MB, int(st.get_option("server.maxUploadSize")))
    except Exception:  # noqa: BLE001 - an unknown option must not break the page
        return MAX_UPLOAD_MB


def trace_file_source(container=None) -> Trace | None:
    """Upload a .safetensors trace, or pick one from the cache folder; the Trace (or None)."""
    c = container if container is not None else st.sidebar
    saved = saved_traces()
    how = c.radio(
        "Trace",
        ["upload", "saved"],
        key="tf_how",
        horizontal=True,
        index=1 if saved else 0,
        format_func={"upload": "Upload a file", "saved": f"On the server ({len(saved)})"}.get,
    )
    if how == "saved":
        if not saved:
            c.info(
                f"No trace files yet in {', '.join(str(d) for d in trace_dirs())}. Capture one with the "
                f"Real model source or `kvviz capture`, put big ones in a folder named by ${TRACE_DIRS_ENV} "
                "(they open in place, a layer at a time), or upload a small file."
            )
            return None
        labels = {str(p): label for p, label in saved}
        pick = c.selectbox("Saved capture", list(labels), key="tf_pick", format_func=labels.get)
        path = Path(pick)
        try:
            trace = _load_cached(str(path), path.stat().st_mtime)
        except (TraceError, OSError) as e:
            _unusable(c, path.name, e)
            return None
        c.caption(_describe(trace) if trace.meta.get("source") == "model" else trace.describe())
        return trace

    limit_mb = upload_limit_mb()
    up = c.file_uploader(
        f"Trace file (.safetensors, up to {limit_mb} MB)",
        type=["safetensors"],
        key="tf_upload",
        help="Written by `kvviz capture` or kvviz.sources.save_trace.",
    )
    if up is None:
        c.info("Upload a trace written by `kvviz capture` (e.g. captured on a GPU machine, see docs/big-models.md).")
        return None
    if up.size > limit_mb * 1024**2:
        c.error(
            f"**{up.name}** is {up.size / 1024**2:.0f} MB; the limit is {limit_mb} MB. "
            "Capture fewer layers (`kvviz capture --layers 0-7`) or a shorter prompt."
        )
        return None
    data = up.getvalue()
    try:
        trace = _parse_upload(hashlib.sha256(data).hexdigest(), up.name, data)
    except TraceError as e:
        _unusable(c, up.name, e)
        return None
    c.caption(_describe(trace) if trace.meta.get("source") == "model" else trace.describe())
    _notes(c, trace)
    return trace
