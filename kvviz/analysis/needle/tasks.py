"""The retrieval tasks a needle prompt can carry, RULER-style: what is hidden, what is asked, how the answer
is scored.

    passkey    one 5-digit pass key (Mohtashami & Jaggi; RULER's single needle)
    multikey   four pass keys, one per coloured door, side by side; one door is asked for (RULER's
               multi-key needle: the distractors are as alike as the answer)
    variable   a chain of assignments, VAR A = 5 digits, VAR B = VAR A, ...; the last name is asked for
               (RULER's variable tracking, one chain)
    qa         one made-up fact (a pet's name) asked as a question, answered in a word (a short QA)

A task makes an instance per (seed, length, depth): the needle's text, the question, the answer's primer
(the assistant's turn is written up to the answer, so the first answer token is the answer's first) and the
key. Scoring is exact: the first run of digits, or the first word, of the greedy answer is the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

NEEDLE_TEMPLATE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key?"
# The assistant's turn is primed up to the key's first digit (the trailing space is its own
# token before the digits, as in " 71432"): the first answer step predicts the first digit.
PRIMER = "The pass key is "
COLOURS = ("red", "blue")
NAMES = ("Biscuit", "Pepper", "Mango", "Ziggy", "Luna", "Waffle", "Nutmeg", "Pickle", "Ginger", "Toffee")
VARIABLES = ("A", "B", "C", "D")


@dataclass(frozen=True)
class Instance:
    """One task instance: the needle sentence(s), the question and the primed answer, and the key."""

    key: str
    needle: str
    question: str
    primer: str


@dataclass(frozen=True)
class Task:
    """A retrieval task (module docstring); `answer` says what the key looks like: digits or a word."""

    name: str
    title: str
    answer: str  # "digits" | "word"

    def instance(self, seed: int, length: int, depth: float) -> Instance:
        cell = [int(seed), int(length), int(round(depth * 1000))]
        # the pass key's draw is the needle test's own; the other tasks draw apart from it
        rng = np.random.default_rng(cell if self.name == "passkey" else [*cell, TASK_NAMES.index(self.name)])
        key = str(int(rng.integers(10000, 100000)))
        if self.name == "passkey":
            return Instance(key, NEEDLE_TEMPLATE.format(key=key), QUESTION, PRIMER)
        if self.name == "multikey":
            keys = [str(int(k)) for k in rng.choice(np.arange(10000, 100000), len(COLOURS), replace=False)]
            ask = int(rng.integers(len(COLOURS)))
            needle = " ".join(f"The {c} pass key is {k}." for c, k in zip(COLOURS, keys))
            return Instance(
                keys[ask], needle, f"What is the {COLOURS[ask]} pass key?", f"The {COLOURS[ask]} pass key is "
            )
        if self.name == "variable":
            other = str(int(rng.integers(10000, 100000)))
            return Instance(
                key,
                f"The box code is {key}. The door code is {other}. The safe code is the same as the box code.",
                "What is the safe code?",
                "The safe code is ",
            )
        name = NAMES[int(rng.integers(len(NAMES)))]
        return Instance(
            name, f"The name of Mira's cat is {name}.", "What is the name of Mira's cat?", "The name of Mira's cat is"
        )

    def score(self, answer: str, key: str) -> bool:
        """Exact match: the first run of digits (or the first word) of the answer is the key."""
        found = re.search(r"\d+" if self.answer == "digits" else r"[A-Za-z]+", answer)
        return found is not None and found.group(0).lower() == key.lower()


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("passkey", "pass key", "digits"),
        Task("multikey", "multi-key", "digits"),
        Task("variable", "variable tracking", "digits"),
        Task("qa", "short QA", "word"),
    )
}
TASK_NAMES = tuple(TASKS)
