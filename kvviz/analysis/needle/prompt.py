"""The needle test's prompts and specs: a passkey hidden at a depth of a haystack, and the budget a
policy gets at a length. See kvviz.analysis.needle for the test as a whole."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from dataclasses import dataclass
from typing import Any


from kvviz.analysis.needle.records import from_record, to_record
from kvviz.analysis.needle.tasks import PRIMER, TASKS
from kvviz.policies.registry import featured
from kvviz.spec import FULL_BITS, SCORERS, Spec, SpecError

FORMAT_VERSION = 1
INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)  # before the haystack
# The classic passkey filler (plain, repeated); the other haystack is kvviz's own sample text.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HAYSTACKS = ("filler", "sample")
FULL = "full"  # the uncompressed cache's name in `scorers`
SCORER_NAMES = (FULL, *SCORERS)
DEFAULT_LENGTHS = (320, 640, 1024)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_SCORERS = (FULL, *featured())
DEFAULT_BUDGET = 0.25
DEFAULT_NEW_TOKENS = 8
DEFAULT_SEED = 0
MIN_BUDGET_TOKENS = 8  # 4 sinks + a window

Progress = Callable[[float, str], None]


# --- prompts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeedlePrompt:
    """One needle prompt as token ids, with where the needle and the question sit."""

    length: int  # tokens (the whole prompt)
    depth: float  # asked-for share of the haystack before the needle
    key: str
    haystack: str
    ids: tuple[int, ...]
    tokens: tuple[str, ...]  # display string of every token
    needle_start: int  # needle tokens: [needle_start, needle_end)
    needle_end: int
    # first token after the haystack: the query-agnostic compression point
    question_start: int
    hay_start: int = 0  # first haystack token (after the chat template's head)
    task: str = "passkey"  # what is hidden and asked (kvviz.analysis.needle.tasks)

    @property
    def needle_depth(self) -> float:
        """The needle's actual depth: share of the haystack tokens before it."""
        hay = self.question_start - (self.needle_end - self.needle_start) - self.hay_start
        return (self.needle_start - self.hay_start) / hay if hay > 0 else 0.0

    def as_dict(self) -> dict:
        return to_record(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NeedlePrompt":
        return from_record(cls, d)


def passkey(seed: int, length: int, depth: float) -> str:
    """A 5-digit key, the same for the same (seed, length, depth), different across cells."""
    return TASKS["passkey"].instance(seed, length, depth).key


def haystack_text(name: str) -> str:
    if name == "filler":
        return FILLER
    if name == "sample":
        from kvviz.decode.quality import sample_text

        return " ".join(sample_text().split()) + " "
    raise SpecError(f"unknown haystack {name!r}; choose from {', '.join(HAYSTACKS)}")


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _frame(tokenizer, primer: str = PRIMER) -> tuple[str, str]:
    """(text before the user's content, text after it up to the primed answer)."""
    mark = "\u0000USER\u0000"
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": mark}, {"role": "assistant", "content": primer}],
                tokenize=False,
                continue_final_message=True,
            )
            if text.count(mark) == 1 and text.rstrip().endswith(primer.rstrip()):
                head, tail = text.split(mark)
                return head, tail
        except Exception:  # noqa: BLE001 - a template that cannot do this: plain text below
            pass
    return "", f"\n\nAnswer: {primer}"


def min_length(tokenizer, task: str = "passkey") -> int:
    """The shortest prompt that holds the frame, the needle and the question (no haystack)."""
    shown = TASKS[task].instance(DEFAULT_SEED, 1000, 0.5)
    head, tail = _frame(tokenizer, shown.primer)
    return (
        len(_encode(tokenizer, head + INSTRUCTION))
        + len(_encode(tokenizer, " " + shown.needle))
        + len(_encode(tokenizer, "\n\n" + shown.question + tail))
    )


def build_prompt(
    tokenizer, length: int, depth: float, seed: int = DEFAULT_SEED, haystack: str = "filler", task: str = "passkey"
) -> NeedlePrompt:
    """The needle prompt of exactly `length` tokens with the needle at `depth` of the haystack.

    The pieces are tokenized apart and joined as ids, so the needle's tokens are known
    exactly; the haystack is cut to fill the length, and the needle goes in at the
    sentence end nearest to `depth` of it.
    """
    if not 0.0 <= depth <= 1.0:
        raise SpecError(f"depths are fractions of the haystack in [0, 1], got {depth:g}")
    if task not in TASKS:
        raise SpecError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    shown = TASKS[task].instance(seed, length, depth)
    head, tail = _frame(tokenizer, shown.primer)
    head_ids = _encode(tokenizer, head + INSTRUCTION)
    needle_ids = _encode(tokenizer, " " + shown.needle)
    question_ids = _encode(tokenizer, "\n\n" + shown.question + tail)
    n_hay = length - len(head_ids) - len(needle_ids) - len(question_ids)
    if n_hay < 0:
        raise SpecError(
            f"a needle prompt needs at least {length - n_hay} tokens for this model "
            f"(frame, needle and question), got {length}"
        )
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
    from kvviz.decode.quality import token_strings

    return NeedlePrompt(
        length=length,
        depth=float(depth),
        key=shown.key,
        haystack=haystack,
        ids=tuple(ids),
        tokens=token_strings(tokenizer, ids),
        needle_start=start,
        needle_end=start + len(needle_ids),
        question_start=len(head_ids) + n_hay + len(needle_ids),
        hay_start=len(head_ids),
        task=task,
    )


# --- specs -----------------------------------------------------------------------------------


def budget_tokens(fraction: float, length: int) -> int:
    """The token budget for a fraction of the prompt's tokens (at least MIN_BUDGET_TOKENS)."""
    if not 0.0 < fraction <= 1.0:
        raise SpecError(f"--budget is a fraction of the prompt's tokens in (0, 1], got {fraction:g}")
    return min(length, max(MIN_BUDGET_TOKENS, int(round(fraction * length))))


def spec_for(scorer: str, fraction: float, bits: int, length: int) -> Spec:
    """The cell's Spec: the Model lab's sweep split of the budget (kvviz.decode.eval_sweep.SWEEP_METHODS:
    StreamingLLM = 4 sinks + the rest as window; the others 4 sinks, half the budget as
    recent window, the rest heavy), then K/V at `bits` (keys per channel, values per
    token, groups of 32, as kvviz eval's kv-Nbit methods)."""
    from kvviz.decode.eval_sweep import SWEEP_METHODS, split_spec
    from kvviz.policies import get_policy

    if scorer not in SCORER_NAMES and scorer not in SWEEP_METHODS:
        raise SpecError(f"unknown scorer {scorer!r}; choose from {', '.join(SCORER_NAMES)}")
    quant: dict[str, Any] = {}
    if bits != FULL_BITS:
        quant = dict(key_bits=bits, value_bits=bits, key_axis="channel", value_axis="token", group_size=32)
    if scorer == FULL:
        return Spec(**quant)
    b = budget_tokens(fraction, length)
    # a sweep method by its name (an allocation over a scorer: adakv-snapkv), else the sweep's split
    make = SWEEP_METHODS.get(scorer) or partial(split_spec, scorer)
    spec = make(b).with_(**quant)
    return get_policy(spec.scorer).fit_budget(spec, b, length)  # a method that keeps its own count
