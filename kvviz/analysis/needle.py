"""Needle in a haystack: does the compressed cache still find what it was told, and if not, why?

A passkey prompt (Mohtashami & Jaggi's retrieval test, the form kvpress and RULER use)
hides one sentence, the needle, at a depth in a haystack of filler, then asks for it:

    <chat template> user:    There is an important info hidden inside a lot of irrelevant text. ...
                             [haystack before] The pass key is 71432. Remember it. [haystack after]
                             What is the pass key?
                    assistant: The pass key is _

`length` is the prompt's length in tokens (everything the model reads before it answers,
chat template included); `depth` is the share of the haystack before the needle (0 = at
the start, 1 = just before the question; snapped to a sentence end). The key is a
seeded random 5-digit number, different for every (length, depth).

One prefill per prompt (the full model, every layer's q, k, v kept) serves every cell:
the full cache's greedy answer, and for each (policy, budget, bits) a copy of that
prefill's cache compressed and decoded through the Model lab's own path
(kvviz.decode.generation.CompressedCache: true positions, eviction per KV head, K/V quantized
with kvviz.quant). Two places for the compression point:

    default                     after the question (kvpress's evaluation with
                                compress_questions=True; SnapKV's setting): the policy
                                scores every prompt token, the question's own queries
                                included. The first answer token is
                                predicted by the prefill itself (as in real serving); every
                                later one reads the compressed cache.
    question_after_compression  query-agnostic (kvpress's pipeline default, which compresses
                                the context only): the cache is compressed right after the
                                haystack, then the question arrives token by token through
                                the compressed cache (its own tokens are kept as decode
                                tokens are). Harder and realistic: the policy cannot know
                                what will be asked.

Per cell, at the first answer step (the query at the prompt's last position, the one that
predicts the first digit of the key):
    needle_kept_by_head[l][h]  share of the needle's tokens in KV head h's cache of layer l
                               (the oracle's set is its top-k for that very query)
    wanted_mass_by_head[l][h]  attention the full model puts on the needle's tokens there,
                               the mean over the query heads sharing KV head h
    kept_mass_by_head[l][h]    the part of it on needle tokens the compressed cache still
                               holds: what the compressed cache could still give
    needle_kept, wanted_mass, kept_mass: their means over all layers x KV heads.
A cell is correct when the first run of digits in the greedy answer is exactly the key.

Every cell is cached on disk per (model, prompt ids, spec, mode, new tokens) as JSON
(never pickle), so a rerun is instant and gives the identical numbers: a fresh cell is
built from the very dictionary that is written.

torch is imported lazily (inside functions), so `import kvviz.analysis.needle` stays fast.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.spec import FULL_BITS, SCORERS, Spec, SpecError

FORMAT_VERSION = 1
NEEDLE_TEMPLATE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key?"
# The assistant's turn is primed up to the key's first digit (the trailing space is its own
# token before the digits, as in " 71432"): the first answer step predicts the first digit.
PRIMER = "The pass key is "
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n\n")   # before the haystack
# The classic passkey filler (plain, repeated); the other haystack is kvviz's own sample text.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HAYSTACKS = ("filler", "sample")
FULL = "full"                            # the uncompressed cache's name in `scorers`
SCORER_NAMES = (FULL, *SCORERS)
DEFAULT_LENGTHS = (320, 640, 1024)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_SCORERS = (FULL, "streaming", "h2o", "tova", "snapkv", "oracle")
DEFAULT_BUDGET = 0.25
DEFAULT_NEW_TOKENS = 8
DEFAULT_SEED = 0
MIN_BUDGET_TOKENS = 8                    # 4 sinks + a window
DEFAULT_FILE = Path(__file__).resolve().parents[1] / "data" / "needle_default.json.gz"

Progress = Callable[[float, str], None]


# --- prompts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class NeedlePrompt:
    """One needle prompt as token ids, with where the needle and the question sit."""

    length: int                      # tokens (the whole prompt)
    depth: float                     # asked-for share of the haystack before the needle
    key: str
    haystack: str
    ids: tuple[int, ...]
    tokens: tuple[str, ...]          # display string of every token
    needle_start: int                # needle tokens: [needle_start, needle_end)
    needle_end: int
    question_start: int              # first token after the haystack: the query-agnostic compression point
    hay_start: int = 0               # first haystack token (after the chat template's head)

    @property
    def needle_depth(self) -> float:
        """The needle's actual depth: share of the haystack tokens before it."""
        hay = self.question_start - (self.needle_end - self.needle_start) - self.hay_start
        return (self.needle_start - self.hay_start) / hay if hay > 0 else 0.0

    def as_dict(self) -> dict:
        return {"length": self.length, "depth": self.depth, "key": self.key, "haystack": self.haystack,
                "ids": list(self.ids), "tokens": list(self.tokens), "needle_start": self.needle_start,
                "needle_end": self.needle_end, "question_start": self.question_start,
                "hay_start": self.hay_start}

    @classmethod
    def from_dict(cls, d: dict) -> "NeedlePrompt":
        return cls(length=int(d["length"]), depth=float(d["depth"]), key=str(d["key"]), haystack=d["haystack"],
                   ids=tuple(int(i) for i in d["ids"]), tokens=tuple(d["tokens"]),
                   needle_start=int(d["needle_start"]), needle_end=int(d["needle_end"]),
                   question_start=int(d["question_start"]), hay_start=int(d.get("hay_start", 0)))


