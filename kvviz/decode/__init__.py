"""The real-model side: a compressed KV cache inside a transformers model, the decode loops,
quality against the full-cache reference, and the Model lab's run.

May import: the core, policies, quant, models. torch and transformers only inside functions.
"""
