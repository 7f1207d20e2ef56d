"""What a loaded model's config says: its attention shape and its RoPE frequencies.

No torch import at module level: the model object brings its own tensors; a config alone gets its
scaled-RoPE frequencies from transformers (imported lazily).
"""

from __future__ import annotations

from kvviz.limits import Part, Work


def rope_inv_freq(model):
    """The model's RoPE inverse frequencies (head_dim / 2,), or None if it has no rotary embedding."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and getattr(module, "inv_freq", None) is not None:
            return module.inv_freq.detach().float().cpu()
    return None


def inv_freq_from_config(config: dict, head_dim: int):
    """The RoPE inverse frequencies (head_dim / 2,) float64 a model with this config (a dict, as a
    trace's meta carries it) starts with, for a scaled RoPE (`rope_scaling`, or `rope_parameters`
    with a rope_type other than "default": linear, dynamic, yarn, longrope, llama3, ...), computed by
    transformers' own ROPE_INIT_FUNCTIONS — the code the model's rotary embedding runs, not a
    re-derivation. None when the config has no scaled RoPE or transformers is not installed.
    (YaRN's attention factor scales queries and keys alike; kvviz only needs the frequencies.)"""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if not isinstance(params, dict) or rope_type == "default":
        return None
    try:
        import numpy as np
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return None
    fields = {k: v for k, v in config.items() if k != "model_type"}
    fields.setdefault("head_dim", head_dim)
    cfg = AutoConfig.for_model(config.get("model_type", "llama"), **fields)
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return np.asarray(inv_freq.double().numpy(), dtype=np.float64)


def model_dims(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) of a causal LM's text config."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_q = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return cfg.num_hidden_layers, n_q, getattr(cfg, "num_key_value_heads", None) or n_q, head_dim


# logits, the causally masked copy and the softmax, (query heads, n, n) each
PREFILL_SCORE_COPIES = 3


def prefill_work(dims: tuple[int, int, int, int], n_tokens: int, what: str = "this run") -> Work:
    """What one full-attention prefill of n_tokens holds beyond the weights, for dims = model_dims():
    one layer's attention scores at a time, and every layer's queries, keys and values (kvviz keeps
    them: the policies score from the prompt's queries, the cache holds keys and values twice while
    it is copied)."""
    L, Hq, H, D = dims
    tokens = (n_tokens, "tokens")
    return Work(
        what,
        (
            Part("attention scores", ((PREFILL_SCORE_COPIES, ""), (Hq, "query heads"), tokens, (n_tokens, "keys"))),
            Part("queries", ((L, "layers"), (Hq, "query heads"), tokens, (D, "dims"))),
            Part("keys and values", ((4, ""), (L, "layers"), (H, "KV heads"), tokens, (D, "dims"))),
        ),
        lower="the number of tokens",
    )