def passkey(seed: int, length: int, depth: float) -> str:
    """A 5-digit key, the same for the same (seed, length, depth), different across cells."""
    rng = np.random.default_rng([int(seed), int(length), int(round(depth * 1000))])
    return str(int(rng.integers(10000, 100000)))


def haystack_text(name: str) -> str:
    if name == "filler":
        return FILLER
    if name == "sample":
        from kvviz.decode.generation import sample_text
        return " ".join(sample_text().split()) + " "
    raise SpecError(f"unknown haystack {name!r}; choose from {', '.join(HAYSTACKS)}")


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _frame(tokenizer) -> tuple[str, str]:
    """(text before the user's content, text after it up to the primed answer)."""
    mark = "\u0000USER\u0000"
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": mark}, {"role": "assistant", "content": PRIMER}],
                tokenize=False, continue_final_message=True)
            if text.count(mark) == 1 and text.rstrip().endswith(PRIMER.rstrip()):
                head, tail = text.split(mark)
                return head, tail
        except Exception:  # noqa: BLE001 - a template that cannot do this: plain text below
            pass
    return "", f"\n\nAnswer: {PRIMER}"


def min_length(tokenizer) -> int:
    """The shortest prompt that holds the frame, the needle and the question (no haystack)."""
    head, tail = _frame(tokenizer)
    return (len(_encode(tokenizer, head + INSTRUCTION)) + len(_encode(tokenizer, " " + NEEDLE_TEMPLATE.format(key="12345")))
            + len(_encode(tokenizer, "\n\n" + QUESTION + tail)))


