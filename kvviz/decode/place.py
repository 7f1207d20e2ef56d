"""Where a compressed cache lives: the model's device and dtype, and what crosses to the host.

The cache keeps K and V as torch tensors on the model's device in the model's dtype (a
bfloat16 model on a GPU: bfloat16 on the GPU). Attention over what is kept runs there in
float32 (the upcast of the kept rows only; transformers' eager attention takes its
softmax in float32 too) and is handed back in the model's dtype. Only what a policy
decides from crosses to the host, as float32 numpy: the prompt's q, k, v once at the
compression point (its Trace), and a streaming policy's attention rows (Hq, m) each step.

    placement(model)   (device, dtype) a cache for this model uses: its input embedding's
                       (with device_map="auto" the layers may sit elsewhere: k / v are
                       copied in, the output copied back to each layer's device)
    host(x)            a tensor as float32 numpy (no copy for a float32 CPU tensor)
    on(x, device)      a numpy array as a tensor on `device`
    available_devices()  cpu, cuda:N, mps as torch sees them here; missing_device(d) one line if d is not
    device_error(exc)  one line for a device that is not there or out of memory, else None
torch is imported lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DEVICE_DTYPES = ("float32", "bfloat16", "float16")


def placement(model) -> tuple[Any, Any]:
    """(device, dtype) of the model's input embedding: where the token ids go and the cache lives."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    if weight is None:
        weight = next(model.parameters())
    return weight.device, weight.dtype


def host(x) -> np.ndarray:
    """x as float32 numpy on the host (a float32 CPU tensor is returned as a view, not copied)."""
    import torch

    if isinstance(x, np.ndarray):
        return x.astype(np.float32, copy=False)
    return x.detach().to(device="cpu", dtype=torch.float32).numpy()


def on(a: np.ndarray, device):
    """A numpy array as a torch tensor on `device` (shares memory on the CPU)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device is None or torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


def is_cpu(device) -> bool:
    import torch

    return device is None or torch.device(device).type == "cpu"


def available_devices() -> list[str]:
    """The devices torch sees here: cpu, then cuda:0.. and mps where present."""
    import torch

    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def missing_device(device: str) -> str | None:
    """One line when this machine has no such device (cpu, cuda, cuda:N, mps), else None."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"device {device}: this machine has no CUDA GPU that torch can see; use cpu"
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            verb, plural = ("is", "") if n == 1 else ("are", "s")
            return f"device {device}: there {verb} {n} CUDA GPU{plural} here (cuda:0-cuda:{n - 1})"
    elif device == "mps" and "mps" not in available_devices():
        return "device mps: this machine has no MPS device that torch can see; use cpu"
    elif device != "cpu" and not device.startswith("cuda") and device != "mps":
        return f"device {device!r}: use cpu, cuda, cuda:N or mps"
    return None


OOM_ADVICE = (
    "out of {where} memory: lower --prompt-tokens / --continuation-tokens (or the lengths), use "
    "--dtype bfloat16 or float16, or a smaller model"
)


def device_error(exc: BaseException) -> str | None:
    """One line for an out-of-memory run or a device that is not there; None for any other error."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if (oom and isinstance(exc, oom)) or "out of memory" in text.lower():
        where = "GPU" if "cuda" in text.lower() or "gpu" in text.lower() or (oom and isinstance(exc, oom)) else "device"
        if "mps" in text.lower():
            where = "MPS"
        return OOM_ADVICE.format(where=where) + f" ({text[:160]})"
    if isinstance(exc, MemoryError):
        return OOM_ADVICE.format(where="host")
    low = text.lower()
    if isinstance(exc, RuntimeError) and (
        "invalid device ordinal" in low
        or "no cuda gpus are available" in low
        or "torch not compiled with cuda" in low
        or "mps backend" in low
    ):
        return f"that device is not available here ({text[:160]}); use --device cpu or another device"
    return None
