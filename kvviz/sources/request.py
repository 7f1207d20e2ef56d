"""What a capture is asked for, checked before the model runs: the layers kept, the prompt's tokens cut to
the max-tokens limit and the model's positions, the new tokens, and the host memory the run will hold
(`capture_work`, checked against the work budget before any buffer is allocated). No torch here:
kvviz.sources.capture runs the request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvviz.limits import Part, Work
from kvviz.models import ModelInfo
from kvviz.models.config import PREFILL_SCORE_COPIES
from kvviz.sources.recorder import CaptureError

DEFAULT_MAX_TOKENS = 2048
MAX_NEW_TOKENS = 1024


def parse_layers(spec: str | Sequence[int] | None, n_layers: int) -> list[int] | None:
    """'0,1,5' / '0-3' / '2,4-6' / [0, 3] -> sorted layer indices; None = all layers."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    if isinstance(spec, str):
        out: set[int] = set()
        for part in spec.replace(" ", "").split(","):
            try:
                if "-" in part:
                    a, b = part.split("-", 1)
                    if int(b) < int(a):
                        raise ValueError
                    out.update(range(int(a), int(b) + 1))
                else:
                    out.add(int(part))
            except ValueError:
                raise CaptureError(f"cannot read layers {spec!r}: use e.g. 0,1,5 or 0-3") from None
        layers = sorted(out)
    else:
        layers = sorted({int(x) for x in spec})
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad or not layers:
        raise CaptureError(f"layers {bad or spec} do not exist: this model has layers 0-{n_layers - 1}")
    return layers


@dataclass(frozen=True)
class _Request:
    """A capture's prompt tokens and sizes, checked, before anything runs."""

    ids: list[int]
    layers: list[int]  # the model's layer numbers kept
    new_tokens: int
    max_tokens: int
    n_prompt_tokens: int  # before truncation
    notes: tuple[str, ...]

    @property
    def P(self) -> int:
        return len(self.ids)

    @property
    def T(self) -> int:
        return len(self.ids) + self.new_tokens


def _request(
    tokenizer: Any, info: ModelInfo, prompt: str, new_tokens: int, max_tokens: int, layers: str | Sequence[int] | None
) -> _Request:
    """Check the settings and tokenize the prompt, cut to max_tokens (and the model's positions)."""
    if prompt is None or not str(prompt).strip():
        raise CaptureError("the prompt is empty: give some text to capture")
    if not 0 <= int(new_tokens) <= MAX_NEW_TOKENS:
        raise CaptureError(f"new tokens must be between 0 and {MAX_NEW_TOKENS}, not {new_tokens}")
    if int(max_tokens) < 1:
        raise CaptureError(f"max tokens must be at least 1, not {max_tokens}")
    new_tokens, max_tokens = int(new_tokens), int(max_tokens)
    chosen = parse_layers(layers, info.n_layers)
    ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise CaptureError("the prompt is empty after tokenization: give some text to capture")
    notes, total, limit = [], len(ids), max_tokens
    max_pos = info.config.get("max_position_embeddings")
    if max_pos and max_pos - new_tokens < limit:
        limit = max(1, int(max_pos) - new_tokens)
    if total > limit:
        ids = ids[:limit]
        why = (
            f"the max-tokens limit of {max_tokens}"
            if limit == max_tokens
            else f"the model's {max_pos} positions minus {new_tokens} new tokens"
        )
        notes.append(f"the prompt has {total} tokens; kept the first {limit} ({why})")
    return _Request(
        ids, chosen if chosen is not None else list(range(info.n_layers)), new_tokens, max_tokens, total, tuple(notes)
    )


def capture_work(
    dims: tuple[int, int, int, int],
    n_layers: int,
    n_prompt: int,
    n_positions: int,
    attention: str = "eager",
    on_host: bool = True,
    item_bytes: int | None = None,
) -> Work:
    """What a capture allocates in host memory beyond the weights.

    In memory (item_bytes None): the trace's float32 buffers for the recorded layers. To a file
    (item_bytes = the model dtype's): one layer's new rows at a time, on the host twice (the copy off the
    device and its contiguous bytes). Eager attention on the CPU also holds one layer's (query heads,
    prompt, prompt) scores; sdpa works in blocks, and on a GPU the scores are the GPU's memory, not the host's."""
    _, Hq, H, D = dims
    T = (n_positions, "positions")
    if item_bytes is None:
        parts = [
            Part("queries", ((n_layers, "layers"), (Hq, "query heads"), T, (D, "dims"))),
            Part("keys and values", ((2, ""), (n_layers, "layers"), (H, "KV heads"), T, (D, "dims"))),
        ]
    else:
        parts = [
            Part(
                "one layer's queries, keys and values on their way to the file",
                ((2, "copies"), (Hq + 2 * H, "heads"), (n_prompt, "tokens"), (D, "dims")),
                item_bytes,
            )
        ]
    if attention == "eager" and on_host:
        parts.append(
            Part(
                "attention scores",
                ((PREFILL_SCORE_COPIES, ""), (Hq, "query heads"), (n_prompt, "tokens"), (n_prompt, "keys")),
            )
        )
    return Work(
        "this capture",
        tuple(parts),
        lower="Max prompt tokens (--max-tokens), the new tokens or the layers kept (--layers)",
    )
