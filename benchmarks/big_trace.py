"""An 8B model's attention shape on a laptop CPU: capture, trace info, one head's comparison, bf16 file size.

A random-weight Llama with Llama-3.1-8B's attention (32 layers x 32 query heads x 8 KV heads x head dim
128; hidden size 256 and MLP 512 so it runs on a small CPU; the bundled model's tokenizer) is saved to a
temporary folder, and each step runs as its own `kvviz` process, whose peak resident memory (ru_maxrss)
it reports at exit:

    kvviz capture --model DIR --max-tokens 4096 (float32, default budget)   peak RSS <= 2.5 GB, exit 0
    kvviz trace info FILE                                                    wall time <= 5 s
    kvviz compare --source FILE --layer 17 --head 5                          peak RSS <= 1.2 GB
    the same prompt captured in bfloat16: its file / the float32 file        <= 0.55

It exits 1 when any target is missed. `--small` (what CI runs) keeps 8 layers and 512 tokens, so the
sizes are small, and the targets the same.

    .venv/bin/python benchmarks/big_trace.py            # ~5 min on 2 cores
    .venv/bin/python benchmarks/big_trace.py --small
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import LLAMA_8B_ATTENTION, TEXT, offline

offline()
ROOT = Path(__file__).resolve().parents[1]


def build_model(folder: Path, layers: int) -> None:
    """The random-weight 8B-attention-shaped Llama, with the bundled tokenizer, saved to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvviz.models import load_model

    _, tok, _ = load_model("bundled")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        **LLAMA_8B_ATTENTION,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)


def child(argv: list[str]) -> int:
    """Run `kvviz ARGV` in this process and print its peak RSS (MiB) as the last line on stderr."""
    from kvviz.cli import main

    rc = main(argv)
    print(f"PEAK_RSS_MIB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}", file=sys.stderr)
    return rc


def kvviz(*argv: str) -> tuple[int, float, float, str]:
    """(exit status, peak RSS MiB, wall seconds, stderr tail) of `kvviz ARGV` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("KVVIZ_MAX_BYTES", None)  # the default budget
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    peak = next(
        (float(line.split()[1]) for line in reversed(out.stderr.splitlines()) if line.startswith("PEAK_RSS_MIB")),
        float("nan"),
    )
    return out.returncode, peak, wall, (out.stderr + out.stdout)[-600:]


def capture(folder: Path, prompt: Path, tokens: int, out: Path, *more: str) -> tuple[int, float, float, str]:
    """`kvviz capture` of the model in `folder` on the prompt file's first `tokens` tokens to `out`, as kvviz()
    runs it; `more`: further capture options."""
    return kvviz(
        "capture",
        "--model",
        str(folder),
        "--prompt-file",
        str(prompt),
        "--max-tokens",
        str(tokens),
        *more,
        "--out",
        str(out),
        "--quiet",
    )


def verdict(good: bool, text: str) -> bool:
    """Print TEXT with `ok`, or `MISS` where a target is missed; `good` again."""
    print(f"{text} {'ok' if good else 'MISS'}")
    return good


def failed(rc: int, tail: str) -> bool:
    """Whether a child run failed (exit status `rc`); where it did, the tail of its output on stderr."""
    if rc != 0:
        print(tail, file=sys.stderr)
    return rc != 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="8 layers, 512 tokens (CI)")
    ap.add_argument("--tokens", type=int, default=None)
    a = ap.parse_args()
    layers = 8 if a.small else 32
    tokens = a.tokens or (512 if a.small else 4096)
    bf16_tokens = min(tokens, 1024)  # the size ratio does not depend on the length
    ok = True
    with tempfile.TemporaryDirectory(prefix="kvviz-big-") as tmp:
        tmp = Path(tmp)
        build_model(tmp / "model", layers)
        prompt = tmp / "prompt.txt"
        prompt.write_text(TEXT * (tokens // 40 + 8))
        f32 = tmp / "f32.safetensors"
        print(
            f"random-weight Llama: {layers} layers x 32 query heads x 8 KV heads x 128, hidden 256; "
            f"{tokens} tokens; CPU, {os.cpu_count()} cores"
        )
        rc, peak, wall, tail = capture(tmp / "model", prompt, tokens, f32)
        size = f32.stat().st_size if f32.exists() else 0
        ok &= verdict(
            rc == 0 and peak <= 2560,
            f"capture float32, default budget: exit {rc}, {wall:.1f} s, file {size / 1e9:.2f} GB, "
            f"peak RSS {peak:.0f} MiB (target exit 0, <= 2560 MiB)",
        )
        if failed(rc, tail):
            return 1
        rc, peak, wall, tail = kvviz("trace", "info", str(f32))
        ok &= verdict(
            rc == 0 and wall <= 5.0,
            f"kvviz trace info: exit {rc}, {wall:.2f} s wall, process start included (target <= 5 s)",
        )
        layer = min(17, layers - 1)
        rc, peak, wall, tail = kvviz("compare", "--source", str(f32), "--layer", str(layer), "--head", "5")
        ok &= verdict(
            rc == 0 and peak <= 1229,
            f"kvviz compare --layer {layer} --head 5: exit {rc}, {wall:.1f} s, peak RSS {peak:.0f} MiB "
            f"of a {size / 1e9:.2f} GB trace (target <= 1229 MiB)",
        )
        failed(rc, tail)
        sizes = {}
        for dtype in ("float32", "bfloat16"):
            out = tmp / f"{dtype}-short.safetensors"
            rc, _, wall, tail = capture(tmp / "model", prompt, bf16_tokens, out, "--dtype", dtype)
            if failed(rc, tail):
                return 1
            sizes[dtype] = out.stat().st_size
        ratio = sizes["bfloat16"] / sizes["float32"]
        ok &= verdict(
            ratio <= 0.55,
            f"{bf16_tokens} tokens: bfloat16 file {sizes['bfloat16'] / 1e6:.1f} MB / float32 file "
            f"{sizes['float32'] / 1e6:.1f} MB = ratio {ratio:.3f} (target <= 0.55)",
        )
    print("OK" if ok else "OVER TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
