"""Loading causal language models (torch and transformers are imported lazily, here only).

`bundled` (SmolLM2-135M-Instruct, Q4_1 GGUF), a local folder (transformers layout), a local .gguf
file, or a hub id (when a hub is reachable, or the model is in the local HF cache) loads the same
way; kvviz.models.names says where a name points. Eager attention, so the attention weights the
model reports are exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvviz.models.names import BUNDLED, BUNDLED_NAME, ModelError, resolve
from kvviz.models.weights import (
    META_FILE,
    _record_timing,
    _timings,
    cached_weights_valid,
    save_weights_cache,
    weights_cache_enabled,
    weights_cache_folder,
)

DTYPES = ("float32", "float16", "bfloat16")
NO_NETWORK = "no network and not in the local cache; try --model bundled or a local folder"

Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what the user asked for ("bundled", a path, a hub id)
    path: str  # folder or file it was loaded from, or the hub id
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    architecture: str  # e.g. LlamaForCausalLM
    dtype: str = "float32"
    device: str = "cpu"
    config: dict[str, Any] = field(default_factory=dict)  # the small, JSON-able part of the config
    # per layer: "full_attention" or "sliding_attention" (...)
    layer_kinds: tuple[str, ...] = ()
    # per layer: the sliding window in tokens, None for full
    layer_windows: tuple[int | None, ...] = ()

    @property
    def label(self) -> str:
        return BUNDLED_NAME if self.name == BUNDLED else self.name


# --- loading ----------------------------------------------------------------------------


def torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return getattr(torch, dtype)


def _silence_gguf_bar(on_tensor: Callable[[int, int], None] | None = None):
    """The GGUF converter draws its own tqdm bar on stderr, outside transformers' switch;
    we report progress ourselves: `on_tensor(done, total)` after each converted tensor.
    Returns the function that puts the bar back."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return lambda: None
    original = gguf_utils.tqdm

    def quiet(iterable, *args, **kwargs):
        items = list(iterable)
        for i, item in enumerate(items):
            yield item
            if on_tensor is not None:
                on_tensor(i + 1, len(items))

    gguf_utils.tqdm = quiet

    def restore() -> None:
        gguf_utils.tqdm = original

    return restore


def load_estimate(name: str = BUNDLED, dtype: str = "float32") -> tuple[str, float]:
    """("cached" | "convert", expected seconds) for loading `name`: measured on this machine
    before when possible, else a guess from the GGUF file's size (~1 s per 5 MB to convert)."""
    try:
        where, extra = resolve(name)
    except ModelError:
        return "convert", 0.0
    if "gguf_file" not in extra:
        return "convert", _timings().get("plain", 5.0)
    gguf = Path(where) / extra["gguf_file"]
    d = _timings()
    if weights_cache_enabled() and (weights_cache_folder(gguf, dtype) / META_FILE).is_file():
        return "cached", d.get("cached", 1.5)
    return "convert", d.get("convert", gguf.stat().st_size / 5e6)


def _eta(seconds: float) -> str:
    return f"about {max(1, round(seconds))} s" if seconds >= 0.5 else "under a second"


ATTENTIONS = ("eager", "sdpa", "flash_attention_2", "flex_attention")


@dataclass(frozen=True)
class _Plan:
    """Where a load comes from and how: resolved once, read by each phase."""

    name: str
    where: str
    # from_pretrained kwargs every call shares (never trust_remote_code)
    common: dict
    gguf: Path | None
    dtype: str
    device: str
    device_map: str | None
    attn: str

    @property
    def use_cache(self) -> bool:
        return self.gguf is not None and not self.device_map and weights_cache_enabled()

    @property
    def where_runs(self) -> str:
        return self.device_map or self.device


