"""Trace files: safetensors round trip, validation, clear errors, no pickle."""

import json

import numpy as np
import pytest

from kvviz import TraceError
from kvviz.sources import handbook_trace, load_trace, save_trace
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.sources.tracefile import trace_from_bytes

from trace_util import save_format_1


def test_round_trip(tmp_path):
    for t in (handbook_trace(), make_synthetic(SyntheticSpec(context=64, steps=4))):
        path = save_trace(t, tmp_path / "t.safetensors")
        u = load_trace(path)
        for name in ("q", "k", "v", "logits", "noise_eps", "query_positions"):
            a, b = getattr(t, name), getattr(u, name)
            assert (a is None and b is None) or np.array_equal(a, b)
        assert u.tokens == t.tokens and u.context_len == t.context_len and u.meta == json.loads(json.dumps(t.meta))


def test_rejects_garbage(tmp_path):
    p = tmp_path / "bad.safetensors"
    for data in (b"", b"hello world, not a trace", b"\xff" * 64):
        p.write_bytes(data)
        with pytest.raises(TraceError):
            load_trace(p)
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.safetensors")


def test_rejects_plain_safetensors_and_bad_shapes(tmp_path):
    from safetensors.numpy import save_file

    p = tmp_path / "plain.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(p))
    with pytest.raises(TraceError, match="not a kvviz trace"):
        load_trace(p)
    zeros = np.zeros((1, 1, 4, 8), np.float32)
    for q, k, version, match in (
        (zeros, np.zeros((1, 1, 5, 8), np.float32), "1", "token labels"),  # 5 positions, 4 tokens
        (np.full((1, 1, 4, 8), np.nan, np.float32), zeros, "1", "NaN"),
        (zeros, zeros, "99", "version 99"),
    ):
        arrays = {"q": q, "k": k, "query_positions": np.arange(4)}
        save_format_1(p, arrays, context_len=4, tokens=["a"] * 4, meta={}, version=version)
        with pytest.raises(TraceError, match=match):
            load_trace(p)


def test_upload_bytes(tmp_path):
    path = save_trace(handbook_trace(), tmp_path / "h.safetensors")
    t = trace_from_bytes(path.read_bytes(), "h.safetensors")
    assert t.n_positions == 64
    with pytest.raises(TraceError):
        trace_from_bytes(path.read_bytes()[:100], "cut.safetensors")
