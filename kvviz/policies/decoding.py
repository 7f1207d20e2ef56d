"""The `compress_every` setting (compression during decoding, kvpress's DecodingPress) and the rule that
says which scorers take it; what it does is kvviz.policies.recompress.

Its own module because the rule asks the registry about a scorer (streaming? choosing per query?) and the
registry imports the policy base, which runs recompress: the registry loads this module with the scorers.
"""

from __future__ import annotations

from kvviz.policies.allocation import allocation_for
from kvviz.settings import LABELS, Setting, declare, rule
from kvviz.spec import SpecError

MAX_EVERY = 100_000


def one_shot(scorer: str) -> bool:
    """A scorer that decides once from its scores (not every step, not from each query): the ones whose
    Advanced section shows the setting, plug-ins included (the rule below decides what runs)."""
    from kvviz.policies.registry import POLICIES

    policy = POLICIES.get(scorer)
    return policy is not None and not policy.streaming and not policy.needs_query and not policy.ragged


declare(
    Setting(
        "compress_every",
        "int",
        0,
        0,
        MAX_EVERY,
        url="compress_every",
        owner=("scorer", one_shot),
        label="Compress again every N decode steps (0 = once)",
        help="0: the cache is compressed once, at the end of the prompt. N: between compressions the "
        "cache grows; every N decode steps the scorer scores everything it holds again (with the "
        "queries up to that step, generated ones included) and cuts it back to the budget "
        "(kvpress's DecodingPress). One-shot scorers only; a query reads at most budget + N tokens.",
    )
)

LABELS["+compress_every"] = lambda spec: (
    f", compressed again every {spec.compress_every} steps" if spec.compress_every else ""
)


@rule
def _compress_every_needs_one_shot_scores(spec) -> None:
    if not spec.compress_every or not spec.evicts:
        return
    from kvviz.policies.registry import get_policy

    policy = get_policy(spec.scorer)
    if policy.streaming:
        raise SpecError(
            f"{spec.scorer} already decides at every decode step; compressing again every "
            f"{spec.compress_every} steps is for one-shot scorers (SnapKV, Expected Attention, KeyDiff, "
            "K-norm, ...). Set compress every to 0"
        )
    if policy.needs_query:
        raise SpecError(
            f"{spec.scorer} chooses at every query from the query itself; compressing again every "
            f"{spec.compress_every} steps is for one-shot scorers. Set compress every to 0"
        )
    if policy.ragged:
        raise SpecError(
            f"{policy.title or spec.scorer} sets each head's kept tokens once, at the end of the prompt, by its "
            "own rule; compressing again during decoding is for scorers cut to a budget. Set compress every to 0"
        )
    if spec.scorer == "chunkkv" and spec.chunk_rule == "chunks":
        raise SpecError(
            "ChunkKV's whole chunks are cut from position 0 of the prompt; a compressed cache has no "
            "such chunks to cut again. Use ChunkKV's chunk rule 'budget' (chunks filling the heavy "
            "budget), or set compress every to 0"
        )
    if allocation_for(spec).ragged:
        raise SpecError(
            "AdaKV's head budgets are fixed at the prompt's compression point; compressing again "
            "during decoding runs with allocation uniform or pyramid. Set compress every to 0 or "
            "choose another allocation"
        )
