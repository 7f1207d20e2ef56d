"""Quality against the full cache on the same text: the full-cache reference (one forward pass over
prompt + continuation) and a compressed run's teacher-forced quality against it. The greedy texts of both
caches side by side are kvviz.decode.sidebyside.

Teacher-forced: the prompt is the first N tokens, the continuation the next M. The first
continuation token is predicted by the prefill, before any compression (as in real
serving); each later one by a decode step that reads the compressed cache.

    perplexity  = exp(mean_t  -log p_hat(x_t | x_<t))
    KL_t        = sum_v p(v | x_<t) (log p(v | x_<t) - log p_hat(v | x_<t))     nats
    top-1       = mean_t [argmax p_hat = argmax p]

torch is imported lazily.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvviz.decode.cache import CompressedCache, Progress
from kvviz.decode.reconstruct import repeat_prompt
from kvviz.decode.loop import Prefill, decode, prefill
from kvviz.models.config import model_dims, prefill_work
from kvviz.engine import memory_for
from kvviz.spec import Spec, SpecError

# the longest prompt asked for at all: the model's positions and the work budget decide
MAX_PROMPT_TOKENS = 131072
MAX_NEW_TOKENS = 512
# Where a run with a question compresses the cache: before the question (query-agnostic: the context is
# compressed, then the question's tokens are decoded through the compressed cache, as kvpress's pipeline does)
# or after it (query-aware: the question's own queries are scored too, kvpress's compress_questions=True)
QUESTION_POINTS = ("before-question", "after-question")
DEFAULT_QUESTION_POINT = "before-question"
QUESTION_SEPARATOR = "\n\n"  # the question starts a paragraph of its own after the context
# ~470 tokens of plain English
SAMPLE_TEXT_FILE = str(Path(__file__).resolve().parents[1] / "data" / "sample.txt")


def sample_text() -> str:
    """The bundled English sample (written for kvviz) used by tests, demos and defaults."""
    with open(SAMPLE_TEXT_FILE, encoding="utf-8") as f:
        return f.read()


@dataclass(frozen=True, eq=False)
class Reference:
    """The full-cache model on one text: token ids and the continuation's true log-probs."""

    ids: tuple[int, ...]
    prompt_len: int
    tokens: tuple[str, ...]  # display strings of every token
    # torch (M, vocab) full-cache log-probs predicting each continuation token
    logp: Any
    seconds: float
    # the full-cache pass it came from: compressed runs start from it
    prefill: Prefill | None = None
    # where the question starts (the prompt is ids[:question_start] of context, then the question); None = none
    question_start: int | None = None
    # KVzip's reconstruction prompt (kvviz.decode.reconstruct.RepeatPrompt), or a function giving it
    repeat: Any = None

    def compression_point(self, question_point: str = DEFAULT_QUESTION_POINT) -> int:
        """The position the cache is compressed at (the first token not in it): the prompt's end, or with a
        question and "before-question" the question's start."""
        if question_point not in QUESTION_POINTS:
            raise SpecError(f"the compression point is one of {', '.join(QUESTION_POINTS)}, got {question_point!r}")
        if self.question_start is None or question_point == "after-question":
            return self.prompt_len
        return self.question_start

    @property
    def n_continuation(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def targets(self) -> np.ndarray:
        return np.asarray(self.ids[self.prompt_len :])


def token_strings(tokenizer, ids: Sequence[int]) -> tuple[str, ...]:
    """Each token as the text it adds (leading spaces kept)."""
    return tuple(tokenizer.decode([int(i)]) for i in ids)


def tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def check_lengths(
    n_ids: int,
    prompt_tokens: int,
    continuation_tokens: int | None,
    max_prompt: int = MAX_PROMPT_TOKENS,
    max_new: int = MAX_NEW_TOKENS,
) -> tuple[int, int]:
    """Validated (prompt length, continuation length) for a text of n_ids tokens."""
    if prompt_tokens < 1:
        raise SpecError(f"the prompt needs at least 1 token, got {prompt_tokens}")
    if prompt_tokens > max_prompt:
        raise SpecError(f"the prompt is capped at {max_prompt} tokens (asked for {prompt_tokens})")
    if n_ids <= prompt_tokens:
        raise SpecError(
            f"the text has {n_ids} tokens: nothing is left after a {prompt_tokens}-token prompt; "
            "use a longer text or a shorter prompt (fewer prompt tokens)"
        )
    if continuation_tokens is None:  # the rest of the text, up to the cap
        return prompt_tokens, min(n_ids - prompt_tokens, max_new)
    m = min(continuation_tokens, n_ids - prompt_tokens)
    if m < 1:
        raise SpecError(f"the continuation needs at least 1 token, got {continuation_tokens}")
    if m > max_new:
        raise SpecError(
            f"the continuation is capped at {max_new} tokens (asked for {m}); use fewer continuation tokens"
        )
    return prompt_tokens, m


def max_positions(model) -> int | None:
    """The positions the model was trained for (max_position_embeddings), or None when it does not say."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


def check_positions(model, n_tokens: int) -> None:
    """One line when prompt + continuation run past the model's positions."""
    top = max_positions(model)
    if top is not None and n_tokens > top:
        raise SpecError(
            f"prompt + continuation is {n_tokens:,} tokens, past the model's {top:,} positions; "
            "use fewer prompt or continuation tokens"
        )


def question_ids(tokenizer, question: str) -> list[int]:
    """The question's tokens as they follow a context: a paragraph of its own, no special tokens."""
    text = question.strip()
    if not text:
        return []
    return list(tokenizer(QUESTION_SEPARATOR + text, add_special_tokens=False)["input_ids"])


def reference(
    model,
    tokenizer,
    text_or_ids: str | Sequence[int],
    prompt_tokens: int,
    continuation_tokens: int | None = None,
    question: str | None = None,
) -> Reference:
    """One full-cache forward pass over prompt + continuation (the quality baseline).

    With a question the text is split: its first `prompt_tokens` tokens are the context, the question's
    tokens follow (a paragraph of its own), and the continuation scored is the text's next tokens. The prompt
    is context + question; Reference.compression_point says where a run compresses."""
    import torch

    ids = tokenize(tokenizer, text_or_ids) if isinstance(text_or_ids, str) else [int(i) for i in text_or_ids]
    n, m = check_lengths(len(ids), prompt_tokens, continuation_tokens)
    q = question_ids(tokenizer, question) if question else []
    if q and n + len(q) > MAX_PROMPT_TOKENS:
        raise SpecError(f"context + question is {n + len(q)} tokens, past the prompt cap of {MAX_PROMPT_TOKENS}")
    ids = ids[:n] + q + ids[n : n + m]
    question_start = n if q else None
    n += len(q)
    check_positions(model, n + m)
    # before the forward pass allocates
    prefill_work(model_dims(model), n + m, "this text").check()
    t0 = time.perf_counter()
    pre = prefill(model, ids)  # the full-cache logits and every layer's q, k, v
    with torch.inference_mode():
        # (m, V) on the host
        logp = torch.log_softmax(pre.logits[n - 1 : n + m - 1].float(), dim=-1).cpu()
    return Reference(
        ids=tuple(ids),
        prompt_len=n,
        tokens=token_strings(tokenizer, ids),
        logp=logp,
        seconds=time.perf_counter() - t0,
        prefill=pre,
        question_start=question_start,
        repeat=partial(repeat_prompt, tokenizer),  # read from the tokenizer only if a run needs it
    )


@dataclass(frozen=True, eq=False)
class Quality:
    """A compressed cache against the full cache on the same continuation (teacher-forced)."""

    spec: Spec
    prompt_len: int
    tokens: tuple[str, ...]  # the M continuation tokens
    nll: np.ndarray  # (M,) -log p_hat of each continuation token (nats)
    nll_full: np.ndarray  # (M,) -log p of it under the full cache
    kl: np.ndarray  # (M,) KL(full || compressed) of the next-token distributions
    top1: np.ndarray  # (M,) compressed-cache argmax
    top1_full: np.ndarray  # (M,) full-cache argmax
    kv_bytes: float  # compressed K+V at the end, all layers / KV heads
    kv_bytes_full: float  # the same tokens in a full fp16 cache
    kept_tokens: int  # tokens per KV head at the end
    total_tokens: int
    seconds: float
    # the position the cache was compressed at (None: the prompt's end) and the question's tokens in the prompt
    compressed_at: int | None = None
    question_tokens: int = 0

    @property
    def perplexity(self) -> float:
        return float(math.exp(self.nll.mean()))

    @property
    def perplexity_full(self) -> float:
        return float(math.exp(self.nll_full.mean()))

    @property
    def kl_mean(self) -> float:
        return float(self.kl.mean())

    @property
    def kl_max(self) -> float:
        return float(self.kl.max())

    @property
    def top1_agreement(self) -> float:
        return float((self.top1 == self.top1_full).mean())

    @property
    def compression_ratio(self) -> float:
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes else float("inf")

    @property
    def memory_ratio(self) -> float:
        return self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else 1.0

    def as_dict(self) -> dict:
        return {
            "spec": self.spec.label(),
            "scorer": self.spec.scorer,
            "sink": self.spec.sink,
            "recent": self.spec.recent,
            "heavy": self.spec.heavy,
            "key_bits": self.spec.key_bits,
            "value_bits": self.spec.value_bits,
            "key_axis": self.spec.key_axis,
            "value_axis": self.spec.value_axis,
            "group_size": self.spec.group_size,
            "residual": self.spec.residual,
            "key_format": self.spec.key_format,
            "value_format": self.spec.value_format,
            "rotate": self.spec.rotate,
            "residual_mode": self.spec.residual_mode,
            "compress_every": self.spec.compress_every,
            "prompt_tokens": self.prompt_len,
            "question_tokens": self.question_tokens,
            "compressed_at": self.prompt_len if self.compressed_at is None else self.compressed_at,
            "continuation_tokens": len(self.tokens),
            "perplexity": self.perplexity,
            "perplexity_full": self.perplexity_full,
            "perplexity_ratio": self.perplexity / self.perplexity_full,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top1_agreement": self.top1_agreement,
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "compression_ratio": self.compression_ratio,
            "memory_ratio": self.memory_ratio,
            "kept_tokens": self.kept_tokens,
            "total_tokens": self.total_tokens,
            "seconds": self.seconds,
        }


# The columns of Quality.as_dict that say how a compressed cache did against the full one and what it held:
# an eval sweep's row and a study's model cell report these
QUALITY_FIELDS = (
    "perplexity",
    "perplexity_full",
    "perplexity_ratio",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "kv_bytes",
    "kv_bytes_full",
    "compression_ratio",
    "memory_ratio",
    "kept_tokens",
    "total_tokens",
)


def evaluate(
    model,
    ref: Reference,
    spec: Spec,
    mode: str = "delete",
    progress: Progress | None = None,
    block: bool = True,
    question_point: str = DEFAULT_QUESTION_POINT,
) -> Quality:
    """Teacher-forced decoding of ref's continuation with the compressed cache vs the full cache.

    Starts from ref's prefill (the prompt is not run again). One-shot policies and
    quantization score the whole continuation in one masked pass (block=True, equal to
    the step loop); streaming policies and the oracle step token by token. With a question and
    question_point "before-question" the cache is compressed at the question's start and the question's
    tokens are decoded through it before the continuation (their logits are not scored).
    """
    n, m = ref.prompt_len, ref.n_continuation
    c = ref.compression_point(question_point)
    t0 = time.perf_counter()
    logits, _, cache = decode(
        model,
        ref.ids[:c],
        spec,
        steps=n - c + m - 1,
        feed=ref.ids[c : n + m - 1],
        mode=mode,
        tokens=ref.tokens,
        prefix=ref.prefill,
        repeat=ref.repeat,
        block=block,
        progress=None if progress is None else (lambda f, msg: progress(f, f"{spec.label()}: {msg}")),
    )
    return quality_from(ref, spec, logits[n - c :], cache, t0, compressed_at=c)


def quality_from(
    ref: Reference, spec: Spec, logits, cache: CompressedCache, t0: float, compressed_at: int | None = None
) -> Quality:
    """Quality of a teacher-forced run's logits (m, vocab) against the reference (see evaluate); the logits
    predict the continuation's tokens (a question decoded before them is cut off by the caller)."""
    import torch

    n = ref.prompt_len
    # (m, V) on the host
    logp_hat = torch.log_softmax(logits.float().cpu(), dim=-1)
    logp = ref.logp.cpu()
    target = torch.as_tensor(ref.targets)[:, None]
    kl = (logp.exp() * (logp - logp_hat)).sum(dim=-1).clamp_min(0.0)  # (m,)
    # each head's own bytes
    mem = memory_for(cache.trace, spec, cache.n_tokens, cache.head_counts())
    return Quality(
        spec=spec,
        prompt_len=n,
        tokens=ref.tokens[n:],
        nll=(-logp_hat.gather(1, target)[:, 0]).numpy().astype(np.float64),
        nll_full=(-logp.gather(1, target)[:, 0]).numpy().astype(np.float64),
        kl=kl.numpy().astype(np.float64),
        top1=logp_hat.argmax(dim=-1).numpy(),
        top1_full=logp.argmax(dim=-1).numpy(),
        kv_bytes=mem.kv_bytes,
        kv_bytes_full=mem.kv_bytes_full,
        kept_tokens=cache.kept_tokens(),
        total_tokens=cache.n_tokens,
        seconds=time.perf_counter() - t0,
        compressed_at=None if compressed_at is None or compressed_at == n else compressed_at,
        question_tokens=0 if ref.question_start is None else n - ref.question_start,
    )
