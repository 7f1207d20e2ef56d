"""An 8B model on one GPU: kvviz's capture to a file against the bare work it cannot avoid.

A random-weight model of Llama-3.1-8B's shape (32 layers, 32 query heads, 8 KV heads, head dim 128, hidden
4096, MLP 14336; `--small-mlp` shrinks hidden/MLP when GPU memory is short) in bfloat16 on one CUDA GPU,
and a prompt of `--tokens` (default 32,768) tokens. Measured in this one run, after a warm-up:

    capture  = kvviz.sources.capture.capture(..., out=FILE): sdpa prefill recording every layer's q, k, v
               and writing them (bfloat16) to a format-2 trace file as the layers arrive
    bare     = the same sdpa prefill with no recording (forward_only)
               + safetensors' own save_file of host tensors of the same bytes to the same folder

    capture / bare = ratio      (target <= 2)

It also prints the file's size and bytes per token, and the peak GPU memory of each. It exits 1 when the
ratio is over 2. Without a CUDA GPU it prints one line saying so and exits 0 (so `make bench` runs on
any machine); the result then is "not run".

    .venv/bin/python benchmarks/gpu_capture.py                 # on a machine with a GPU
    .venv/bin/python benchmarks/gpu_capture.py --tokens 4096   # a quicker look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import LLAMA_8B_ATTENTION, TEXT, offline

offline()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--small-mlp", action="store_true", help="hidden 1024, MLP 2048 (same attention shape)")
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temporary folder)")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_capture: no torch here; not run")
        return 0
    if not torch.cuda.is_available():
        print("gpu_capture: no CUDA GPU on this machine; not run (a developer with a GPU runs it)")
        return 0

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvviz.models import load_model, model_info
    from kvviz.sources.capture import capture, forward_only

    _, tok, _ = load_model("bundled")  # its tokenizer; ids < the vocabulary below
    hidden, mlp = (1024, 2048) if a.small_mlp else (4096, 14336)
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=32,
        **LLAMA_8B_ATTENTION,
        max_position_embeddings=max(131072, a.tokens + 8),
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    info = model_info("random-8b-shape", "random", model, "bfloat16", "cuda")
    prompt = TEXT
    while len(tok(prompt)["input_ids"]) < a.tokens:
        prompt += TEXT * 64
    ids = tok(prompt)["input_ids"][: a.tokens]
    folder = Path(a.dir or tempfile.mkdtemp(prefix="kvviz-gpu-"))
    out = folder / "trace.safetensors"
    dev = torch.cuda.get_device_name(0)
    print(
        f"{dev}; torch {torch.__version__}; Llama-3.1-8B attention shape, hidden {hidden}, MLP {mlp}, "
        f"bfloat16, sdpa; {a.tokens:,} tokens, all 32 layers; files in {folder}"
    )

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # the bytes a capture writes: per layer q (32, T, 128) and k, v (8, T, 128), bfloat16, on the host
    T = len(ids)
    host = {}
    for n in range(32):
        host[f"q.{n}"] = torch.empty((32, T, 128), dtype=torch.bfloat16)
        host[f"k.{n}"] = torch.empty((8, T, 128), dtype=torch.bfloat16)
        host[f"v.{n}"] = torch.empty((8, T, 128), dtype=torch.bfloat16)
    plain = folder / "plain.safetensors"

    forward_only(model, ids[:256])  # warm-up
    capture(model, tok, info, prompt, max_tokens=256, out=out)
    t_fwd, t_write, t_cap, peaks = [], [], [], {}
    for _ in range(a.repeats):
        torch.cuda.reset_peak_memory_stats()
        t_fwd.append(timed(lambda: forward_only(model, ids)))
        peaks["forward"] = torch.cuda.max_memory_allocated() / 1e9
        t_write.append(timed(lambda: save_file(host, str(plain))))
        plain.unlink()
        torch.cuda.reset_peak_memory_stats()
        t_cap.append(timed(lambda: capture(model, tok, info, prompt, max_tokens=a.tokens, out=out)))
        peaks["capture"] = torch.cuda.max_memory_allocated() / 1e9
    fwd, write, cap = (statistics.median(x) for x in (t_fwd, t_write, t_cap))
    size = out.stat().st_size
    ratio = cap / (fwd + write)
    print(
        f"plain sdpa prefill {fwd:.2f} s (GPU peak {peaks['forward']:.1f} GB) + safetensors write of "
        f"{size / 1e9:.2f} GB {write:.2f} s = bare {fwd + write:.2f} s"
    )
    print(
        f"kvviz capture to a file {cap:.2f} s (GPU peak {peaks['capture']:.1f} GB); file {size / 1e9:.2f} GB, "
        f"{size / T / 1e3:.0f} kB a token"
    )
    print(f"capture / bare = ratio {ratio:.2f} (target <= 2) {'OK' if ratio <= 2 else 'OVER TARGET'}")
    if a.dir is None:
        out.unlink(missing_ok=True)
    return 0 if ratio <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
