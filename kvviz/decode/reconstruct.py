"""KVzip's reconstruction pass (Kim et al. 2025, kvpress's KVzipPress): how much does the model need each cached
token to repeat the context?

After the context, the model reads "Repeat the previous context exactly." (the chat template's end of the
user turn after it) followed by the context itself, chunk by chunk (chunks of 2048 tokens; a later chunk's
prompt asks to repeat from the last 8 tokens of the one before). For every layer and KV head, a context
token's score is the most attention any query of the repeat (any query head of the KV group) pays it, the
softmax taken over the attention sinks (the first min(4, template head) tokens), the chunk being repeated
and the repeat's own tokens, as kvpress computes it. The context's first `prefix` tokens (the chat
template's head) are not scored (0); the caller gives the first n_sink tokens the top score.

One forward over context + repeat per chunk, which kvviz runs from the start (the context's keys are those
of the prefill: attention is causal): for one chunk, 3.6 times the plain prefill's time measured on the
bundled model (2.32 s against 0.65 s for 261 tokens; kvpress says 2-3 times), and the queries, keys and values
of context and repeat, about twice the prefill's memory.
torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvviz.spec import SpecError

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
CHUNK = 2048  # kvpress's chunk_size
CARRY = 8  # kvpress's prev_postfix_size: tokens of the previous chunk a later chunk's prompt starts from
N_SINK = 4


@dataclass(frozen=True)
class RepeatPrompt:
    """The reconstruction prompt's pieces as token ids, read from the tokenizer once (the decode side has no
    tokenizer): the chat template's head length, its tail after a user message, and the two requests."""

    prefix: int
    suffix: tuple[int, ...]
    first: tuple[int, ...]
    later: tuple[int, ...]


def repeat_prompt(tokenizer) -> RepeatPrompt:
    prefix, suffix = template_parts(tokenizer)
    return RepeatPrompt(prefix, tuple(suffix), tuple(_encode(tokenizer, FIRST)), tuple(_encode(tokenizer, LATER)))


def prepare(cache, model, repeat, ids: Sequence[int], memo: dict | None = None) -> None:
    """Before the cache's compression point: where its scorer reads a reconstruction pass (KVzip), run it on
    the prompt `ids` and put the scores in the prompt's trace. `repeat`: a RepeatPrompt, or a function giving
    one (read from the tokenizer only when a run needs it). `memo`: scores kept per prompt length, so that the
    runs of one prompt (a needle grid's budgets) make the pass once."""
    if not (cache.policy.reconstructs and cache.evicts):
        return
    if memo is not None and len(ids) in memo:
        from kvviz.policies.kvzip import META

        cache.extra_meta[META] = memo[len(ids)]
        return
    if callable(repeat):
        repeat = repeat()
    if repeat is None:
        raise SpecError(
            f"{cache.policy.title or cache.policy.name} needs the model to repeat the prompt, which needs the "
            "tokenizer's chat template: this run was started without it"
        )
    from kvviz.policies.kvzip import META

    cache.extra_meta[META] = kvzip_scores(model, repeat, ids)
    if memo is not None:
        memo[len(ids)] = cache.extra_meta[META]


def kvzip_meta(model, tokenizer):
    """A capture's `more_meta` (kvviz.sources.capture): KVzip's reconstruction scores of the prompt, every
    layer of the model, kept in the trace's meta to 6 significant digits (a trace file's header is JSON), so
    that KVzip can be chosen on the trace, a file of it included."""
    repeat = repeat_prompt(tokenizer)

    def scores_of(prompt_ids: list[int]) -> dict:
        from kvviz.policies.kvzip import META

        scores = kvzip_scores(model, repeat, prompt_ids)  # (model layers, kv_heads, prompt tokens)
        return {META: np.vectorize(lambda x: float(f"{x:.6g}"), otypes=[float])(scores).tolist()}

    return scores_of


def template_parts(tokenizer) -> tuple[int, list[int]]:
    """(prefix_length, suffix ids): the chat template's head before a user message, in tokens, and its text
    after it up to the assistant's turn, as kvpress reads them from a dummy message (none: 0 and "\\n")."""
    if getattr(tokenizer, "chat_template", None) is None:
        return 0, _encode(tokenizer, "\n")
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    context, suffix = text.split(separator)
    return len(_encode(tokenizer, context.split(dummy)[0])), _encode(tokenizer, suffix)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def kvzip_scores(model, repeat: RepeatPrompt, ids: Sequence[int], chunk: int = CHUNK) -> np.ndarray:
    """(layers, kv_heads, len(ids)) float64: each context token's reconstruction score (module docstring)."""
    import torch

    from kvviz.decode.hook import compressed_cache
    from kvviz.decode.forward import _forward, new_cache
    from kvviz.models.config import model_dims
    from kvviz.spec import Spec

    ids = [int(i) for i in ids]
    c = len(ids)
    L, Hq, H, D = model_dims(model)
    g = Hq // H
    prefix, suffix = repeat.prefix, list(repeat.suffix)
    body = ids[prefix:]
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [[]]
    scores = np.zeros((L, H, c))
    start = prefix
    for i, piece in enumerate(pieces):
        ask = list(repeat.first) if i == 0 else list(repeat.later) + pieces[i - 1][-CARRY:]
        replay = ask + suffix + piece
        r, end = len(replay), start + len(piece)
        cache = new_cache(model, Spec(), c + r)
        with torch.inference_mode(), compressed_cache(model, cache):
            _forward(model, ids + replay, 0, last_only=True)
        sink = min(N_SINK, start)
        seen = np.r_[0:sink, start:end, c : c + r]  # the keys the repeat's softmax runs over
        causal = np.triu(np.full((r, r), -np.inf), k=1)  # a repeat query sees the repeat up to itself
        for layer in range(L):
            q = _host(cache.prefill_q[layer][:, c : c + r]).reshape(H, g, r, D)  # (H, g, r, D)
            k = _host(cache.k[layer][:, torch.as_tensor(seen)])  # (H, m, D)
            logits = np.einsum("hgrd,hmd->hgrm", q, k) / np.sqrt(D)
            logits[..., -r:] += causal
            logits -= logits.max(axis=-1, keepdims=True)
            attention = np.exp(logits)
            attention /= attention.sum(axis=-1, keepdims=True)
            # the most any repeat query of the group pays each token of the chunk
            scores[layer, :, start:end] = attention[..., sink : sink + len(piece)].max(axis=(1, 2))
        start = end
    return scores


def _host(x) -> np.ndarray:
    from kvviz.decode.place import host

    return np.asarray(host(x), dtype=np.float64)
