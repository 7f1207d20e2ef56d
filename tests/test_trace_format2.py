"""Trace format 2 and captures to a file: the model's attention (sdpa) and dtype, bit-exact round trips
in bfloat16 and float16, lazy reads of one layer / head, version-1 files, damaged files, the model's own
layer numbers, and a failed capture that leaves the old file alone. A tiny random Llama built here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz import Spec, View, compare  # noqa: E402
from kvviz.cli import main  # noqa: E402
from kvviz.models import load_model  # noqa: E402
from kvviz.sources.capture import capture  # noqa: E402
from kvviz.sources.lazy import LayerStack  # noqa: E402
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic  # noqa: E402
from kvviz.sources.tracefile import load_trace, save_trace, trace_from_bytes  # noqa: E402
from kvviz.sources.traceheader import trace_info  # noqa: E402
from kvviz.sources.tracewriter import TraceWriter  # noqa: E402
from kvviz.trace import Trace, TraceError, trace_with  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEXT = (
    "The quick brown fox jumps over the lazy dog. A small cat sat on the warm mat by the "
    "window.\nBirds sing in the morning, and the old dog sleeps in the sun."
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 3-layer Llama (4 query heads, 2 KV heads, head_dim 16), byte-level BPE trained on the spot."""
    from tiny_llama_folder import save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny3")
    return save_tiny_llama(folder, TEXT, vocab_size=300, layers=3, seed=1)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir):
    return load_model(str(tiny_dir), dtype="bfloat16")


# --- item 1: the attention the model runs, in its dtype ------------------------------------------


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 0.1)])
def test_sdpa_capture_equals_eager_capture(tiny_dir, dtype, tol):
    model, tok, info = load_model(str(tiny_dir), dtype=dtype)
    sdpa = capture(model, tok, info, TEXT, new_tokens=3, stop_at_eos=False, attention="sdpa")
    eager = capture(model, tok, info, TEXT, new_tokens=3, stop_at_eos=False, attention="eager")
    assert sdpa.meta["attn_implementation"] == "sdpa" and eager.meta["attn_implementation"] == "eager"
    assert sdpa.meta["token_ids"] == eager.meta["token_ids"]
    # layer 0's q, k, v come before any attention: the same bits whatever attention runs
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(getattr(sdpa, name)[0], getattr(eager, name)[0])
    # later layers see the attention's output: equal to the dtype's precision (bf16: 8 bits of mantissa)
    scale = max(float(np.abs(eager.q[2]).max()), 1.0)
    for name in ("q", "k", "v"):
        diff = np.abs(getattr(sdpa, name) - getattr(eager, name)).max()
        assert diff <= tol * scale, (name, diff)
    assert model.config._attn_implementation == "eager"  # the model's own restored


def test_capture_to_file_streams_and_matches_memory_float32(tiny, tmp_path):
    model, tok, info = tiny
    mem = capture(model, tok, info, TEXT, new_tokens=4, stop_at_eos=False)
    path = tmp_path / "t.safetensors"
    lazy = capture(model, tok, info, TEXT, new_tokens=4, stop_at_eos=False, out=path)
    assert isinstance(lazy.q, LayerStack) and lazy.q.code == "F32"
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(np.asarray(getattr(lazy, name)), getattr(mem, name))
    assert lazy.tokens == mem.tokens and lazy.context_len == mem.context_len
    for key in (
        "attn_implementation",
        "dtype",
        "device",
        "prompt_sha256",
        "captured_at",
        "torch_version",
        "transformers_version",
        "kvviz_version",
        "layer_kinds",
        "revision",
        "path",
        "model",
    ):
        assert key in lazy.meta
    assert lazy.meta["layer_kinds"] == ["full_attention"] * 3 and lazy.meta["dtype"] == "float32"
    assert not list(tmp_path.glob(".*partial"))  # no temporary file left behind


def test_bfloat16_capture_stays_bfloat16_bit_exact(tiny_bf16, tmp_path):
    from safetensors import safe_open

    model, tok, info = tiny_bf16
    mem = capture(model, tok, info, TEXT, new_tokens=2, stop_at_eos=False)  # float32 = bf16 widened exactly
    path = tmp_path / "b.safetensors"
    lazy = capture(model, tok, info, TEXT, new_tokens=2, stop_at_eos=False, out=path)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_slice("q.2").get_dtype() == "BF16"
        head = f.get_slice("q.2")[1]  # one head of one layer, nothing else
        assert head.dtype == torch.bfloat16 and tuple(head.shape) == mem.q.shape[2:]
        assert torch.equal(head, torch.from_numpy(mem.q[2, 1]).to(torch.bfloat16))
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(np.asarray(getattr(lazy, name)), getattr(mem, name))
    f32 = capture(
        *load_model(str(tiny_bf16[2].path))[:2],
        tiny_bf16[2],
        TEXT,
        new_tokens=2,
        stop_at_eos=False,
        out=tmp_path / "f.safetensors",
    )
    assert f32.q.code == "F32"

    def data(p):  # tensor bytes (the header's reserved room is the same few kB for both)
        return sum(e["bytes"] for k, e in trace_info(p)["tensors"].items() if k != "query_positions")

    assert data(path) * 2 == data(tmp_path / "f.safetensors")


