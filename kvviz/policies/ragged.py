"""The rules for policies that keep their own number of tokens per head (`Policy.ragged`: a threshold,
DuoAttention, KVzip): no allocation spreads a budget they do not have, and the sinks and window they always
keep hold at least one token (a head is never left with nothing to attend to).

Its own module because the rule asks the registry about a scorer, and the registry imports the policy
base, which imports the allocations: the registry loads this module with the scorers.
"""

from __future__ import annotations

from kvviz.settings import rule
from kvviz.spec import SpecError


def _ragged(spec):
    """The spec's policy if it evicts by its own count, else None. Asks the policies loaded so far: a spec
    naming an installed plug-in does not load its code (that waits until it scores)."""
    from kvviz.policies.registry import POLICIES

    policy = POLICIES.get(spec.scorer) if spec.evicts else None
    return policy if policy is not None and policy.ragged else None


@rule
def _own_head_budgets_keep_a_window(spec) -> None:
    policy = _ragged(spec)
    if policy is not None and spec.sink + spec.recent < 1:
        raise SpecError(
            f"{policy.title or spec.scorer} keeps the sinks and the recent window in every head whatever its rule "
            "drops, so that no head is left with nothing to attend to: set a sink or a recent window of 1 or more"
        )


@rule
def _own_head_budgets_take_no_allocation(spec) -> None:
    policy = _ragged(spec)
    if policy is not None and spec.allocation != "uniform":
        raise SpecError(
            f"{policy.title or spec.scorer} gives each head and layer its own number of tokens by its own rule, "
            f"so there is no budget for {spec.allocation} to spread: use allocation uniform"
        )
