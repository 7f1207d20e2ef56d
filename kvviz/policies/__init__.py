"""Eviction policies: one small class a file, each with one `score`; `base` does the bookkeeping.

    base        Policy and ScoreContext: scores -> kept masks at the compression point and per step
    reads       the score cache's key: the Spec fields a scorer is seen to read (never listed by hand)
    select      the budget rule (sinks + recent + top heavy) and its streaming form
    allocation  AdaKV / PyramidKV budgets over heads and layers
    recompress  compression during decoding: scored again every N decode steps (decoding: its setting, rule)
    merging     evicted values merged into the kept ones instead of dropped (kvpress MergingPress): setting, fold
    registry    POLICIES by name, get_policy, plug-ins (entry points and files)
    h2o, tova, snapkv, ...   the scorers

May import: the core (trace, spec, settings, attention). Adding a policy = adding a file: the registry finds
every Policy subclass with a name in this package, and the file declares its settings (kvviz.settings).
"""

from kvviz.policies.base import Policy, ScoreContext
from kvviz.policies.registry import POLICIES, get_policy
from kvviz.policies.select import evict_one, select

__all__ = ["POLICIES", "Policy", "ScoreContext", "evict_one", "get_policy", "select"]
