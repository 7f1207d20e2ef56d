"""Readable token labels (no torch): what each token adds to the decoded text, whitespace made visible."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

VISIBLE = {" ": "▁", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """Whitespace made visible for token chips: space ▁, newline ↵, tab ⇥."""
    return "".join(VISIBLE.get(c, c) for c in text)


def token_strings(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """Readable text of each token: what it adds to the decoded text, whitespace visible.

    Decoding a token after a few tokens of left context keeps the leading space that
    SentencePiece tokenizers drop at the start of a text; byte-level pieces of one
    character decode to the replacement character.
    """
    ids = [int(i) for i in ids]
    out = []
    for i, tid in enumerate(ids):
        ctx = ids[max(0, i - 3) : i]
        whole = tokenizer.decode(ctx + [tid], clean_up_tokenization_spaces=False)
        head = tokenizer.decode(ctx, clean_up_tokenization_spaces=False) if ctx else ""
        piece = whole[len(head) :] if whole.startswith(head) else tokenizer.decode([tid])
        if piece == "":
            piece = str(tokenizer.convert_ids_to_tokens(tid))
        out.append(visible(piece))
    return tuple(out)
