"""Record NVIDIA kvpress 0.5.5's kept sets on the bundled SmolLM2-135M: tests/data/kvpress_reference.json.

Runs in its OWN venv, never kvviz's (kvpress 0.5.5 needs transformers < 5.3; kvviz runs a newer one):

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install torch==2.13.0
    /work/kvpress-venv/bin/pip install kvpress==0.5.5 'transformers<5.3'
    /work/kvpress-venv/bin/python scripts/kvpress_reference.py            # writes tests/data/kvpress_reference.json

The model: kvviz's converted copy of the bundled GGUF (a plain transformers folder, float32,
~/.cache/kvviz/weights/<sha>-float32, written the first time kvviz loads the bundled model), or
--model DIR. No hub, no network. The prompt: the first 261 tokens of kvviz/data/sample.txt.

What is recorded is read from kvpress itself, not re-derived: each press's `compress` is wrapped,
and the kept positions are the rows of the keys it returns found in the keys it was given (AdaKV,
which masks instead of pruning: the complement of the `masked_key_indices` it sets). kvpress
compresses a layer's cache after that layer's attention, so every layer's decision is made on
the full prefill, as kvviz's trace of the same prompt has it. Only the kept sets are stored (per layer and KV
head, a hex bit mask
of the 261 positions; for MergingPress also how far each kept value moved). Presses that mask instead (DMS's
threshold, DuoAttention: `own_budgets`) are read from
each layer's masked_key_indices after the prefill; compression during decoding (`decoding`: kvpress's
DecodingPress every 8 steps over 24 teacher-forced tokens) by following each cache position through every
compression.
tests/test_kvpress_reference.py compares kvviz's kept sets with them, per layer and KV head.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_TOKENS = 261
RATIO = 0.5

# name -> (press constructor, the kvviz settings that correspond, attention implementation)
# (kvviz's budget is sink + recent + heavy = int(261 * 0.5) = 130 tokens, kvpress's n_kept)
METHODS = {
    "snapkv": ("SnapKVPress()", dict(sink=0, recent=64, heavy=66, scorer="snapkv")),
    "tova": ("TOVAPress()", dict(sink=0, recent=1, heavy=129, scorer="tova")),
    "streaming": ("StreamingLLMPress()", dict(sink=4, recent=126, heavy=0, scorer="streaming")),
    "expected_attention": ("ExpectedAttentionPress()", dict(sink=0, recent=0, heavy=130, scorer="expected_attention")),
    "keydiff": ("KeyDiffPress()", dict(sink=0, recent=0, heavy=130, scorer="keydiff")),
    "knorm": ("KnormPress()", dict(sink=0, recent=0, heavy=130, scorer="knorm")),
    "observed_attention": (
        "ObservedAttentionPress()",
        dict(sink=0, recent=0, heavy=130, scorer="h2o", h2o_normalized=True),
    ),
    "adakv_snapkv": (
        "AdaKVPress(SnapKVPress())",
        dict(sink=0, recent=64, heavy=66, scorer="snapkv", allocation="adakv"),
    ),
    "adakv_expected_attention": (
        "AdaKVPress(ExpectedAttentionPress())",
        dict(sink=0, recent=0, heavy=130, scorer="expected_attention", allocation="adakv"),
    ),
    "pyramidkv": (
        "PyramidKVPress()",
        dict(sink=0, recent=64, heavy=66, scorer="snapkv", allocation="pyramid", pyramid_beta=20.0),
    ),
    "chunkkv_snapkv": (
        "ChunkKVPress(SnapKVPress(), chunk_length=20)",
        dict(sink=0, recent=64, heavy=66, scorer="chunkkv", chunk_size=20, chunk_scorer="snapkv"),
    ),
}
# Presses that keep their own number of tokens per head: no compression ratio; the kvviz settings say the rest.
# DMS: tokens outside the sliding window (64) whose SnapKV / K-norm score is below the threshold are masked.
# DuoAttention: kvpress's on-the-fly head scores, computed on the same 261 tokens (not BookSum), and
# kvviz's sinks and window (4 + 64) for the streaming heads in place of kvpress's 128 + 256.
THRESHOLD_SNAPKV, THRESHOLD_KNORM = 0.004, -8.0
OWN_BUDGETS = {
    "threshold_snapkv": (
        f"DMSPress(SnapKVPress(), threshold={THRESHOLD_SNAPKV}, sliding_window_size=64)",
        dict(sink=0, recent=64, heavy=0, scorer="threshold", threshold=THRESHOLD_SNAPKV, threshold_scorer="snapkv"),
    ),
    "threshold_knorm": (
        f"DMSPress(KnormPress(), threshold={THRESHOLD_KNORM}, sliding_window_size=64)",
        dict(sink=0, recent=64, heavy=0, scorer="threshold", threshold=THRESHOLD_KNORM, threshold_scorer="knorm"),
    ),
    "duo_attention": (
        "DuoAttentionPress(head_compression_ratio=0.5, on_the_fly_scoring=True), sink 4, recent 64",
        dict(sink=4, recent=64, heavy=0, scorer="duo_attention", duo_streaming=0.5),
    ),
    # one budget over every layer and head: 130 tokens a head on average (int(90 * 261 * 0.5) dropped)
    "kvzip": ("KVzipPress(compression_ratio=0.5)", dict(sink=4, recent=0, heavy=126, scorer="kvzip")),
}


# Compression during decoding: kvpress's PrefillDecodingPress(press at ratio 0.5, DecodingPress(press,
# compression_interval=8, target_size=130)) against kvviz's compress_every=8, teacher-forced over the next
# DECODE_STEPS tokens of the sample text; kept sets read after the last step (the third compression).
DECODE_STEPS, DECODE_EVERY = 24, 8
DECODING = {
    "decoding_knorm": ("KnormPress()", dict(sink=0, recent=0, heavy=130, scorer="knorm", compress_every=DECODE_EVERY)),
    # kvpress's SnapKV needs more buffered decode states than its window: a window of 4 (of the 8)
    "decoding_snapkv": (
        "SnapKVPress(window_size=4)",
        dict(sink=0, recent=4, heavy=126, scorer="snapkv", compress_every=DECODE_EVERY),
    ),
}

# Merging instead of dropping: kvpress's MergingPress around SnapKV at ratio 0.5 (the kept sets are SnapKV's);
# recorded per kept token is how far merging moved its value, |v' - v| (5 significant digits).
MERGING = {
    "merging_snapkv": ("MergingPress(SnapKVPress())", dict(sink=0, recent=64, heavy=66, scorer="snapkv", merge=True))
}


def default_model_dir() -> str:
    base = os.environ.get("KVVIZ_WEIGHTS_DIR") or os.path.expanduser("~/.cache/kvviz/weights")
    found = sorted(glob.glob(os.path.join(base, "*-float32", "config.json")))
    if not found:
        raise SystemExit(
            f"no converted bundled model under {base}: load it once with kvviz "
            "(kvviz compare --model bundled ...) or pass --model DIR"
        )
    return str(Path(found[0]).parent)


def make_press(name: str, ratio: float):
    """The press of METHODS[name], at the compression ratio (kvpress's own defaults otherwise)."""
    import kvpress as kp

    build = {
        "snapkv": kp.SnapKVPress,
        "tova": kp.TOVAPress,
        "streaming": kp.StreamingLLMPress,
        "expected_attention": kp.ExpectedAttentionPress,
        "keydiff": kp.KeyDiffPress,
        "knorm": kp.KnormPress,
        "observed_attention": kp.ObservedAttentionPress,
        "pyramidkv": kp.PyramidKVPress,
        "adakv_snapkv": lambda: kp.AdaKVPress(kp.SnapKVPress()),
        "adakv_expected_attention": lambda: kp.AdaKVPress(kp.ExpectedAttentionPress()),
        "chunkkv_snapkv": lambda: kp.ChunkKVPress(kp.SnapKVPress(), chunk_length=20),
    }
    press = build[name]()
    press.compression_ratio = ratio
    return press


def record(model, ids, name: str, ratio: float) -> list:
    """Kept positions per layer and KV head, read from what kvpress's compress returns."""
    import torch

    press = make_press(name, ratio)
    kept: dict[int, list] = {}
    inner_compress = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = inner_compress(module, hidden_states, keys, values, attentions, kwargs)
        H, n = keys.shape[1], keys.shape[2]
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:  # AdaKV: keeps the keys, masks the pruned ones
            drop = torch.zeros(H, n, dtype=torch.bool)
            drop[masked[1], masked[2]] = True
            kept[module.layer_idx] = [torch.nonzero(~drop[h]).flatten().tolist() for h in range(H)]
            module.masked_key_indices = None
        else:
            per_head = []
            for h in range(H):
                same = (new_keys[0, h][:, None, :] == keys[0, h][None, :, :]).all(dim=-1)  # (m, n)
                assert bool((same.sum(dim=1) == 1).all()), "a kept key matches no single cached key"
                per_head.append(sorted(same.float().argmax(dim=1).tolist()))
            kept[module.layer_idx] = per_head
        return new_keys, new_values

    press.compress = compress
    with torch.inference_mode(), press(model):
        model(input_ids=torch.tensor([ids]), use_cache=True)
    return [kept[layer] for layer in sorted(kept)]


def own_budget_press(name: str, ids: list[int]):
    """The press of OWN_BUDGETS[name]; DuoAttention's head scores from kvpress's own on-the-fly function, fed
    the prompt's token ids instead of 50 BookSum chapters (no hub)."""
    import kvpress as kp

    if name == "threshold_snapkv":
        return kp.DMSPress(kp.SnapKVPress(), threshold=THRESHOLD_SNAPKV, sliding_window_size=64)
    if name == "threshold_knorm":
        return kp.DMSPress(kp.KnormPress(), threshold=THRESHOLD_KNORM, sliding_window_size=64)
    if name == "kvzip":
        return kp.KVzipPress(compression_ratio=RATIO)
    import pandas as pd
    import torch
    from transformers import BatchEncoding

    import kvpress.presses.duo_attention_press as duo

    class Prompt:  # stands in for the tokenizer: the very ids kvviz traces
        def __call__(self, text, return_tensors=None):
            return BatchEncoding({"input_ids": torch.tensor([ids])})

    duo.load_dataset = lambda *a, **k: type("D", (), {"to_pandas": lambda self: pd.DataFrame({"chapter": ["-"]})})()
    duo.AutoTokenizer = type("T", (), {"from_pretrained": staticmethod(lambda *a, **k: Prompt())})
    on_the_fly = (
        duo.duo_attention_on_the_fly.__wrapped__
        if hasattr(duo.duo_attention_on_the_fly, "__wrapped__")
        else duo.duo_attention_on_the_fly
    )
    press = kp.DuoAttentionPress(head_compression_ratio=0.5, on_the_fly_scoring=True)
    post_init = press.post_init_from_model

    def post_init_from_model(model):
        duo.duo_attention_on_the_fly = lambda m: on_the_fly(m, num_samples=1)
        post_init(model)
        press.sink_size, press.recent_size = 4, 64

    press.post_init_from_model = post_init_from_model
    return press


def record_masked(model, ids, name: str) -> list:
    """Kept positions per layer and KV head of a press that masks (reads module.masked_key_indices after the
    prefill: the keys the attention patch hides from every later query)."""
    import torch

    from transformers import DynamicCache

    press = own_budget_press(name, ids)
    with torch.inference_mode(), press(model):  # KVzip scores and masks when the block ends
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True)
    kept = []
    for layer in model.model.layers:
        H, n = model.config.num_key_value_heads, len(ids)
        drop = torch.zeros(H, n, dtype=torch.bool)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            drop[masked[1], masked[2]] = True
            layer.self_attn.masked_key_indices = None
        kept.append([torch.nonzero(~drop[h]).flatten().tolist() for h in range(H)])
    return kept


