"""One needle cell: a compressed copy of the prompt's prefill, the greedy answer, and what each KV
head kept of the needle and of the attention the full model wanted on it. torch lazily."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvviz.analysis.needle.prompt import DEFAULT_NEW_TOKENS, NeedlePrompt
from kvviz.analysis.needle.records import from_record, to_record
from kvviz.analysis.needle.tasks import TASKS
from kvviz.spec import Spec


# --- cells -----------------------------------------------------------------------------------


def _pack(mask: np.ndarray) -> str:
    return base64.b64encode(np.packbits(mask.astype(bool), axis=None).tobytes()).decode("ascii")


def _unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))
    return bits[: int(np.prod(shape))].reshape(shape).astype(bool)


# What a cell found, beside its settings: the key, the answers with and without compression, the share of the
# needle kept and the attention masses (the columns the needle CSV and a study's needle cell take of as_dict)
ANSWER_FIELDS = ("key", "correct", "answer", "full_answer", "full_correct", "needle_kept", "wanted_mass", "kept_mass")


@dataclass(frozen=True)
class NeedleCell:
    """One (scorer, budget, bits) on one prompt. Everything here round-trips through JSON exactly."""

    scorer: str
    length: int
    depth: float
    budget: float  # fraction of the prompt's tokens (1.0 for the full cache)
    bits: int
    question_after_compression: bool
    spec: str  # Spec.label()
    budget_tokens: int  # tokens each KV head holds
    key: str
    correct: bool
    answer: str
    answer_ids: tuple[int, ...]
    needle_kept: float
    needle_kept_by_head: tuple[tuple[float, ...], ...]  # (layers, kv_heads)
    wanted_mass: float
    wanted_mass_by_head: tuple[tuple[float, ...], ...]
    kept_mass: float
    kept_mass_by_head: tuple[tuple[float, ...], ...]
    full_answer: str
    full_correct: bool
    # (layers, kv_heads, length) bool, packed bits
    kept_packed: str = field(default="", repr=False)

    @property
    def n_layers(self) -> int:
        return len(self.needle_kept_by_head)

    @property
    def n_kv_heads(self) -> int:
        return len(self.needle_kept_by_head[0]) if self.needle_kept_by_head else 0

    def kept(self) -> np.ndarray:
        """(layers, kv_heads, length) bool: the cache at the first answer step."""
        return _unpack(self.kept_packed, (self.n_layers, self.n_kv_heads, self.length))

    def as_dict(self, kept: bool = False) -> dict:
        return to_record(self, leave_out=() if kept else ("kept_packed",))

    @classmethod
    def from_dict(cls, d: dict) -> "NeedleCell":
        return from_record(cls, d)


def score_answer(answer: str, key: str) -> bool:
    """Exact match: the first run of digits in the answer is the key (the pass key task's scoring)."""
    return TASKS["passkey"].score(answer, key)


# --- running the model -------------------------------------------------------------------------


@dataclass
class _Prefill:
    """The full model's prefill of one prompt: every layer's q, k, v, and the last logits."""

    q: list  # per layer (Hq, n, D): float32 numpy, or on the model's device in its dtype
    k: Any  # torch (L, H, n, D)
    v: Any
    # position -> torch (vocab,) logits there (the compression points' last tokens)
    logits: dict
    scaling: float
    dims: tuple[int, int, int, int]
    # prompt length -> KVzip's reconstruction scores: one pass a prompt, whatever the budget
    reconstructed: dict = field(default_factory=dict)


def _scaling(model, head_dim: int) -> float:
    for module in model.modules():
        s = getattr(module, "scaling", None)
        if isinstance(s, float) and getattr(module, "layer_idx", None) is not None:
            return s
    return head_dim**-0.5


def prefill(model, ids: Sequence[int], logits_at: Sequence[int] = ()) -> _Prefill:
    """One full-attention pass over the prompt through the compressed-cache attention (compression off).

    Logits are kept at the last position and at `logits_at` only (the vocabulary head
    over every position would cost as much as a third of the model).
    """
    import torch

    from kvviz.decode.hook import compressed_cache
    from kvviz.decode.forward import new_cache
    from kvviz.decode.place import placement
    from kvviz.models.config import model_dims

    L, Hq, H, D = model_dims(model)
    n = len(ids)
    at = sorted({n - 1, *(int(p) for p in logits_at)})
    cache = new_cache(model, Spec(), n)  # on the model's device, in its dtype
    device = placement(model)[0]
    with torch.inference_mode(), compressed_cache(model, cache):
        x = torch.tensor([list(ids)], dtype=torch.long, device=device)
        out = model(
            input_ids=x,
            position_ids=torch.arange(n, device=device)[None],
            use_cache=False,
            logits_to_keep=torch.tensor(at, device=device),
        )
        rows = out.logits[0].float()
    # a model without logits_to_keep: every position
    if rows.shape[0] != len(at):
        rows = rows[at]
    return _Prefill(
        q=list(cache.prefill_q),
        k=cache.k.clone(),
        v=cache.v.clone(),
        logits={p: rows[i] for i, p in enumerate(at)},
        scaling=_scaling(model, D),
        dims=(L, Hq, H, D),
    )


def _first_answer_attention(pre: _Prefill, pos: int) -> np.ndarray:
    """(L, Hq, pos + 1) the full model's attention of the query at `pos` (float64)."""
    from kvviz.decode.place import host

    L, Hq, H, D = pre.dims
    g = Hq // H
    out = np.empty((L, Hq, pos + 1))
    for layer in range(L):
        q = host(pre.q[layer][:, pos]).astype(np.float64)  # (Hq, D), from numpy or the model's device
        k = host(pre.k[layer, :, : pos + 1]).astype(np.float64)  # (H, pos+1, D)
        logits = np.einsum("hgd,hnd->hgn", q.reshape(H, g, D), k).reshape(Hq, -1) * pre.scaling
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        out[layer] = e / e.sum(axis=1, keepdims=True)
    return out


def run_cell(
    model,
    tokenizer,
    prompt: NeedlePrompt,
    pre: _Prefill,
    spec: Spec,
    question_after_compression: bool = False,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    attention: np.ndarray | None = None,
) -> dict:
    """Decode one compressed cache from the shared prefill; the cell's dictionary (no full-cache fields).

    The cache is a copy of the prefill's up to the compression point, compressed by the
    policy exactly as kvviz.decode.loop.decode does (CompressedCache.compress), then the
    question tokens (query-agnostic case) and the answer run one token at a time at their
    true positions through the same attention function the Model lab uses.
    """
    import torch

    from kvviz.decode.hook import compressed_cache
    from kvviz.decode.forward import _forward
    from kvviz.decode.ragged import cache_class
    from kvviz.decode.reconstruct import prepare, repeat_prompt

    L, Hq, H, D = pre.dims
    P = prompt.length
    c = prompt.question_start if question_after_compression else P
    cache = cache_class(spec)(
        spec,
        L,
        Hq,
        H,
        D,
        capacity=P + new_tokens,
        tokens=prompt.tokens,
        # where the model and its prefill live
        device=pre.k.device,
        dtype=pre.k.dtype,
    )
    cache.k[:, :, :c] = pre.k[:, :, :c]
    cache.v[:, :, :c] = pre.v[:, :, :c]
    cache.length = [c] * L
    cache.prefill_q = [q[:, :c] for q in pre.q]  # views: compress() reads them, never writes
    # KVzip: the model repeats the context, once per prompt whatever the budget
    prepare(cache, model, partial(repeat_prompt, tokenizer), prompt.ids[:c], memo=pre.reconstructed)
    answer: list[int] = []
    with torch.inference_mode(), compressed_cache(model, cache):
        cache.compress()
        last = pre.logits[c - 1]
        # the question in one masked pass where the cache allows it (equal to the step loop)
        if P - c > 1 and cache.block_ok():
            cache.block = True
            last = _forward(model, list(prompt.ids[c:P]), c)[-1]
        else:
            for p in range(c, P):  # the question, after compression, a token at a time
                last = _forward(model, [prompt.ids[p]], p)[-1]
        # the cache the first answer step reads
        kept_now = [[k.copy() for k in cache.kept_positions(layer)] for layer in range(L)]
        for i in range(new_tokens):
            tok = int(torch.argmax(last))
            answer.append(tok)
            if i < new_tokens - 1:
                last = _forward(model, [tok], P + i)[-1]
    # (L, Hq, P)
    attn = attention if attention is not None else _first_answer_attention(pre, P - 1)
    # default case (compressed after the question): the first answer token comes from the prefill; the
    # oracle's (Quest's) set for that query is chosen from the query itself, as its decode steps choose
    if c == P and cache.policy.needs_query and spec.evicts:
        kept_now = [_query_kept_at(cache, pre, attn, layer, P) for layer in range(L)]
    kept = np.zeros((L, H, P), dtype=bool)
    for layer in range(L):
        for h, positions in enumerate(kept_now[layer]):
            kept[layer, h, positions] = True
    return _measure(prompt, spec, kept, attn, tokenizer, answer, (Hq // H))


def _query_kept_at(cache, pre: _Prefill, attn: np.ndarray, layer: int, P: int) -> list[np.ndarray]:
    """Per KV head, the tokens a policy that decides from the query keeps for the prompt's last query."""
    from kvviz.decode.place import host
    from kvviz.policies import ScoreContext

    mask = cache.policy.query_kept(
        attn[layer],
        ScoreContext(cache.trace, layer, cache.spec),
        query=host(pre.q[layer][:, P - 1]).astype(np.float64),
        keys=host(pre.k[layer, :, :P]).astype(np.float64),
    )
    return [np.flatnonzero(r) for r in mask]


def _measure(
    prompt: NeedlePrompt, spec: Spec, kept: np.ndarray, attn: np.ndarray, tokenizer, answer: list[int], group: int
) -> dict:
    L, H, P = kept.shape
    ns, ne = prompt.needle_start, prompt.needle_end
    needle_kept = kept[:, :, ns:ne].mean(axis=2)  # (L, H)
    on_needle = attn[:, :, ns:ne]  # (L, Hq, k)
    wanted = on_needle.sum(axis=2).reshape(L, H, group).mean(axis=2)  # (L, H)
    kept_q = np.repeat(kept[:, :, ns:ne], group, axis=1)  # (L, Hq, k)
    kept_mass = (on_needle * kept_q).sum(axis=2).reshape(L, H, group).mean(axis=2)
    text = tokenizer.decode(answer, skip_special_tokens=True)
    r = lambda a: [[float(x) for x in row] for row in a]  # noqa: E731
    return {
        "spec": spec.label(),
        "budget_tokens": int(kept[0, 0].sum()),
        "key": prompt.key,
        "correct": TASKS[prompt.task].score(text, prompt.key),
        "answer": text,
        "answer_ids": [int(t) for t in answer],
        "needle_kept": float(needle_kept.mean()),
        "needle_kept_by_head": r(needle_kept),
        "wanted_mass": float(wanted.mean()),
        "wanted_mass_by_head": r(wanted),
        "kept_mass": float(kept_mass.mean()),
        "kept_mass_by_head": r(kept_mass),
        "kept_packed": _pack(kept),
    }
