"""What a loaded model's config says: its attention shape and its RoPE frequencies.

No torch import here: the model object brings its own tensors.
"""

from __future__ import annotations

from kvviz.limits import Part, Work


def rope_inv_freq(model):
    """The model's RoPE inverse frequencies (head_dim / 2,), or None if it has no rotary embedding."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and getattr(module, "inv_freq", None) is not None:
            return module.inv_freq.detach().float().cpu()
    return None


def model_dims(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) of a causal LM's text config."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_q = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return cfg.num_hidden_layers, n_q, getattr(cfg, "num_key_value_heads", None) or n_q, head_dim


PREFILL_SCORE_COPIES = 3    # logits, the causally masked copy and the softmax, (query heads, n, n) each


def prefill_work(dims: tuple[int, int, int, int], n_tokens: int, what: str = "this run") -> Work:
    """What one full-attention prefill of n_tokens holds beyond the weights, for dims = model_dims():
    one layer's attention scores at a time, and every layer's queries, keys and values (kvviz keeps
    them: the policies score from the prompt's queries, the cache holds keys and values twice while
    it is copied)."""
    L, Hq, H, D = dims
    tokens = (n_tokens, "tokens")
    return Work(what, (
        Part("attention scores", ((PREFILL_SCORE_COPIES, ""), (Hq, "query heads"), tokens, (n_tokens, "keys"))),
        Part("queries", ((L, "layers"), (Hq, "query heads"), tokens, (D, "dims"))),
        Part("keys and values", ((4, ""), (L, "layers"), (H, "KV heads"), tokens, (D, "dims"))),
    ), lower="the number of tokens")
