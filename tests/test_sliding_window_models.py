"""Sliding-window layers on tiny random-weight Mistral, Gemma 2 and Gemma 3 models built here: kvviz's
recomputed attention is the model's own on every layer (check_attention), a policy leaves the
sliding layers alone, and the compressed decode (Model lab, eval, needle test) refuses such a model in one line.
The hand-made traces' exact numbers are in tests/test_sliding_window.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_llama_folder import TINY_SHAPE  # noqa: E402

from kvviz import Spec, View, compare  # noqa: E402
from kvviz.trace import trace_with  # noqa: E402


class Tok:
    """The text is space-separated token ids."""

    def __call__(self, text):
        return {"input_ids": [int(w) for w in text.split()]}

    def decode(self, ids, **kw):
        return "".join(f" {i}" for i in ids)

    def convert_ids_to_tokens(self, i):
        return str(i)


def tiny(arch: str, window: int = 32):
    common = dict(
        TINY_SHAPE,
        vocab_size=64,
        num_hidden_layers=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=window,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    config, model = {
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    }[arch]
    cfg = getattr(transformers, config)(**common)
    if arch != "mistral":
        cfg.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    m = getattr(transformers, model)(cfg).eval()
    with torch.no_grad():  # larger q/k weights: peaked attention, so a wrong window would show
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return m


PROMPT = " ".join(map(str, np.random.default_rng(0).integers(2, 64, 200)))


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_check_attention_matches_the_model_on_every_layer(arch, tmp_path):
    from kvviz.models import model_info
    from kvviz.sources.capture import capture, check_attention

    model = tiny(arch)
    info = model_info(arch, "tiny", model, "float32", "cpu")
    want = (32, 32) if arch == "mistral" else (32, None)
    # in memory with decode steps (the model's sliding cache), and to a file (format 2, lazy)
    for t in (
        capture(model, Tok(), info, PROMPT, new_tokens=4, stop_at_eos=False),
        capture(model, Tok(), info, PROMPT, out=tmp_path / "t.st"),
    ):
        assert t.layer_windows == want
        assert check_attention(model, t).max() <= 1e-5
    # the same trace read as if every layer saw the whole context is far from the model (the test can fail)
    blind = trace_with(t, meta={k: v for k, v in t.meta.items() if k != "layer_windows"})
    assert check_attention(model, blind)[0].max() > 1e-3
    # and its sliding layer is left alone by a policy, its full layer (Gemma's) is not
    spec = Spec(sink=4, recent=16, heavy=16, scorer="snapkv")
    assert compare(t, spec, View(layer=0)).metrics["tv_distance"] == 0
    if want[1] is None:
        assert compare(t, spec, View(layer=1)).metrics["tv_distance"] > 0


def test_the_compressed_decode_refuses_a_sliding_window_model_in_one_line(tmp_path, monkeypatch):
    from kvviz import decode as gen
    from kvviz.spec import SpecError

    model = tiny("mistral")
    ids = [int(w) for w in PROMPT.split()][:20]
    with pytest.raises(SpecError, match="sliding-window layers") as e:
        gen.prefill(model, ids)
    assert "\n" not in str(e.value) and "MistralForCausalLM has 2 sliding-window layers of 2" in str(e.value)
    # the Model lab's run (the page shows a SpecError as "Cannot run: ...")
    from kvviz.decode import lab, labsettings

    monkeypatch.setenv("KVVIZ_LAB_DIR", str(tmp_path / "lab"))
    settings = labsettings.LabSettings("tiny", " ".join(map(str, ids)), 12, 6, 4, Spec(sink=2, recent=4, heavy=4))
    with pytest.raises(SpecError, match="sliding-window layers"):
        lab.run(model, Tok(), "tiny", settings)