def test_float16_round_trip_is_bit_exact(tmp_path):
    t = make_synthetic(SyntheticSpec(context=48, steps=3, layers=3))
    h = trace_with(
        t, q=t.q.astype(np.float16), k=t.k.astype(np.float16), v=None if t.v is None else t.v.astype(np.float16)
    )
    back = load_trace(save_trace(h, tmp_path / "h.safetensors"))
    assert back.q.code == "F16"
    for name in ("q", "k", "v"):
        a = getattr(h, name)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(getattr(back, name)), a.astype(np.float32))


def test_a_failed_capture_leaves_the_old_file(tiny, tmp_path):
    model, tok, info = tiny
    path = tmp_path / "keep.safetensors"
    capture(model, tok, info, TEXT, out=path)
    before = path.read_bytes()

    def stop(fraction, message):
        if "layer 2/" in message:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        capture(model, tok, info, TEXT + " more", out=path, progress=stop)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]
    assert model.config._attn_implementation == "eager"


# --- item 2: lazy reads, version 1, damaged files -------------------------------------------------


def test_lazy_reads_touch_only_the_layer_shown(tiny, tmp_path):
    model, tok, info = tiny
    t = capture(model, tok, info, TEXT, new_tokens=2, stop_at_eos=False, out=tmp_path / "l.safetensors")
    spans = []
    inner = t.q.read

    def spy(offset, n):
        spans.append((offset, n))
        return inner(offset, n)

    for stack in (t.q, t.k, t.v):
        stack.read = spy
    c = compare(t, Spec(), View(layer=1, head=2))
    assert c.primary.layer == 1
    touched = {(s.what, layer) for s in (t.q, t.k, t.v) for layer, _ in s.reads}
    assert {layer for _, layer in touched} == {1}
    layer1 = [(s.starts[1], s.starts[1] + s.nbytes // s.shape[0]) for s in (t.q, t.k, t.v)]  # F32 file
    assert spans and all(any(a <= off < b for a, b in layer1) for off, _ in spans)
    # one head alone: one run of bytes, that head's
    t.q.reads.clear()
    row = t.q[2, 3]
    assert list(t.q.reads) == [(2, 3)] and row.shape == (t.n_positions, t.head_dim)


def test_version_1_files_still_open(tmp_path):
    from trace_util import save_trace_format_1

    t = make_synthetic(SyntheticSpec(context=40, steps=2))
    save_trace_format_1(t, tmp_path / "v1.safetensors")
    back = load_trace(tmp_path / "v1.safetensors")
    np.testing.assert_array_equal(back.q, t.q)
    assert trace_info(tmp_path / "v1.safetensors")["version"] == 1


def test_damaged_format2_files_say_what_is_wrong(tmp_path, capsys):
    t = make_synthetic(SyntheticSpec(context=40, steps=2, layers=2))
    good = save_trace(t, tmp_path / "g.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good[:-100])
    with pytest.raises(TraceError, match="truncated"):
        load_trace(cut)
    assert main(["trace", "info", str(cut)]) == 2
    assert "truncated" in capsys.readouterr().err
    with pytest.raises(TraceError, match="truncated"):
        trace_from_bytes(good[:-100], "cut.safetensors")
    # a NaN inside layer 1: found when layer 1 is read, one line from the CLI
    bad = t.q.copy()
    bad[1, 0, 5, 3] = np.nan
    nan = tmp_path / "nan.safetensors"
    save_trace(trace_with(t, q=np.nan_to_num(bad)), nan)
    raw = bytearray(nan.read_bytes())
    lazy = load_trace(nan)
    assert lazy.q.code == "F32"
    at = lazy.q.starts[1] + (5 * t.head_dim + 3) * 4  # layer 1, head 0, position 5, dim 3
    raw[at : at + 4] = np.float32(np.nan).tobytes()
    nan.write_bytes(bytes(raw))
    back = load_trace(nan)
    np.asarray(back.q[0])  # layer 0 is fine
    with pytest.raises(TraceError, match="NaN"):
        back.q[1]
    assert main(["compare", "--source", str(nan), "--layer", "1"]) == 2
    assert "NaN" in capsys.readouterr().err
    # a layer whose shape disagrees with the others
    w = TraceWriter(
        tmp_path / "shape.safetensors",
        {
            "q.0": ("F32", (1, 4, 8)),
            "q.1": ("F32", (1, 5, 8)),
            "k.0": ("F32", (1, 4, 8)),
            "k.1": ("F32", (1, 4, 8)),
            "query_positions": ("I64", (4,)),
        },
    )
    w.put("query_positions", np.arange(4))
    w.finish(
        {
            "format": "kvviz-trace",
            "version": "2",
            "context_len": "4",
            "tokens": json.dumps(["a"] * 4),
            "meta": "{}",
            "layers": "[0, 1]",
        }
    )
    with pytest.raises(TraceError, match="every layer's must be"):
        load_trace(tmp_path / "shape.safetensors")


# --- item 3: the model's own layer numbers ----------------------------------------------------


def test_layers_are_named_by_the_model(tiny, tmp_path, capsys):
    model, tok, info = tiny
    path = tmp_path / "two.safetensors"
    t = capture(model, tok, info, TEXT, layers="0,2", out=path)
    assert t.layer_numbers == (0, 2) and t.n_layers == 2
    with pytest.raises(TraceError, match="layers 0, 2"):
        t.layer_index(1)
    info_ = trace_info(path)
    assert info_["layers"] == [0, 2] and set(info_["tensors"]) == {"q", "k", "v", "query_positions"}
    assert main(["compare", "--source", str(path), "--layer", "2", "--head", "1"]) == 0
    out = capsys.readouterr().out
    assert "layer 2, head 1" in out
    assert main(["compare", "--source", str(path), "--layer", "1"]) == 2
    assert "layer 1 is not in this trace" in capsys.readouterr().err
    assert main(["trace", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "format 2" in out and "attn_implementation  sdpa" in out and "layers 0, 2 (2)" in out


def test_lazy_trace_saves_again(tiny, tmp_path):
    model, tok, info = tiny
    t = capture(model, tok, info, TEXT, layers="1-2", out=tmp_path / "a.safetensors")
    again = load_trace(save_trace(t, tmp_path / "b.safetensors"))
    assert again.layer_numbers == (1, 2)
    np.testing.assert_array_equal(np.asarray(again.k), np.asarray(t.k))
    assert isinstance(Trace, type)


def test_the_app_offers_trace_files_from_server_folders(tmp_path, monkeypatch):
    pytest.importorskip("streamlit")
    from kvviz.app.tracefiles import _load_cached, saved_traces

    cache, big = tmp_path / "cache", tmp_path / "big"
    cache.mkdir()
    big.mkdir()
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(cache))
    monkeypatch.setenv("KVVIZ_TRACE_DIRS", f"{big}{os.pathsep}{tmp_path / 'missing'}")
    t = make_synthetic(SyntheticSpec(context=32, steps=2, layers=2))
    save_trace(t, big / "from-the-gpu-box.safetensors")
    (big / "not-a-trace.safetensors").write_bytes(b"nothing")
    listed = saved_traces()
    assert [p.name for p, _ in listed] == ["from-the-gpu-box.safetensors"]
    assert listed[0][1].endswith("from-the-gpu-box.safetensors")  # a folder's file says its name
    opened = _load_cached(str(listed[0][0]), listed[0][0].stat().st_mtime)
    assert isinstance(opened.q, LayerStack) and opened.n_positions == t.n_positions


def test_writer_lays_out_again_when_the_header_outgrows_its_room_or_a_decode_stops_early(tmp_path):
    """Rows written at their offsets as they arrive (any order); finish() cuts T to the positions used
    (a decode that met end-of-sequence) and moves everything when the metadata outgrew its reserved room."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 10, 4)).astype(np.float32)  # (layers, heads, T, D)
    k = rng.standard_normal((2, 1, 10, 4)).astype(np.float32)
    tensors = {
        **{f"q.{n}": ("F32", (3, 10, 4)) for n in (4, 9)},
        **{f"k.{n}": ("F32", (1, 10, 4)) for n in (4, 9)},
        "query_positions": ("I64", (10,)),
    }
    for keep, reserve, note in ((10, 64 * 1024, "x"), (7, 16, "y" * 5000), (6, 64 * 1024, "z")):
        path = tmp_path / f"w{keep}.safetensors"
        with TraceWriter(path, tensors, reserve=reserve) as w:
            for start, n in ((5, 5), (0, 5)):  # a later block first: offsets, not order
                for i, layer in enumerate((4, 9)):
                    w.put(f"q.{layer}", q[i, :, start : start + n], start)
                    w.put(f"k.{layer}", k[i, :, start : start + n], start)
            w.put("query_positions", np.arange(10))
            meta = {"note": note}
            w.finish(
                {
                    "format": "kvviz-trace",
                    "version": "2",
                    "context_len": str(keep),
                    "tokens": json.dumps([f"t{i}" for i in range(keep)]),
                    "meta": json.dumps(meta),
                    "layers": "[4, 9]",
                },
                positions=keep,
            )
        t = load_trace(path)
        assert t.layer_numbers == (4, 9) and t.meta["note"] == note
        np.testing.assert_array_equal(np.asarray(t.q), q[:, :, :keep])
        np.testing.assert_array_equal(np.asarray(t.k), k[:, :, :keep])
        assert t.query_positions.tolist() == list(range(keep))  # cut with the rest
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# --- item 4 (recording only): each layer's kind and window ------------------------------------


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_layers_are_recorded_with_their_window(tiny_dir, tmp_path, arch):
    import transformers
    from transformers import AutoTokenizer

    from kvviz.models import model_info

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=8,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config_class, model_class, want = {
        "mistral": ("MistralConfig", "MistralForCausalLM", ["sliding_attention"] * 4),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", ["sliding_attention", "full_attention"] * 2),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", ["sliding_attention"] * 4),
    }[arch]
    cfg = getattr(transformers, config_class)(**common)
    if arch == "gemma3":
        cfg.layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
        want = list(cfg.layer_types)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).eval()
    info = model_info(arch, "tiny", model, "float32", "cpu")
    assert list(info.layer_kinds) == want
    before = model.config._attn_implementation
    t = capture(model, tok, info, TEXT, out=tmp_path / "w.safetensors")
    assert t.meta["layer_kinds"] == want
    # Gemma 2 has no sdpa (its logits are soft-capped): the capture runs the model's own attention instead
    assert t.meta["attn_implementation"] == ("eager" if arch == "gemma2" else "sdpa")
    assert model.config._attn_implementation == before  # the model's own, restored
    assert t.meta["layer_windows"] == [8 if k == "sliding_attention" else None for k in want]
    assert trace_info(tmp_path / "w.safetensors")["meta"]["layer_kinds"] == want
    # Gemma's query scale (query_pre_attn_scalar) is stored beside the raw q and applied as q is read:
    # the same numbers as the in-memory capture, which folds it into q
    mem = capture(model, tok, info, TEXT)
    assert (t.meta.get("query_scale", 1.0) != 1.0) == arch.startswith("gemma") == mem.meta["query_rescaled"]
    np.testing.assert_array_equal(np.asarray(t.q), mem.q)


def test_the_cli_budget_is_the_free_memory_during_a_capture_only(tiny_dir, tmp_path, monkeypatch):
    import psutil

    from kvviz import limits

    monkeypatch.delenv("KVVIZ_MAX_BYTES", raising=False)
    seen = []
    real = limits.set_max_bytes
    monkeypatch.setattr(limits, "set_max_bytes", lambda v: (seen.append(v), real(v)))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 7_000_000_000})())
    capture = ["capture", "--model", str(tiny_dir), "--prompt", TEXT]
    assert main([*capture, "--out", str(tmp_path / "c.safetensors"), "--quiet"]) == 0
    assert seen == [7_000_000_000, None] and limits.max_bytes() == limits.DEFAULT_MAX_BYTES
    monkeypatch.setenv("KVVIZ_MAX_BYTES", "2GB")  # the environment's word stands
    seen.clear()
    assert main([*capture, "--out", str(tmp_path / "d.safetensors"), "--quiet"]) == 0
    assert seen == []


def test_the_app_names_a_partial_captures_layers_by_the_models_numbers(tmp_path, monkeypatch):
    """A trace that holds the model's layers 3 and 15: the Explorer's Layer box offers 3 and 15, and the
    row the page describes is named by the model's number, not the position in the file."""
    import dataclasses

    from apptest_util import run_app

    folder = tmp_path / "traces"
    folder.mkdir()
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVVIZ_TRACE_DIRS", str(folder))
    t = make_synthetic(SyntheticSpec(context=32, steps=2, layers=2))
    save_trace(dataclasses.replace(t, meta={**t.meta, "layers": [3, 15]}), folder / "two-layers.safetensors")
    at = run_app(str(ROOT / "app.py"), source="file")
    at.radio(key="tf_how").set_value("saved").run()
    box = at.selectbox(key="layer")
    assert box.label == "Layer (the model's number)" and box.options == ["3", "15"]
    box.set_value(15).run()
    assert not at.exception
    text = " ".join(m.value for m in at.markdown) + " ".join(c.value for c in at.caption)
    assert "layer 15, query head" in text and "layer 1, query head" not in text
