"""What a Model lab run is asked to do: its settings (LabSettings), the page's opening ones, the settings a
text too short for the asked prompt can run (fit_to_text), and whether a spec scores the continuation in
one masked pass or step by step (one_pass), on which how a run goes and how long it takes depend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvviz.spec import Spec

DEFAULT_MODEL = "bundled"
DEFAULT_PROMPT, DEFAULT_CONTINUATION, DEFAULT_GREEDY = 206, 57, 32


@dataclass(frozen=True)
class LabSettings:
    model: str
    text: str
    prompt_tokens: int
    continuation: int
    greedy_tokens: int
    spec: Spec
    device: str = "cpu"  # where the model and its compressed cache run (cpu, cuda:N, mps)
    # the weights' dtype, which the cache keeps (float32, bfloat16, float16)
    dtype: str = "float32"
    # a question after the prompt's first prompt_tokens tokens (kvviz.decode.quality.reference); "" = none
    question: str = ""
    # where the cache is compressed when there is a question: before it (query-agnostic, kvpress's pipeline
    # default) or after it (query-aware); kvviz.decode.quality.QUESTION_POINTS
    question_point: str = "before-question"

    def key(self) -> tuple:
        return (
            self.model,
            self.text,
            self.prompt_tokens,
            self.continuation,
            self.greedy_tokens,
            tuple(sorted(self.spec.__dict__.items())),
            self.device,
            self.dtype,
            self.question,
            self.question_point if self.question else "",
        )


def default_settings(spec: Spec | None = None) -> LabSettings:
    """The page's opening settings: the sample text, 206 + 57 tokens, 32 greedy, the sidebar's default spec
    (what a link without settings describes, kvviz.links: the app's defaults, not Spec()'s)."""
    from kvviz import links
    from kvviz.decode.quality import sample_text

    spec = spec or links.spec_from_values(links.defaults())
    return LabSettings(DEFAULT_MODEL, sample_text(), DEFAULT_PROMPT, DEFAULT_CONTINUATION, DEFAULT_GREEDY, spec)


def fit_to_text(settings: LabSettings, n_ids: int) -> LabSettings:
    """The settings a text of n_ids tokens can run. Unchanged where the text is longer than the prompt;
    otherwise the prompt is shortened so that the asked continuation, at most half the text, is left to
    score (a 177-token story against the page's 206-token default prompt: 120 + 57). A text of fewer than
    two tokens cannot be split and is left to the run's own error."""
    if n_ids > settings.prompt_tokens or n_ids < 2:
        return settings
    continuation = max(1, min(settings.continuation, n_ids // 2))
    return dataclasses.replace(settings, prompt_tokens=n_ids - continuation, continuation=continuation)


def one_pass(spec: Spec) -> bool:
    """Does teacher forcing under this spec run as one masked pass (see CompressedCache.block_ok)?"""
    from kvviz.policies import get_policy

    policy = get_policy(spec.scorer)
    return not (spec.evicts and (policy.streaming or policy.needs_query or spec.compress_every))