def load_model(
    name: str = BUNDLED,
    device: str = "cpu",
    dtype: str = "float32",
    progress: Progress | None = None,
    device_map: str | None = None,
    attn_implementation: str = "eager",
) -> tuple[Any, Any, ModelInfo]:
    """(model, tokenizer, info) for `bundled`, a local folder / .gguf file, or a hub id.

    Never trust_remote_code. `device_map="auto"` (needs accelerate) spreads a big model
    over several GPUs; otherwise the model is moved to `device`. `attn_implementation`: the
    attention it runs (eager by default, so output_attentions is exact; kvviz's capture switches
    to sdpa while it records). A GGUF file is converted once; later loads read the converted
    weights from the weights cache (see above). Progress messages say which phase runs (reading,
    converting, moving) and how long it should take, from the times measured on this machine before.
    """
    say = progress or (lambda f, m: None)
    t_start = time.perf_counter()
    say(0.0, "loading torch and transformers")
    import torch

    threads = os.environ.get("KVVIZ_TORCH_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        # 1 is faster on a busy 2-core machine (benchmarks/model_lab.py)
        torch.set_num_threads(int(threads))
    plan = _plan(name, device, dtype, device_map, attn_implementation, torch)
    if plan.use_cache:
        loaded = _from_weights_cache(plan, say, t_start)
        if loaded is not None:
            return loaded
    model, tokenizer = _from_pretrained(plan, say)
    if plan.use_cache:
        say(0.88, "saving the converted weights (later loads take about a second)")
        save_weights_cache(model, tokenizer, plan.gguf, dtype)
    if not device_map:
        say(0.95, f"moving the model to {device}")
        model.to(device)
    model.eval()
    say(1.0, "model ready")
    return model, tokenizer, model_info(plan.name, plan.where, model, dtype, plan.where_runs)


def _plan(name: str, device: str, dtype: str, device_map: str | None, attn: str, torch: Any) -> _Plan:
    """Check the settings and resolve the name (ModelError when impossible)."""
    name = (name or "").strip()
    torch_dtype(dtype)
    _check_device(device, torch)
    if attn not in ATTENTIONS:
        raise ModelError(f"attention must be one of {', '.join(ATTENTIONS)}, not {attn!r}")
    where, extra = resolve(name)
    gguf = Path(where) / extra["gguf_file"] if "gguf_file" in extra else None
    return _Plan(name, where, {**extra, "trust_remote_code": False}, gguf, dtype, device, device_map, attn)


def _from_weights_cache(plan: _Plan, say: Progress, t_start: float) -> tuple[Any, Any, ModelInfo] | None:
    """The model from the converted-weights cache; None when it is not there (a stale or corrupt folder is
    deleted: never loaded, rebuilt by the caller)."""
    say(0.02, f"reading {plan.gguf.name} (checking the converted-weights cache)")
    folder = weights_cache_folder(plan.gguf, plan.dtype)
    if cached_weights_valid(folder, plan.gguf, plan.dtype):
        say(0.1, f"reading the converted weights from the cache ({_eta(_timings().get('cached', 1.0))})")
        try:
            model, tokenizer = _load_plain(
                folder, torch_dtype(plan.dtype), {"local_files_only": True, "trust_remote_code": False}, plan.attn
            )
        except (OSError, ValueError, KeyError, TypeError, RuntimeError):
            model = None  # unreadable after all: convert again
        if model is not None:
            say(0.9, f"moving the model to {plan.device}")
            model.to(plan.device)
            model.eval()
            _record_timing("cached", time.perf_counter() - t_start)
            say(1.0, "model ready")
            return (model, tokenizer, model_info(plan.name, plan.where, model, plan.dtype, plan.device))
    if folder.exists():
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return None


def _from_pretrained(plan: _Plan, say: Progress) -> tuple[Any, Any]:
    """Config, tokenizer and weights through transformers (converting a GGUF file), progress bars ours."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name, where, common, gguf = plan.name, plan.where, plan.common, plan.gguf
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    t_convert = time.perf_counter()
    expected = _timings().get("convert", gguf.stat().st_size / 5e6) if gguf is not None else 0.0

    def on_tensor(done: int, total: int) -> None:
        if done % 8 and done != total:
            return
        left = expected * (1 - done / total) if expected else 0.0
        say(
            0.3 + 0.55 * done / total,
            f"converting the GGUF weights (first time only): tensor {done}/{total}, {_eta(left)} left",
        )

    gguf_bar = _silence_gguf_bar(on_tensor) if gguf is not None else None
    try:
        say(0.05, "reading the model config")
        if gguf is None:
            _check_causal_lm(name, AutoConfig.from_pretrained(where, **common))
        say(0.1, "loading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(where, **common)
        say(
            0.3,
            "loading the weights"
            + (f" (converting the GGUF file, first time only: {_eta(expected)})" if gguf is not None else ""),
        )
        kwargs: dict[str, Any] = dict(common, attn_implementation=plan.attn, dtype=torch_dtype(plan.dtype))
        if plan.device_map:
            kwargs["device_map"] = plan.device_map
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except OSError as exc:
        if common.get("local_files_only") or "connect" in str(exc).lower():
            raise ModelError(f"cannot load {name!r}: {NO_NETWORK}") from None
        raise ModelError(f"cannot load {name!r}: {_first_line(exc)}") from None
    except (ValueError, KeyError, TypeError) as exc:
        msg = _first_line(exc)
        if gguf is not None and ("architecture" in msg.lower() or "not supported" in msg.lower()):
            raise ModelError(f"cannot load {name!r}: unsupported GGUF architecture ({msg})") from None
        raise ModelError(f"{name!r} is not a causal language model transformers can load ({msg})") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if gguf_bar is not None:
            gguf_bar()
    if gguf is not None:
        _record_timing("convert", time.perf_counter() - t_convert)
    return model, tokenizer


def _load_plain(folder: Path, dt: Any, common: dict, attn: str = "eager") -> tuple[Any, Any]:
    """Model and tokenizer from a transformers folder (the weights cache), progress bars off."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **common)
        model = AutoModelForCausalLM.from_pretrained(folder, **common, attn_implementation=attn, dtype=dt)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model, tokenizer


def model_info(name: str, where: str, model: Any, dtype: str, device: str) -> ModelInfo:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_q = text.num_attention_heads
    keep = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "sliding_window",
        "rms_norm_eps",
        "tie_word_embeddings",
    )
    small = {k: getattr(text, k) for k in keep if getattr(text, k, None) is not None}
    kinds = layer_kinds(text)
    window = getattr(text, "sliding_window", None)
    return ModelInfo(
        name=name,
        path=where,
        n_layers=text.num_hidden_layers,
        n_q_heads=n_q,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or n_q,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // n_q,
        architecture=type(model).__name__,
        dtype=dtype,
        device=str(device),
        config=_jsonable(small),
        layer_kinds=kinds,
        layer_windows=tuple(int(window) if k == "sliding_attention" and window else None for k in kinds),
    )


def layer_kinds(text_config: Any) -> tuple[str, ...]:
    """Each layer's attention kind: the config's `layer_types` (Gemma 2/3, gpt-oss, Qwen3...), else every
    layer sliding when the config sets a `sliding_window` (Mistral), else every layer full."""
    n = int(text_config.num_hidden_layers)
    types = getattr(text_config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == n:
        return tuple(str(t) for t in types)
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        return ("sliding_attention",) * n
    return ("full_attention",) * n


def _check_causal_lm(name: str, config: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = getattr(config, "model_type", None)
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or mt
        raise ModelError(
            f"{name!r} is not a causal language model ({archs}); kvviz needs a decoder "
            "that generates text, e.g. a Llama, Qwen, Mistral or SmolLM model"
        )


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
