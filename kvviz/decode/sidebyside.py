"""Greedy text side by side: the full cache's and the compressed cache's greedy continuations of one
prompt (`greedy`, `side_by_side`) and the first token where they part (`first_divergence`). Both start from
one prefill of the prompt; the compressed run may compress at a question's start and read the question
through its compressed cache before it answers. torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvviz.decode.cache import Progress
from kvviz.decode.loop import Prefill, decode, prefill
from kvviz.decode.quality import check_lengths, token_strings, tokenize
from kvviz.spec import Spec, SpecError


@dataclass(frozen=True)
class SideBySide:
    """Greedy continuations of one prompt with the full and the compressed cache."""

    spec: Spec
    prompt: str
    full_ids: tuple[int, ...]
    compressed_ids: tuple[int, ...]
    full_tokens: tuple[str, ...]
    compressed_tokens: tuple[str, ...]
    first_divergence: int | None  # index of the first differing token, None if identical

    @property
    def full_text(self) -> str:
        return "".join(self.full_tokens)

    @property
    def compressed_text(self) -> str:
        return "".join(self.compressed_tokens)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy(
    model,
    prompt_ids: Sequence[int],
    spec: Spec,
    max_new_tokens: int,
    progress: Progress | None = None,
    prefix: Prefill | None = None,
    on_token: Callable[[int, int], None] | None = None,
    compress_at: int | None = None,
) -> list[int]:
    """Greedy continuation (max_new_tokens ids) with the compressed cache.

    prefix: a Prefill covering the prompt (not run again). on_token(i, id) is called as
    each token is chosen, so a caller can stream the text (and stop the run by raising).
    compress_at: compress the cache at this position of the prompt (a question's start), then decode the
    rest of the prompt through it before the answer (default: at the prompt's end).
    """
    import torch

    n = len(prompt_ids)
    c = n if compress_at is None else int(compress_at)
    if not 1 <= c <= n:
        raise SpecError(f"the compression point must be in 1-{n}, got {c}")
    q = n - c  # prompt tokens decoded through the compressed cache
    if prefix is not None and not prefix.covers(prompt_ids):
        prefix = None
    if prefix is None:
        prefix = prefill(model, prompt_ids)
    if on_token is not None and q == 0:
        on_token(0, int(torch.argmax(prefix.logits[n - 1])))

    def step(i: int, last) -> None:
        if i + 1 - q >= 0:  # the logits after the prompt's last token choose answer token 0
            on_token(i + 1 - q, int(torch.argmax(last)))

    logits, fed, _ = decode(
        model,
        prompt_ids[:c],
        spec,
        steps=q + max_new_tokens - 1,
        feed=list(prompt_ids[c:]),
        progress=progress,
        prefix=prefix,
        on_step=step if on_token is not None else None,
    )
    return fed[q:] + [int(torch.argmax(logits[-1]))]


def side_by_side(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    spec: Spec,
    max_new_tokens: int = 48,
    progress: Progress | None = None,
    prefix: Prefill | None = None,
    full_ids: Sequence[int] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    compress_at: int | None = None,
) -> SideBySide:
    """Greedy text of the full cache next to the compressed cache's, first divergence marked.

    Both runs start from one prefill of the prompt (`prefix`, or one made here).
    full_ids: the full cache's greedy ids computed before (they do not depend on the spec).
    on_token streams the compressed run's tokens (see greedy); compress_at: where the compressed run
    compresses (see greedy).
    """
    ids = tokenize(tokenizer, prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    check_lengths(len(ids) + max_new_tokens, len(ids), max_new_tokens)
    say = progress or (lambda f, m: None)
    if prefix is None or not prefix.covers(ids):
        prefix = prefill(model, ids)
    if full_ids is not None and len(full_ids) >= max_new_tokens:
        full = [int(i) for i in full_ids[:max_new_tokens]]
    else:
        full = greedy(
            model, ids, Spec(), max_new_tokens, prefix=prefix, progress=lambda f, m: say(0.5 * f, "full cache: " + m)
        )
    comp = greedy(
        model,
        ids,
        spec,
        max_new_tokens,
        prefix=prefix,
        on_token=on_token,
        progress=lambda f, m: say(0.5 + 0.5 * f, "compressed: " + m),
        compress_at=compress_at,
    )
    return SideBySide(
        spec=spec,
        prompt=prompt if isinstance(prompt, str) else tokenizer.decode(ids),
        full_ids=tuple(full),
        compressed_ids=tuple(comp),
        full_tokens=token_strings(tokenizer, full),
        compressed_tokens=token_strings(tokenizer, comp),
        first_divergence=first_divergence(full, comp),
    )