def build_prompt(tokenizer, length: int, depth: float, seed: int = DEFAULT_SEED,
                 haystack: str = "filler") -> NeedlePrompt:
    """The needle prompt of exactly `length` tokens with the needle at `depth` of the haystack.

    The pieces are tokenized apart and joined as ids, so the needle's tokens are known
    exactly; the haystack is cut to fill the length, and the needle goes in at the
    sentence end nearest to `depth` of it.
    """
    if not 0.0 <= depth <= 1.0:
        raise SpecError(f"depths are fractions of the haystack in [0, 1], got {depth:g}")
    key = passkey(seed, length, depth)
    head, tail = _frame(tokenizer)
    head_ids = _encode(tokenizer, head + INSTRUCTION)
    needle_ids = _encode(tokenizer, " " + NEEDLE_TEMPLATE.format(key=key))
    question_ids = _encode(tokenizer, "\n\n" + QUESTION + tail)
    n_hay = length - len(head_ids) - len(needle_ids) - len(question_ids)
    if n_hay < 0:
        raise SpecError(f"a needle prompt needs at least {length - n_hay} tokens for this model "
                        f"(frame, needle and question), got {length}")
    text = haystack_text(haystack)
    unit = _encode(tokenizer, text)
    hay = (unit * (n_hay // max(len(unit), 1) + 2))[:n_hay]
    ends = [0] + [i + 1 for i, t in enumerate(hay) if tokenizer.decode([t]).rstrip().endswith((".", "!", "?"))]
    if n_hay not in ends:
        ends.append(n_hay)
    at = min(ends, key=lambda e: (abs(e - depth * n_hay), e))
    ids = head_ids + hay[:at] + needle_ids + hay[at:] + question_ids
    assert len(ids) == length
    start = len(head_ids) + at
    from kvviz.decode.generation import token_strings
    return NeedlePrompt(length=length, depth=float(depth), key=key, haystack=haystack, ids=tuple(ids),
                        tokens=token_strings(tokenizer, ids), needle_start=start,
                        needle_end=start + len(needle_ids),
                        question_start=len(head_ids) + n_hay + len(needle_ids),
                        hay_start=len(head_ids))


# --- specs -----------------------------------------------------------------------------------

def budget_tokens(fraction: float, length: int) -> int:
    """The token budget for a fraction of the prompt's tokens (at least MIN_BUDGET_TOKENS)."""
    if not 0.0 < fraction <= 1.0:
        raise SpecError(f"--budget is a fraction of the prompt's tokens in (0, 1], got {fraction:g}")
    return min(length, max(MIN_BUDGET_TOKENS, int(round(fraction * length))))


def spec_for(scorer: str, fraction: float, bits: int, length: int) -> Spec:
    """The cell's Spec: the Model lab's sweep split of the budget (kvviz.decode.generation.SWEEP_METHODS:
    StreamingLLM = 4 sinks + the rest as window; the others 4 sinks, half the budget as
    recent window, the rest heavy), then K/V at `bits` (keys per channel, values per
    token, groups of 32, as kvviz eval's kv-Nbit methods)."""
    from kvviz.decode.generation import SWEEP_METHODS

    if scorer not in SCORER_NAMES:
        raise SpecError(f"unknown scorer {scorer!r}; choose from {', '.join(SCORER_NAMES)}")
    quant: dict[str, Any] = {}
    if bits != FULL_BITS:
        quant = dict(key_bits=bits, value_bits=bits, key_axis="channel", value_axis="token", group_size=32)
    if scorer == FULL:
        return Spec(**quant)
    b = budget_tokens(fraction, length)
    make = SWEEP_METHODS.get(scorer, SWEEP_METHODS["h2o"])
    return make(b).with_(scorer=scorer, **quant)


# --- cells -----------------------------------------------------------------------------------

def _pack(mask: np.ndarray) -> str:
    return base64.b64encode(np.packbits(mask.astype(bool), axis=None).tobytes()).decode("ascii")


def _unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))
    return bits[: int(np.prod(shape))].reshape(shape).astype(bool)


@dataclass(frozen=True)
class NeedleCell:
    """One (scorer, budget, bits) on one prompt. Everything here round-trips through JSON exactly."""

    scorer: str
    length: int
    depth: float
    budget: float                    # fraction of the prompt's tokens (1.0 for the full cache)
    bits: int
    question_after_compression: bool
    spec: str                        # Spec.label()
    budget_tokens: int               # tokens each KV head holds
    key: str
    correct: bool
    answer: str
    answer_ids: tuple[int, ...]
    needle_kept: float
    needle_kept_by_head: tuple[tuple[float, ...], ...]   # (layers, kv_heads)
    wanted_mass: float
    wanted_mass_by_head: tuple[tuple[float, ...], ...]
    kept_mass: float
    kept_mass_by_head: tuple[tuple[float, ...], ...]
    full_answer: str
    full_correct: bool
    kept_packed: str = field(default="", repr=False)      # (layers, kv_heads, length) bool, packed bits

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
        d = {"scorer": self.scorer, "length": self.length, "depth": self.depth, "budget": self.budget,
             "bits": self.bits, "question_after_compression": self.question_after_compression,
             "spec": self.spec, "budget_tokens": self.budget_tokens, "key": self.key, "correct": self.correct,
             "answer": self.answer, "answer_ids": list(self.answer_ids), "needle_kept": self.needle_kept,
             "needle_kept_by_head": [list(r) for r in self.needle_kept_by_head],
             "wanted_mass": self.wanted_mass, "wanted_mass_by_head": [list(r) for r in self.wanted_mass_by_head],
             "kept_mass": self.kept_mass, "kept_mass_by_head": [list(r) for r in self.kept_mass_by_head],
             "full_answer": self.full_answer, "full_correct": self.full_correct}
        if kept:
            d["kept_packed"] = self.kept_packed
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NeedleCell":
        grid = lambda rows: tuple(tuple(float(x) for x in r) for r in rows)  # noqa: E731
        return cls(scorer=d["scorer"], length=int(d["length"]), depth=float(d["depth"]), budget=float(d["budget"]),
                   bits=int(d["bits"]), question_after_compression=bool(d["question_after_compression"]),
                   spec=d["spec"], budget_tokens=int(d["budget_tokens"]), key=str(d["key"]),
                   correct=bool(d["correct"]), answer=d["answer"], answer_ids=tuple(int(i) for i in d["answer_ids"]),
                   needle_kept=float(d["needle_kept"]), needle_kept_by_head=grid(d["needle_kept_by_head"]),
                   wanted_mass=float(d["wanted_mass"]), wanted_mass_by_head=grid(d["wanted_mass_by_head"]),
                   kept_mass=float(d["kept_mass"]), kept_mass_by_head=grid(d["kept_mass_by_head"]),
                   full_answer=d["full_answer"], full_correct=bool(d["full_correct"]),
                   kept_packed=d.get("kept_packed", ""))