def record_merging(model, ids) -> tuple[list, list]:
    """MergingPress(SnapKVPress()) at RATIO: per layer and KV head, the kept positions and |v' - v| of each kept
    value (what merging moved it by), read from what its compress returns against the cache it was given."""
    import kvpress as kp
    import torch

    press = kp.MergingPress(press=kp.SnapKVPress(compression_ratio=RATIO))
    kept: dict[int, list] = {}
    moved: dict[int, list] = {}
    inner_compress = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = inner_compress(module, hidden_states, keys, values, attentions, kwargs)
        kept[module.layer_idx], moved[module.layer_idx] = [], []
        for h in range(keys.shape[1]):
            same = (new_keys[0, h][:, None, :] == keys[0, h][None, :, :]).all(dim=-1)  # (m, n)
            assert bool((same.sum(dim=1) == 1).all()), "a kept key matches no single cached key"
            at = same.float().argmax(dim=1)
            order = torch.argsort(at)  # in position order
            shift = (new_values[0, h][order] - values[0, h][at[order]]).norm(dim=-1)
            kept[module.layer_idx].append(at[order].tolist())
            moved[module.layer_idx].append([float(f"{x:.5g}") for x in shift.tolist()])
        return new_keys, new_values

    press.compress = compress
    with torch.inference_mode(), press(model):
        model(input_ids=torch.tensor([ids]), use_cache=True)
    return [kept[layer] for layer in sorted(kept)], [moved[layer] for layer in sorted(moved)]


