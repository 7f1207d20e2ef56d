"""Real-model capture: a tiny random Llama built here (fast, full loading path) and the
bundled SmolLM2-135M (marked `model`, loaded once per module).

What is asserted: the captured q/k/v are what the model's attention used (kvviz's
recomputed attention equals output_attentions, k/v equal the cache, greedy decode equals
generate()), the trace survives save -> load, the CLI writes a trace `compare` can read,
and every user error ends in one clear message.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvviz import Spec, View, compare  # noqa: E402
from kvviz.attention import logit_row, softmax  # noqa: E402
from kvviz.models import ModelError, bundled_model_file, load_model  # noqa: E402
from kvviz.sources.capture import (  # noqa: E402
    CaptureError,
    capture,
    check_attention,
    concentration,  # noqa: E402
    head_overview,
    visible,
)
from kvviz.sources.request import parse_layers  # noqa: E402
from kvviz.sources.tracefile import load_trace, save_trace  # noqa: E402
from kvviz.trace import Trace, TraceError  # noqa: E402

from cli_util import run_cli  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_TEXT = (
    "The quick brown fox jumps over the lazy dog. A small cat sat on the warm mat by the "
    "window.\nBirds sing in the morning, and the old dog sleeps in the sun."
)

# ~190 tokens of plain English for the bundled model (written for this test).
ENGLISH = (
    "Every autumn the old lighthouse keeper on the northern island wrote a long letter to his "
    "sister in the city. He described the storms that rolled in from the sea, the seabirds that "
    "nested in the cliffs below the tower, and the ships that passed at night with their lights "
    "blinking like distant stars. The letters took weeks to arrive, because the supply boat came "
    "only twice a month, and sometimes the weather kept it in the harbour for days. His sister "
    "kept every letter in a wooden box under her bed. When she finally visited the island many "
    "years later, she found that the keeper had kept copies of all of them, bound with string and "
    "stored on a shelf next to the great lamp. Reading them again, side by side, they realised "
    "that the letters told the story of the island better than any history book could, because "
    "they were written by someone who had watched it change slowly, season after season, for "
    "most of his life."
)


# --- the tiny random Llama ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer Llama (4 query heads, 2 KV heads, head_dim 16) with a byte-level BPE
    tokenizer trained on the spot, saved like any hub model folder."""
    from tiny_llama_folder import save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny_llama(folder, TINY_TEXT, vocab_size=320, layers=2, seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def tiny_trace(tiny):
    model, tok, info = tiny
    return capture(model, tok, info, TINY_TEXT, new_tokens=6, stop_at_eos=False)


def test_tiny_trace_shapes_tokens_and_meta(tiny, tiny_trace):
    model, tok, info = tiny
    t = tiny_trace
    ids = tok(TINY_TEXT)["input_ids"]
    P, T = len(ids), len(ids) + 6
    assert (info.n_layers, info.n_q_heads, info.n_kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert t.q.shape == (2, 4, T, 16) and t.k.shape == (2, 2, T, 16) and t.v.shape == (2, 2, T, 16)
    assert t.q.dtype == np.float32 and t.context_len == P
    assert t.query_positions.tolist() == list(range(T)) and len(t.later_queries) == 6
    assert t.meta["token_ids"][:P] == ids and len(t.meta["token_ids"]) == T
    # every token's label is the text it adds, whitespace made visible
    assert "".join(t.tokens) == visible(tok.decode(t.meta["token_ids"]))
    assert "▁" in "".join(t.tokens[:P]) and "↵" in "".join(t.tokens[:P])
    m = t.meta
    assert m["source"] == "model" and m["prompt"] == TINY_TEXT and m["new_tokens"] == 6
    assert m["truncated"] is False and m["layers"] == [0, 1] and m["config"]["num_key_value_heads"] == 2
    assert m["kvviz_version"] and m["architecture"] == "LlamaForCausalLM"


def test_tiny_recomputed_attention_matches_the_model(tiny, tiny_trace):
    model, _, _ = tiny
    err = check_attention(model, tiny_trace)
    assert err.shape == (2, 4) and err.max() <= 1e-4
    # independently, one decode row through logit_row and through the engine
    ids = torch.tensor([tiny_trace.meta["token_ids"]])
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions
    qi = tiny_trace.n_queries - 2
    for layer, head in ((0, 3), (1, 1)):
        theirs = att[layer][0, head, qi, : qi + 1].numpy()
        assert theirs.max() > 5 / len(theirs)  # far from uniform: a mismatch would show
        ours = softmax(logit_row(tiny_trace, layer, head, qi))
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
        step = int(np.flatnonzero(tiny_trace.evaluated_queries == qi)[0])
        c = compare(tiny_trace, Spec(), View(layer=layer, head=head, step=step))
        np.testing.assert_allclose(c.primary.original, theirs, atol=1e-5)


def test_tiny_keys_values_are_the_cache_and_decode_is_greedy(tiny, tiny_trace):
    model, _, _ = tiny
    ids = tiny_trace.meta["token_ids"]
    P = tiny_trace.context_len
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        gen = model.generate(
            torch.tensor([ids[:P]]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1
        )
    assert gen[0].tolist() == ids  # our decode loop == generate()
    cache = out.past_key_values
    for layer in range(2):
        np.testing.assert_allclose(tiny_trace.k[layer], cache.layers[layer].keys[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(tiny_trace.v[layer], cache.layers[layer].values[0].numpy(), atol=1e-5)
    assert model.config._attn_implementation == "eager"  # restored after the capture


def test_capture_wraps_whatever_attention_the_model_uses(tiny_dir, tiny_trace):
    """A model the user loaded with SDPA attention records the same q/k/v, and keeps SDPA."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvviz.models import model_info

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    t = capture(
        model,
        tok,
        model_info("tiny", str(tiny_dir), model, "float32", "cpu"),
        TINY_TEXT,
        new_tokens=6,
        stop_at_eos=False,
    )
    assert model.config._attn_implementation == "sdpa"
    assert t.meta["token_ids"] == tiny_trace.meta["token_ids"]
    np.testing.assert_allclose(t.q, tiny_trace.q, atol=1e-5)
    np.testing.assert_allclose(t.k, tiny_trace.k, atol=1e-5)


def test_tiny_layer_subset_truncation_and_errors(tiny, tiny_trace):
    model, tok, info = tiny
    one = capture(model, tok, info, TINY_TEXT, new_tokens=6, layers="1", stop_at_eos=False)
    assert one.n_layers == 1 and one.meta["layers"] == [1]
    np.testing.assert_array_equal(one.q[0], tiny_trace.q[1])
    cut = capture(model, tok, info, TINY_TEXT, new_tokens=2, max_tokens=5, stop_at_eos=False)
    assert cut.context_len == 5 and cut.n_positions == 7 and cut.meta["truncated"] is True
    assert "kept the first 5" in cut.meta["notes"][0]
    assert parse_layers("0-2,5", 8) == [0, 1, 2, 5] and parse_layers(None, 8) is None
    for bad in ("", "   \n"):
        with pytest.raises(CaptureError, match="prompt is empty"):
            capture(model, tok, info, bad)
    with pytest.raises(CaptureError, match="layers 0-1"):
        capture(model, tok, info, TINY_TEXT, layers="0-3")
    with pytest.raises(CaptureError, match="0,1,5 or 0-3"):
        capture(model, tok, info, TINY_TEXT, layers="a-b")


def test_tiny_save_load_round_trip(tiny_trace, tmp_path):
    path = save_trace(tiny_trace, tmp_path / "t.safetensors")
    back = load_trace(path)
    for name in ("q", "k", "v", "query_positions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(tiny_trace, name))
    assert back.tokens == tiny_trace.tokens and back.context_len == tiny_trace.context_len
    assert back.meta == tiny_trace.meta


def test_progress_is_reported_and_monotonic(tiny):
    model, tok, info = tiny
    seen = []
    capture(model, tok, info, TINY_TEXT, new_tokens=3, stop_at_eos=False, progress=lambda f, m: seen.append((f, m)))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    text = " | ".join(m for _, m in seen)
    assert "running prefill: layer 2/2" in text and "decoding step 3/3" in text


def test_capture_trace_loads_then_captures(tiny_dir, tiny_trace):
    from kvviz.sources.capture import capture_trace

    seen = []
    t = capture_trace(str(tiny_dir), TINY_TEXT, new_tokens=0, layers=[0], progress=lambda f, m: seen.append((f, m)))
    assert t.context_len == tiny_trace.context_len and t.n_positions == t.context_len and t.n_layers == 1
    np.testing.assert_allclose(t.q[0], tiny_trace.q[0, :, : t.n_positions], atol=1e-6)
    loading = [f for f, m in seen if "load" in m]
    assert loading and max(loading) <= 0.4 and seen[-1][0] == 1.0


def test_head_overview_and_concentration_match_brute_force():
    rng = np.random.default_rng(1)
    L, H, Hkv, T, D = 3, 4, 2, 40, 8
    k = rng.standard_normal((L, Hkv, T, D)).astype(np.float32)
    k[:, :, 0] *= 6  # a strong first key
    t = Trace(
        q=rng.standard_normal((L, H, T, D)).astype(np.float32),
        k=k,
        v=None,
        context_len=30,
        tokens=tuple(f"t{i}" for i in range(T)),
        query_positions=np.arange(T),
    )
    want_first = np.zeros((L, H))
    tops = []
    for layer in range(L):
        for h in range(H):
            for p in range(22, 30):  # the last 8 context rows
                a = softmax(t.k[layer, h // 2, : p + 1].astype(np.float64) @ t.q[layer, h, p] / np.sqrt(D))
                want_first[layer, h] += a[0] / 8
                if layer >= 1:
                    tops.append(np.sort(a)[::-1][: int(np.ceil(0.1 * (p + 1)))].sum())
    np.testing.assert_allclose(head_overview(t, n_rows=8), want_first, atol=1e-5)
    c = concentration(t, first_layer=1, n_rows=8)
    assert c["first_token"] == pytest.approx(want_first[1:].mean(), abs=1e-5)
    assert c["top_share"] == pytest.approx(np.mean(tops), abs=1e-5)


# --- loading errors -----------------------------------------------------------------------


def test_load_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="no such model folder or file"):
        load_model(str(tmp_path / "missing-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    vit = tmp_path / "vit"
    transformers.ViTConfig().save_pretrained(vit)
    with pytest.raises(ModelError, match="not a causal language model"):
        load_model(str(vit))
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "mamba9")  # an architecture transformers lacks
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="unsupported GGUF architecture"):
        load_model(str(tmp_path / "odd.gguf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="no network and not in the local cache; try --model bundled"):
        load_model("someone/not-a-cached-model")
    with pytest.raises(ModelError, match="dtype must be one of"):
        load_model("bundled", dtype="int3")


# --- the command line -------------------------------------------------------------------


def test_cli_capture_then_compare(tiny_dir, tmp_path, capsys):
    out = tmp_path / "cli.safetensors"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(TINY_TEXT, encoding="utf-8")
    code, _, err = run_cli(
        capsys,
        "capture",
        "--model",
        tiny_dir,
        "--prompt-file",
        prompt,
        "--new-tokens",
        "3",
        "--layers",
        "0-1",
        "--out",
        out,
    )
    assert code == 0, err
    assert "loading" in err and "[100%] captured" in err and "wrote" in err
    t = load_trace(out)
    assert t.n_layers == 2 and t.meta["new_tokens"] + t.context_len == t.n_positions
    code, table, err = run_cli(capsys, "compare", "--source", out, "--sink", "2", "--recent", "4", "--layer", "1")
    assert code == 0, err
    assert t.tokens[0] in table


def test_cli_capture_with_kvzips_pass_then_compare_with_kvzip(tiny_dir, tmp_path, capsys):
    out = tmp_path / "kvzip.safetensors"
    code, _, err = run_cli(
        capsys,
        "capture",
        "--model",
        tiny_dir,
        "--prompt",
        TINY_TEXT,
        "--new-tokens",
        "2",
        "--kvzip",
        "--quiet",
        "--out",
        out,
    )
    assert code == 0, err
    code, table, err = run_cli(
        capsys, "compare", "--source", out, "--scorer", "kvzip", "--sink", "2", "--recent", "2", "--heavy", "8"
    )
    assert code == 0, err
    assert "KVzip" in table or "kvzip" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/folder", "--prompt", "hi"], "no such model folder or file"),
        (["--model", "someone/not-cached", "--prompt", "hi"], "no network and not in the local cache"),
        (["--model", "bundled", "--prompt", "   "], "the prompt is empty"),
    ],
)
def test_cli_capture_errors_are_one_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, "capture", *argv, "--quiet", "--out", tmp_path / "x.safetensors")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and message in lines[-1] and lines[-1].startswith("kvviz: error:")
    assert "Traceback" not in err


def test_cli_compare_on_a_corrupt_trace_file(tmp_path, capsys):
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(64))
    with pytest.raises(TraceError):
        load_trace(bad)
    code, _, err = run_cli(capsys, "compare", "--source", bad)
    assert code == 2 and err.startswith("kvviz: error:") and "Traceback" not in err


def test_cli_models_lists_the_bundled_model(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("bundled"))
    assert ("available" in line) == (bundled_model_file() is not None)


# --- the bundled SmolLM2-135M ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    from apptest_util import load_shared

    return load_shared("bundled")  # one load per test process


@pytest.fixture(scope="module")
def bundled_trace(bundled):
    model, tok, info = bundled
    return capture(model, tok, info, ENGLISH, new_tokens=8)


@pytest.mark.model
def test_bundled_trace_is_real_attention(bundled, bundled_trace):
    t = bundled_trace
    assert (t.n_layers, t.n_q_heads, t.n_kv_heads, t.head_dim) == (30, 9, 3, 64)
    assert 170 <= t.context_len <= 230 and t.n_positions == t.context_len + t.meta["new_tokens"]
    assert t.tokens[:3] == ("Every", "▁autumn", "▁the")
    # Averaged over layers 2-29, all 9 heads and the last 32 prompt queries:
    c = concentration(t, first_layer=2, n_rows=32)
    assert c["first_token"] >= 0.20, c  # an attention sink (random weights give ~0.01)
    assert c["top_share"] >= 0.70, c  # the top 10% of the keys hold most of the mass
    overview = head_overview(t)
    assert overview.shape == (30, 9) and overview[2:].mean() == pytest.approx(c["first_token"], abs=0.05)


@pytest.mark.model
def test_bundled_recompute_matches_output_attentions(bundled, bundled_trace):
    err = check_attention(bundled[0], bundled_trace)
    assert err.shape == (30, 9) and err.max() <= 1e-4, err.max()


@pytest.mark.model
def test_bundled_round_trip_and_errors(bundled, bundled_trace, tmp_path):
    back = load_trace(save_trace(bundled_trace, tmp_path / "smol.safetensors"))
    np.testing.assert_array_equal(back.q, bundled_trace.q)
    np.testing.assert_array_equal(back.k, bundled_trace.k)
    assert back.tokens == bundled_trace.tokens and back.meta["model_name"] == "bundled"
    model, tok, info = bundled
    with pytest.raises(CaptureError, match="prompt is empty"):
        capture(model, tok, info, "")
    cut = capture(model, tok, info, ENGLISH, max_tokens=16)
    assert cut.context_len == 16 and cut.meta["truncated"] and cut.meta["prompt_tokens_total"] > 16


# --- the app's Real model and Trace file sources (AppTest) ----------------------------------


def _real_model_page():
    import streamlit as st

    from kvviz.app.sources import real_model_source

    t = real_model_source(st.sidebar)
    st.write(
        "TRACE:"
        + (
            "none"
            if t is None
            else f"{t.n_layers}x{t.n_q_heads}x{t.n_positions} ctx {t.context_len} {t.meta['model_name']}"
        )
    )


def _kvzip_page():
    import numpy as np
    import streamlit as st

    from kvviz.app.sources import real_model_source
    from kvviz.policies.kvzip import META

    t = real_model_source(st.sidebar)
    st.write("KVZIP:" + ("none" if t is None or META not in t.meta else str(np.asarray(t.meta[META]).shape)))


def _trace_file_page():
    import streamlit as st

    from kvviz.app.tracefiles import trace_file_source

    t = trace_file_source(st.sidebar)
    st.write("TRACE:" + ("none" if t is None else f"{t.n_positions} tokens {t.tokens[0]}"))


def _shown(at) -> str:
    return next(m.value for m in at.main.markdown if m.value.startswith("TRACE:"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVVIZ_CACHE_DIR", str(tmp_path / "traces"))
    return tmp_path / "traces"


def test_the_main_area_capture_button_captures_the_chosen_model(tiny_dir, cache):
    """The step that was missing sits in the main area, where the page would be: its Capture
    button runs the model chosen in the sidebar (with its progress there) like the sidebar's button."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_real_model_page, default_timeout=120).run()
    at.sidebar.radio(key="rm_kind").set_value("other").run()
    at.sidebar.text_input(key="rm_name").set_value(str(tiny_dir)).run()
    at.sidebar.slider(key="rm_new").set_value(4).run()
    at.sidebar.number_input(key="rm_max").set_value(64).run()
    button = at.main.button(key="rm_capture_main")
    assert button.label.startswith(f"Capture {tiny_dir} on this prompt")
    button.click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert _shown(at) == f"TRACE:2x4x68 ctx 64 {tiny_dir}"
    assert at.status[0].label.startswith("Captured 68 tokens")
    at.run()
    assert not [b for b in at.main.button if b.key == "rm_capture_main"]  # captured: no button any more
    assert _shown(at) == f"TRACE:2x4x68 ctx 64 {tiny_dir}"


def test_kvzips_pass_with_the_capture_is_a_capture_of_its_own(tiny_dir, cache):
    """The Real model source's KVzip box: the capture carries the scores of every layer (a file of its own,
    the plain capture's stays)."""
    from streamlit.testing.v1 import AppTest

    def shown(at):
        return next(m.value for m in at.main.markdown if m.value.startswith("KVZIP:"))

    at = AppTest.from_function(_kvzip_page, default_timeout=120).run()
    at.sidebar.radio(key="rm_kind").set_value("other").run()
    at.sidebar.text_input(key="rm_name").set_value(str(tiny_dir)).run()
    at.sidebar.number_input(key="rm_max").set_value(64).run()
    at.sidebar.button(key="rm_capture").click().run()
    assert shown(at) == "KVZIP:none"
    at.sidebar.checkbox(key="rm_kvzip").check().run()
    at.sidebar.button(key="rm_capture").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert shown(at) == "KVZIP:(2, 2, 64)"  # layers, KV heads, prompt tokens
    assert len(list(cache.glob("*.safetensors"))) == 2


def test_app_real_model_capture_is_cached_on_disk(tiny_dir, cache):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_real_model_page, default_timeout=120).run()
    assert _shown(at) == "TRACE:none" and "Press **Capture**" in at.sidebar.info[0].value
    at.sidebar.radio(key="rm_kind").set_value("other").run()
    at.sidebar.text_input(key="rm_name").set_value(str(tiny_dir)).run()
    at.sidebar.slider(key="rm_new").set_value(4).run()
    at.sidebar.number_input(key="rm_max").set_value(64).run()
    at.sidebar.button(key="rm_capture").click().run()
    assert not at.exception
    assert _shown(at) == f"TRACE:2x4x68 ctx 64 {tiny_dir}"
    assert at.status[0].label.startswith("Captured 68 tokens")
    assert any("kept the first 64" in w.value for w in at.sidebar.warning)  # the prompt cap, said
    assert len(list(cache.glob("*.safetensors"))) == 1
    # A second capture in the same session reuses the loaded model (no cache replay of the
    # first capture's progress bar, which Streamlit cannot do).
    at.sidebar.slider(key="rm_new").set_value(3).run()
    at.sidebar.button(key="rm_capture").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert _shown(at) == f"TRACE:2x4x67 ctx 64 {tiny_dir}"
    assert len(list(cache.glob("*.safetensors"))) == 2
    # A new session with the same settings: straight from the disk cache, no click, no status box.
    again = AppTest.from_function(_real_model_page, default_timeout=120).run()
    again.sidebar.radio(key="rm_kind").set_value("other").run()
    again.sidebar.text_input(key="rm_name").set_value(str(tiny_dir)).run()
    again.sidebar.slider(key="rm_new").set_value(4).run()
    again.sidebar.number_input(key="rm_max").set_value(64).run()
    assert _shown(again) == f"TRACE:2x4x68 ctx 64 {tiny_dir}" and len(again.status) == 0
    # A model that does not exist: one readable error, nothing shown.
    again.sidebar.text_input(key="rm_name").set_value(str(cache / "no-model")).run()
    again.sidebar.button(key="rm_capture").click().run()
    assert not again.exception
    assert "no such model folder or file" in again.sidebar.error[0].value


def test_app_trace_file_upload_and_saved(tiny_trace, cache):
    from streamlit.testing.v1 import AppTest

    cache.mkdir(parents=True)
    good = save_trace(tiny_trace, cache / "good.safetensors").read_bytes()
    at = AppTest.from_function(_trace_file_page, default_timeout=60).run()
    assert not at.exception
    assert _shown(at) == f"TRACE:{tiny_trace.n_positions} tokens {tiny_trace.tokens[0]}"  # saved, newest
    assert "(1)" in at.sidebar.radio(key="tf_how").options[1]
    at.sidebar.radio(key="tf_how").set_value("upload").run()
    assert _shown(at) == "TRACE:none"
    at.get("file_uploader")[0].upload("bad.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!").run()
    assert not at.exception and _shown(at) == "TRACE:none"
    err = at.sidebar.error[0].value
    assert "bad.safetensors" in err and "cannot be used" in err and "kvviz capture" in err
    at.get("file_uploader")[0].upload("good.safetensors", good).run()
    assert _shown(at) == f"TRACE:{tiny_trace.n_positions} tokens {tiny_trace.tokens[0]}"


@pytest.mark.model
def test_app_real_model_default_flow_on_the_bundled_model(bundled, cache, monkeypatch):
    """The default Real model settings (bundled model, example paragraph, 16 new tokens) capture a
    ~150-200-token prompt. The already-loaded model stands in for the st.cache_resource load."""
    from streamlit.testing.v1 import AppTest

    import kvviz.models

    monkeypatch.setattr(kvviz.models, "load_model", lambda name, device="cpu", dtype="float32", progress=None: bundled)
    at = AppTest.from_function(_real_model_page, default_timeout=180).run()
    at.sidebar.button(key="rm_capture").click().run()
    assert not at.exception
    shown = _shown(at)
    assert shown.startswith("TRACE:30x9x") and shown.endswith("bundled")
    n_prompt = int(shown.split("ctx ")[1].split()[0])
    assert 150 <= n_prompt <= 200 and shown.startswith(f"TRACE:30x9x{n_prompt + 16} ")
    assert at.status[0].label.startswith(f"Captured {n_prompt + 16} tokens")


def test_hub_id_without_network_fails_fast(monkeypatch):
    """Even when the environment does not say offline, a dead hub must not mean 25 s of retries."""
    import time

    from kvviz.models import names

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    t0 = time.perf_counter()
    assert names._hub_reachable(timeout=2.0) is False
    with pytest.raises(ModelError, match="no network and not in the local cache"):
        load_model("someone/not-a-cached-model")
    assert time.perf_counter() - t0 < 15