def score_answer(answer: str, key: str) -> bool:
    """Exact match: the first run of digits in the answer is the key."""
    m = re.search(r"\d+", answer)
    return m is not None and m.group(0) == key


# --- running the model -------------------------------------------------------------------------

@dataclass
class _Prefill:
    """The full model's prefill of one prompt: every layer's q, k, v, and the last logits."""

    q: list            # per layer (Hq, n, D) float32 numpy
    k: Any             # torch (L, H, n, D)
    v: Any
    logits: dict       # position -> torch (vocab,) logits there (the compression points' last tokens)
    scaling: float
    dims: tuple[int, int, int, int]


def _scaling(model, head_dim: int) -> float:
    for module in model.modules():
        s = getattr(module, "scaling", None)
        if isinstance(s, float) and getattr(module, "layer_idx", None) is not None:
            return s
    return head_dim ** -0.5


def prefill(model, ids: Sequence[int], logits_at: Sequence[int] = ()) -> _Prefill:
    """One full-attention pass over the prompt through the compressed-cache attention (compression off).

    Logits are kept at the last position and at `logits_at` only (the vocabulary head
    over every position would cost as much as a third of the model).
    """
    import torch

    from kvviz.decode.generation import CompressedCache, compressed_cache, model_dims

    L, Hq, H, D = model_dims(model)
    n = len(ids)
    at = sorted({n - 1, *(int(p) for p in logits_at)})
    cache = CompressedCache(Spec(), L, Hq, H, D, capacity=n)
    with torch.inference_mode(), compressed_cache(model, cache):
        x = torch.tensor([list(ids)], dtype=torch.long)
        out = model(input_ids=x, position_ids=torch.arange(n)[None], use_cache=False,
                    logits_to_keep=torch.tensor(at))
        rows = out.logits[0].float()
    if rows.shape[0] != len(at):                     # a model without logits_to_keep: every position
        rows = rows[at]
    return _Prefill(q=list(cache.prefill_q), k=cache.k.clone(), v=cache.v.clone(),
                    logits={p: rows[i] for i, p in enumerate(at)}, scaling=_scaling(model, D), dims=(L, Hq, H, D))


def _first_answer_attention(pre: _Prefill, pos: int) -> np.ndarray:
    """(L, Hq, pos + 1) the full model's attention of the query at `pos` (float64)."""
    L, Hq, H, D = pre.dims
    g = Hq // H
    out = np.empty((L, Hq, pos + 1))
    for layer in range(L):
        q = pre.q[layer][:, pos].astype(np.float64)                          # (Hq, D)
        k = pre.k[layer, :, : pos + 1].numpy().astype(np.float64)            # (H, pos+1, D)
        logits = np.einsum("hgd,hnd->hgn", q.reshape(H, g, D), k).reshape(Hq, -1) * pre.scaling
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        out[layer] = e / e.sum(axis=1, keepdims=True)
    return out