def record_decoding(model, ids: list[int], more: list[int], name: str) -> list:
    """Kept positions per layer and KV head after teacher-forcing `more` through kvpress's decoding press.
    Each layer's cache positions are followed through the run: every step appends its position, and each
    compression (the prefill's and the decoding press's, both wrapped) keeps the rows of the keys it returns
    found among the keys it was given."""
    import torch
    from transformers import DynamicCache

    import kvpress as kp

    inner = {"decoding_knorm": kp.KnormPress, "decoding_snapkv": lambda **k: kp.SnapKVPress(window_size=4, **k)}[name]
    press = kp.PrefillDecodingPress(
        prefilling_press=inner(compression_ratio=RATIO),
        decoding_press=kp.DecodingPress(base_press=inner(), compression_interval=DECODE_EVERY, target_size=130),
    )
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    held = {layer: [list(range(len(ids))) for _ in range(H)] for layer in range(L)}  # positions, per head

    def follow(compress):
        def wrapped(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            layer = module.layer_idx
            for h in range(H):
                assert len(held[layer][h]) == keys.shape[2]
                same = (new_keys[0, h][:, None, :] == keys[0, h][None, :, :]).all(dim=-1)  # (m, n)
                assert bool((same.sum(dim=1) == 1).all()), "a kept key matches no single cached key"
                held[layer][h] = [held[layer][h][i] for i in same.float().argmax(dim=1).tolist()]
            return new_keys, new_values

        return wrapped

    press.prefilling_press.compress = follow(press.prefilling_press.compress)
    press.decoding_press.compress = follow(press.decoding_press.compress)
    with torch.inference_mode(), press(model):
        cache = DynamicCache()
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        for i, t in enumerate(more):  # true positions, however many tokens the cache holds
            p = len(ids) + i
            for layer in held:
                for h in range(H):
                    held[layer][h].append(p)
            model(
                input_ids=torch.tensor([[t]]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[p]]),
                cache_position=torch.tensor([p]),
            )
    return [[sorted(held[layer][h]) for h in range(H)] for layer in range(L)]


