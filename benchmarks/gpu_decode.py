"""The compressed cache on a GPU: a random-weight model of Llama-3.1-8B's shape, no download.

Built on the GPU from a transformers LlamaConfig (32 layers, 32 query / 8 KV heads of 128, hidden
4096, MLP 14336, vocabulary 128256, RoPE theta 500000 with Llama 3's scaling), bfloat16, random
weights, eager attention. For each prompt length (4,096 and 32,768 tokens) and each method

    snapkv     4 sinks + 508 recent + 512 heavy (1,024 tokens kept), scored at the compression point
    h2o        the same budget, scores folded in at every step
    streaming  4 sinks + 1,020 recent
    kivi-4bit  keys per channel, values per token, groups of 32, the last 128 tokens exact

it measures, in one run: prefill + compression time, the decode step with the compressed cache
(teacher-forced, the median of the timed steps), transformers' own decode step with its DynamicCache
at the same length (sdpa attention, the everyday path), and peak GPU memory of the compressed run
against the full-cache run. Prints one line per (length, method) with the ratio of the step times,
and exits 1 when a ratio is above 2 (the target), 0 when every one is met. With no GPU it prints
one line saying so and exits 0 (skipped): CI and CPU machines run nothing here.

    python benchmarks/gpu_decode.py [--lengths 4096,32768] [--steps 16] [--device cuda|cpu]

The work budget (KVVIZ_MAX_BYTES) is raised for this run only: the prefill keeps every layer's
queries for the policies, on the GPU in bfloat16 until the compression point (docs/cli.md). The
policies score the prompt there (kvviz.decode.devtrace): h2o's compression-point score over a 32k prompt
(every prompt query's attention, summed) is GPU work and only the (query heads, tokens) sums cross; each
line also prints the bytes the compression sent to the host. Meant to finish in under 5 minutes on one
GPU; not yet run on one (written on a CPU-only machine). `--device cpu --lengths 256 --steps 2` runs the
same loop on a CPU (no GPU memory figures, no target: a check that the script works).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import LLAMA_8B_ATTENTION, kivi_4bit

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGET = 2.0


def llama_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        **LLAMA_8B_ATTENTION,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def small_config():
    """The same architecture at a size a CPU runs in seconds (the --device cpu check)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )


def build(device: str, attn: str):
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_8b_config() if device != "cpu" else small_config()
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16 on the GPU: 16 GB, never 32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def methods(kept: int = 1024):
    from kvviz.spec import Spec

    keep = dict(sink=4, recent=kept // 2 - 4, heavy=kept // 2)
    return {
        "snapkv": Spec(**keep, scorer="snapkv"),
        "h2o": Spec(**keep, scorer="h2o"),
        "streaming": Spec(sink=4, recent=kept - 4, scorer="streaming"),
        "kivi-4bit": kivi_4bit(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    import torch

    cpu = a.device == "cpu"
    if not cpu and not (a.device.startswith("cuda") and torch.cuda.is_available()):
        print(f"gpu_decode: skipped: no CUDA GPU here (torch {torch.__version__} sees none); run it on a GPU machine")
        return 0
    from kvviz import limits
    from kvviz.decode import decode, plain_decode

    limits.set_max_bytes(10**12)  # this run sizes itself; the GPU's memory is the limit
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    t0 = time.perf_counter()
    model = build(a.device, "sdpa")
    where = "a CPU: a small model of the same architecture" if cpu else torch.cuda.get_device_name(a.device)
    print(f"model: Llama-3.1-8B shape, random bfloat16 weights on {where}; built in {time.perf_counter() - t0:.1f} s")
    gpu = _GpuMemory(not cpu)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    worst, failed = 0.0, []
    for n in lengths:
        ids = torch.randint(0, vocab, (n + a.steps,), generator=gen).tolist()
        prompt, feed = ids[:n], ids[n:]
        base_mem = gpu.reset()
        tp: dict = {}
        plain_decode(model, prompt, a.steps, feed=feed, timings=tp)  # transformers' DynamicCache, sdpa
        full_peak = gpu.peak() - base_mem
        plain_step = tp["decode"] / a.steps
        print(
            f"\n{n} tokens: transformers DynamicCache step {plain_step * 1e3:.1f} ms, prefill {tp['prefill']:.2f} s"
            + ("" if cpu else f", peak {full_peak / 2**30:.1f} GiB above the weights")
        )
        for name, spec in methods(1024 if not cpu else max(16, n // 4)).items():
            gpu.reset()
            tc: dict = {}
            try:
                _, _, cache = decode(model, prompt, spec, a.steps, feed=feed, timings=tc)
            except torch.OutOfMemoryError as exc:
                print(f"  {name}: out of GPU memory ({str(exc).splitlines()[0][:120]})")
                failed.append(f"{name}@{n}")
                continue
            peak = gpu.peak() - base_mem
            step = tc["decode"] / a.steps
            ratio = step / plain_step
            worst = max(worst, ratio)
            if ratio > TARGET and not cpu:
                failed.append(f"{name}@{n}")
            print(
                f"  {name}: prefill + compression {tc['prefill']:.2f} s; step {step * 1e3:.1f} ms, ratio "
                f"{ratio:.2f} (target <= {TARGET:g}); "
                + ("" if cpu else f"peak {peak / 2**30:.1f} GiB vs full cache {full_peak / 2**30:.1f} GiB; ")
                + f"{cache.crossed.bytes / 2**20:.2f} MiB to the host at compression"
            )
    print(f"\nworst step ratio {worst:.2f} (target <= {TARGET:g}); {time.perf_counter() - t0:.0f} s in all")
    if failed:
        print(f"missed: {', '.join(failed)}")
        return 1
    return 0


class _GpuMemory:
    """Peak CUDA memory (0 on a CPU run)."""

    def __init__(self, on: bool):
        self.on = on

    def reset(self) -> int:
        import torch

        if not self.on:
            return 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        import torch

        if not self.on:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


if __name__ == "__main__":
    sys.exit(main())
