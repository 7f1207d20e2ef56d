"""Loading a real model's weights: the bundled GGUF (SmolLM2-135M), the converted-weights cache, hub ids.

May import: nothing else of kvviz. torch and transformers only inside functions, so that
naming a model (or failing to) costs nothing until one is loaded.
"""

from kvviz.models.load import DTYPES, ModelInfo, load_estimate, load_model, model_info
from kvviz.models.names import (
    BUNDLED,
    BUNDLED_FILE,
    BUNDLED_NAME,
    BUNDLED_PACKAGE,
    Available,
    ModelError,
    available_models,
    bundled_model_file,
    resolve,
)
from kvviz.models.weights import META_FILE, WEIGHTS_FILE, cached_weights_valid, file_sha256, weights_cache_dir

__all__ = [
    "Available",
    "BUNDLED",
    "BUNDLED_FILE",
    "BUNDLED_NAME",
    "BUNDLED_PACKAGE",
    "DTYPES",
    "META_FILE",
    "ModelError",
    "ModelInfo",
    "WEIGHTS_FILE",
    "available_models",
    "bundled_model_file",
    "cached_weights_valid",
    "file_sha256",
    "load_estimate",
    "load_model",
    "model_info",
    "resolve",
    "weights_cache_dir",
]