def run_cell(model, tokenizer, prompt: NeedlePrompt, pre: _Prefill, spec: Spec,
             question_after_compression: bool = False, new_tokens: int = DEFAULT_NEW_TOKENS,
             attention: np.ndarray | None = None) -> dict:
    """Decode one compressed cache from the shared prefill; the cell's dictionary (no full-cache fields).

    The cache is a copy of the prefill's up to the compression point, compressed by the
    policy exactly as kvviz.decode.generation.decode does (CompressedCache.compress), then the
    question tokens (query-agnostic case) and the answer run one token at a time at their
    true positions through the same attention function the Model lab uses.
    """
    import torch

    from kvviz.decode.generation import CompressedCache, _forward, _indices, compressed_cache
    from kvviz.policies import ScoreContext, select

    L, Hq, H, D = pre.dims
    P = prompt.length
    c = prompt.question_start if question_after_compression else P
    cache = CompressedCache(spec, L, Hq, H, D, capacity=P + new_tokens, tokens=prompt.tokens)
    cache.k[:, :, :c] = pre.k[:, :, :c]
    cache.v[:, :, :c] = pre.v[:, :, :c]
    cache.length = [c] * L
    cache.prefill_q = [q[:, :c].copy() for q in pre.q]
    answer: list[int] = []
    with torch.inference_mode(), compressed_cache(model, cache):
        cache.compress()
        last = pre.logits[c - 1]
        for p in range(c, P):                                    # the question, after compression
            last = _forward(model, [prompt.ids[p]], p)[-1]
        kept_now = [k.copy() for k in cache.kept]                # the cache the first answer step reads
        for i in range(new_tokens):
            tok = int(torch.argmax(last))
            answer.append(tok)
            if i < new_tokens - 1:
                last = _forward(model, [tok], P + i)[-1]
    attn = attention if attention is not None else _first_answer_attention(pre, P - 1)    # (L, Hq, P)
    kept = np.zeros((L, H, P), dtype=bool)
    for layer in range(L):
        idx = kept_now[layer]
        if c == P and cache.policy.needs_query and spec.evicts:
            # default case: the first answer token comes from the prefill; the oracle's set for
            # that query is its top-k of the query's own attention (as its decode steps do)
            idx = _indices(select(cache.policy.query_scores(attn[layer], ScoreContext(cache.trace, layer, spec)),
                                  spec))
        np.put_along_axis(kept[layer], idx, True, axis=1)
    return _measure(prompt, spec, kept, attn, tokenizer, answer, (Hq // H))


def _measure(prompt: NeedlePrompt, spec: Spec, kept: np.ndarray, attn: np.ndarray, tokenizer,
             answer: list[int], group: int) -> dict:
    L, H, P = kept.shape
    ns, ne = prompt.needle_start, prompt.needle_end
    needle_kept = kept[:, :, ns:ne].mean(axis=2)                                  # (L, H)
    on_needle = attn[:, :, ns:ne]                                                 # (L, Hq, k)
    wanted = on_needle.sum(axis=2).reshape(L, H, group).mean(axis=2)              # (L, H)
    kept_q = np.repeat(kept[:, :, ns:ne], group, axis=1)                          # (L, Hq, k)
    kept_mass = (on_needle * kept_q).sum(axis=2).reshape(L, H, group).mean(axis=2)
    text = tokenizer.decode(answer, skip_special_tokens=True)
    r = lambda a: [[float(x) for x in row] for row in a]  # noqa: E731
    return {"spec": spec.label(), "budget_tokens": int(kept[0, 0].sum()), "key": prompt.key,
            "correct": score_answer(text, prompt.key), "answer": text, "answer_ids": [int(t) for t in answer],
            "needle_kept": float(needle_kept.mean()), "needle_kept_by_head": r(needle_kept),
            "wanted_mass": float(wanted.mean()), "wanted_mass_by_head": r(wanted),
            "kept_mass": float(kept_mass.mean()), "kept_mass_by_head": r(kept_mass),
            "kept_packed": _pack(kept)}


# --- the disk cache ---------------------------------------------------------------------------

def cache_dir() -> Path:
    """$KVVIZ_CACHE_DIR/needle, else $XDG_CACHE_HOME/kvviz/needle (next to the app's trace cache)."""
    env = os.environ.get("KVVIZ_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "needle"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvviz" / "needle"


def cell_key(model_id: str, prompt: NeedlePrompt, spec: Spec, question_after_compression: bool,
             new_tokens: int) -> str:
    """sha256 of everything that changes a cell's numbers."""
    from kvviz.version import __version__

    blob = json.dumps({"model": model_id, "ids": list(prompt.ids), "needle": [prompt.needle_start, prompt.needle_end],
                       "question_start": prompt.question_start, "key": prompt.key, "spec": spec.__dict__,
                       "question_after_compression": question_after_compression, "new_tokens": new_tokens,
                       "format": FORMAT_VERSION, "kvviz": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write(path: Path, d: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass                                   # a read-only cache folder: results are still returned


# --- the grid ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NeedleGrid:
    """Every cell of a needle run, with the prompts they were run on."""

    model: str
    settings: dict
    prompts: tuple[NeedlePrompt, ...]
    cells: tuple[NeedleCell, ...]

    def prompt(self, length: int, depth: float) -> NeedlePrompt:
        for p in self.prompts:
            if p.length == length and abs(p.depth - depth) < 1e-9:
                return p
        raise KeyError((length, depth))

    def cell(self, scorer: str, length: int, depth: float) -> NeedleCell:
        for c in self.cells:
            if c.scorer == scorer and c.length == length and abs(c.depth - depth) < 1e-9:
                return c
        raise KeyError((scorer, length, depth))

    @property
    def scorers(self) -> list[str]:
        return list(dict.fromkeys(c.scorer for c in self.cells))

    @property
    def lengths(self) -> list[int]:
        return sorted({c.length for c in self.cells})

    @property
    def depths(self) -> list[float]:
        return sorted({c.depth for c in self.cells})

    def as_dict(self, kept: bool = False, prompts: bool = False) -> dict:
        d: dict[str, Any] = {"model": self.model, "settings": self.settings,
                             "cells": [c.as_dict(kept=kept) for c in self.cells]}
        if prompts:
            d["prompts"] = [p.as_dict() for p in self.prompts]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "NeedleGrid":
        return cls(model=d["model"], settings=dict(d.get("settings", {})),
                   prompts=tuple(NeedlePrompt.from_dict(p) for p in d.get("prompts", [])),
                   cells=tuple(NeedleCell.from_dict(c) for c in d["cells"]))

    def save(self, path: str | Path) -> None:
        blob = json.dumps(self.as_dict(kept=True, prompts=True), separators=(",", ":")).encode("utf-8")
        Path(path).write_bytes(gzip.compress(blob, mtime=0))

    @classmethod
    def load(cls, path: str | Path) -> "NeedleGrid":
        return cls.from_dict(json.loads(gzip.decompress(Path(path).read_bytes()).decode("utf-8")))


def load_default(path: str | Path | None = None) -> NeedleGrid | None:
    """The shipped precomputed default grid (bundled model), or None if it is missing."""
    try:
        return NeedleGrid.load(path or DEFAULT_FILE)
    except (OSError, ValueError, KeyError):
        return None


def check_lengths(lengths: Sequence[int], max_positions: int | None, new_tokens: int, minimum: int) -> None:
    for n in lengths:
        if n < minimum:
            raise SpecError(f"length {n} is too short: a needle prompt needs at least {minimum} tokens for this "
                            "model (frame, needle and question)")
        if max_positions is not None and n + new_tokens > max_positions:
            raise SpecError(f"length {n} + {new_tokens} answer tokens is past the model's {max_positions} "
                            f"positions; use lengths up to {max_positions - new_tokens}")


def max_positions(model) -> int | None:
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


def prompt_key(model_id: str, length: int, depth: float, seed: int, haystack: str) -> str:
    """sha256 of what decides a prompt's tokens (the model's tokenizer by its name, and the texts)."""
    from kvviz.version import __version__

    blob = json.dumps({"model": model_id, "length": length, "depth": depth, "seed": seed, "haystack": haystack,
                       "texts": [NEEDLE_TEMPLATE, QUESTION, PRIMER, INSTRUCTION, FILLER],
                       "format": FORMAT_VERSION, "kvviz": __version__}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def run_grid(model, tokenizer, model_id: str = "bundled", lengths: Sequence[int] = DEFAULT_LENGTHS,
             depths: Sequence[float] = DEFAULT_DEPTHS, scorers: Sequence[str] = DEFAULT_SCORERS,
             budgets: Sequence[float] = (DEFAULT_BUDGET,), bits: Sequence[int] = (FULL_BITS,),
             question_after_compression: bool = False, new_tokens: int = DEFAULT_NEW_TOKENS,
             seed: int = DEFAULT_SEED, haystack: str = "filler", use_cache: bool = True,
             progress: Progress | None = None, stats: dict | None = None,
             load: Callable[[], tuple[Any, Any]] | None = None) -> NeedleGrid:
    """Every (length, depth) prompt x every (scorer, budget, bits) cell.

    One prefill per prompt, only when some cell of it is not on disk yet. With
    model = tokenizer = None and a `load` function, the model is loaded only when a
    prompt or a cell is not on disk (a fully cached rerun needs no model at all).
    `stats`, if given, receives counts of cells computed and read from the cache, and
    the seconds.
    """
    if not lengths or not depths or not scorers:
        raise SpecError("give at least one length, one depth and one scorer")
    bad = [s for s in scorers if s not in SCORER_NAMES]
    if bad:
        raise SpecError(f"unknown scorer {bad[0]!r}; choose from {', '.join(SCORER_NAMES)}")
    if not 1 <= new_tokens <= 64:
        raise SpecError(f"new tokens must be 1-64, got {new_tokens}")
    for b in budgets:
        budget_tokens(b, 1000)
    for b in bits:
        Spec(key_bits=b, value_bits=b)
    if haystack not in HAYSTACKS:
        raise SpecError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    if model is None and load is None:
        raise ValueError("run_grid needs a model and tokenizer, or a load function")
    say = progress or (lambda f, m: None)
    folder = cache_dir()
    held = {"model": model, "tokenizer": tokenizer}

    def need_model():
        if held["model"] is None:
            held["model"], held["tokenizer"] = load()
        return held["model"], held["tokenizer"]

    jobs = [(n, d) for n in lengths for d in depths]
    stored = {}
    for n, d in jobs:
        hit = _read(folder / "prompts" / f"{prompt_key(model_id, n, d, seed, haystack)}.json") if use_cache else None
        if hit is not None:
            stored[(n, d)] = hit
    if len(stored) == len(jobs) and held["model"] is None:
        limits = stored[jobs[0]]
        check_lengths(lengths, limits["max_positions"], new_tokens, limits["min_length"])
    else:
        m, tok = need_model()
        check_lengths(lengths, max_positions(m), new_tokens, min_length(tok))
    prompts, cells = [], []
    computed = cached = 0
    t0 = time.perf_counter()
    variants = [(s, b, q) for s in scorers for b in (budgets if s != FULL else (1.0,)) for q in bits]
    variants = list(dict.fromkeys(variants))
    total = len(jobs) * (len(variants) + 1)
    done = 0
    full_spec = Spec()
    for n, d in jobs:
        if (n, d) in stored:
            prompt = NeedlePrompt.from_dict(stored[(n, d)]["prompt"])
        else:
            m, tok = need_model()
            prompt = build_prompt(tok, n, d, seed=seed, haystack=haystack)
            _write(folder / "prompts" / f"{prompt_key(model_id, n, d, seed, haystack)}.json",
                   {"prompt": prompt.as_dict(), "max_positions": max_positions(m), "min_length": min_length(tok)})
        prompts.append(prompt)
        pre = attn = None

        def get(spec: Spec, qac: bool, what: str) -> dict:
            nonlocal pre, attn, computed, cached
            path = folder / f"{cell_key(model_id, prompt, spec, qac, new_tokens)}.json"
            hit = _read(path) if use_cache else None
            if hit is not None:
                cached += 1
                return hit
            if pre is None:
                if held["model"] is None:
                    say(done / total, "loading the model")
                m, _ = need_model()
                say(done / total, f"length {n}, depth {d:.0%}: prefill")
                pre = prefill(m, prompt.ids, logits_at=[prompt.question_start - 1])
                attn = _first_answer_attention(pre, n - 1)
            say(done / total, f"length {n}, depth {d:.0%}: {what}")
            m, tok = need_model()
            out = run_cell(m, tok, prompt, pre, spec, qac, new_tokens, attention=attn)
            computed += 1
            _write(path, out)
            return json.loads(json.dumps(out))           # exactly what a later read returns

        full = get(full_spec, False, "full cache")
        done += 1
        for scorer, frac, b in variants:
            spec = spec_for(scorer, frac, b, n)
            qac = question_after_compression and spec != full_spec
            out = full if (spec == full_spec) else get(spec, qac, f"{scorer} {frac:g} {b}-bit")
            done += 1
            cells.append(NeedleCell.from_dict({
                **out, "scorer": scorer, "length": n, "depth": float(d), "budget": 1.0 if scorer == FULL else frac,
                "bits": b, "question_after_compression": qac, "full_answer": full["answer"],
                "full_correct": full["correct"]}))
    say(1.0, f"{len(cells)} cells: {computed} computed, {cached} from the cache")
    if stats is not None:
        stats.update(computed=computed, cached=cached, seconds=time.perf_counter() - t0)
    settings = {"lengths": list(lengths), "depths": [float(x) for x in depths], "scorers": list(scorers),
                "budgets": [float(b) for b in budgets], "bits": list(bits),
                "question_after_compression": question_after_compression, "new_tokens": new_tokens,
                "seed": seed, "haystack": haystack}
    return NeedleGrid(model=model_id, settings=settings, prompts=tuple(prompts), cells=tuple(cells))


CSV_FIELDS = ("scorer", "length", "depth", "budget", "bits", "question_after_compression", "budget_tokens",
              "key", "correct", "answer", "full_answer", "full_correct", "needle_kept", "wanted_mass",
              "kept_mass", "spec")


def to_csv(grid: NeedleGrid) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for c in grid.cells:
        d = c.as_dict()
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in d.items() if k in CSV_FIELDS})
    return buf.getvalue()


def format_grid(grid: NeedleGrid) -> str:
    """Plain-text grid: one block per scorer (and budget/bits), rows = depth, columns = length."""
    lines = []
    groups = list(dict.fromkeys((c.scorer, c.budget, c.bits) for c in grid.cells))
    lengths = grid.lengths
    for scorer, budget, bits in groups:
        title = scorer if scorer == FULL else f"{scorer} {budget:g}"
        if bits != FULL_BITS:
            title += f" {bits}-bit"
        lines.append(f"{title:<18}" + "".join(f"{n:>14}" for n in lengths))
        for d in grid.depths:
            row = []
            for n in lengths:
                c = next((c for c in grid.cells if (c.scorer, c.budget, c.bits, c.length) == (scorer, budget, bits, n)
                          and abs(c.depth - d) < 1e-9), None)
                row.append("" if c is None else f"{'ok' if c.correct else 'MISS'} {c.needle_kept:4.0%}")
            lines.append(f"  depth {d:>4.0%}      " + "".join(f"{r:>14}" for r in row))
        n_ok = sum(c.correct for c in grid.cells if (c.scorer, c.budget, c.bits) == (scorer, budget, bits))
        n_all = sum(1 for c in grid.cells if (c.scorer, c.budget, c.bits) == (scorer, budget, bits))
        lines.append(f"  correct {n_ok}/{n_all}")
    lines.append("cells: ok/MISS = the key exactly right or not; % = needle tokens kept over all layers x KV heads")
    return "\n".join(lines)


# --- what the page opens on ----------------------------------------------------------------------

def classic_failure(grid: NeedleGrid) -> tuple[str, int, float] | None:
    """The classic failure to show in one click: StreamingLLM (else any policy) wrong where the
    full cache is right, the needle nearest the start, at the shortest such length."""
    for scorer in ("streaming", *[s for s in grid.scorers if s not in ("streaming", FULL)]):
        bad = [c for c in grid.cells if c.scorer == scorer and not c.correct and c.full_correct]
        if bad:
            c = min(bad, key=lambda c: (c.depth, c.length))
            return c.scorer, c.length, c.depth
    return None


def loudest_head(cell: NeedleCell) -> tuple[int, int]:
    """(layer, KV head) where the full model wanted the needle most (where a loss hurts most)."""
    w = np.asarray(cell.wanted_mass_by_head)
    layer, head = np.unravel_index(int(np.argmax(w)), w.shape)
    return int(layer), int(head)
