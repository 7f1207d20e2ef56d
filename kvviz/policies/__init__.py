"""Eviction policies: one small class a file; `POLICIES` maps scorer name -> instance."""

from .base import Policy, ScoreContext, evict_one, select
from .chunkkv import ChunkKV
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .oracle import Oracle
from .quest import Quest
from .random import Random
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA

POLICIES: dict[str, Policy] = {p.name: p for p in
                               (H2O(), TOVA(), SnapKV(), Streaming(), Oracle(), KNorm(), Random(),
                                ExpectedAttention(), KeyDiff(), ChunkKV(), Quest())}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        from ..plugins import load_entry_points   # installed plug-ins (entry-point group kvviz.policies)
        load_entry_points()
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "Policy", "ScoreContext", "evict_one", "get_policy", "select"]