def to_hex(positions: list[int], n: int) -> str:
    """A kept set as a hex bit mask, bit i (little-endian, int(h, 16) >> i & 1) = position i kept."""
    return format(sum(1 << i for i in positions), "x").zfill(-(-n // 4))


def entry(press: str, settings: dict, kept: list, n: int, **more) -> dict:
    """One method's record: its kvpress press, kvviz's settings for it, and the positions (of `n`) that each
    layer's KV heads kept, as hex bit masks; `more`: further fields."""
    return {"press": press, "kvviz": settings, "kept": [[to_hex(h, n) for h in layer] for layer in kept], **more}


def kept_per_head(kept: list) -> str:
    """`layers L  kept per head A..B`: how many layers, and the fewest and most positions a head kept."""
    sizes = sorted({len(h) for layer in kept for h in layer})
    return f"layers {len(kept)}  kept per head {sizes[0]}..{sizes[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a transformers folder of the bundled model (default: kvviz's cache)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "kvpress_reference.json"))
    args = ap.parse_args()

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = (ROOT / "kvviz" / "data" / "sample.txt").read_text(encoding="utf-8")
    ids = list(tok(text)["input_ids"])[:N_TOKENS]
    models = {}
    out = {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (bundled GGUF Q4_1, float32)",
        "prompt": "kvviz/data/sample.txt",
        "token_ids": ids,
        "compression_ratio": RATIO,
        "methods": {},
    }
    for name, (expr, settings) in METHODS.items():
        impl = "eager" if name == "observed_attention" else "sdpa"  # ObservedAttention reads the weights
        if impl not in models:
            models[impl] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation=impl
            ).eval()
        kept = record(models[impl], ids, name, RATIO)
        out["methods"][name] = entry(expr, settings, kept, len(ids))
        print(f"{name:26s} {expr:48s} {kept_per_head(kept)}")
    out["own_budgets"] = {}
    for name, (expr, settings) in OWN_BUDGETS.items():
        kept = record_masked(models["sdpa"], ids, name)
        out["own_budgets"][name] = entry(expr, settings, kept, len(ids))
        print(f"{name:26s} {expr[:48]:48s} {kept_per_head(kept)}")
    out["merging"] = {}
    for name, (expr, settings) in MERGING.items():
        kept, moved = record_merging(models["sdpa"], ids)
        out["merging"][name] = entry(expr, settings, kept, len(ids), moved=moved)
        print(
            f"{name:26s} {expr:48s} layers {len(kept)}  values moved in "
            f"{sum(x > 0 for layer in moved for h in layer for x in h)} of "
            f"{sum(len(h) for layer in kept for h in layer)}"
        )
    more = list(tok(text)["input_ids"])[N_TOKENS : N_TOKENS + DECODE_STEPS]
    out["decoding"] = {"steps": DECODE_STEPS, "every": DECODE_EVERY, "continuation_ids": more, "methods": {}}
    for name, (expr, settings) in DECODING.items():
        kept = record_decoding(models["sdpa"], ids, more, name)
        press = (
            f"PrefillDecodingPress({expr} at 0.5, DecodingPress({expr}, "
            f"compression_interval={DECODE_EVERY}, target_size=130))"
        )
        out["decoding"]["methods"][name] = entry(press, settings, kept, len(ids) + len(more))
        print(f"{name:26s} after {len(more)} decode steps: {kept_per_head(kept)}")
    Path(args.out).write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
