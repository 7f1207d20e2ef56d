"""Exact bytes: the Explorer's memory card and the budget ledger count the same bytes.

Both count every (layer, KV head) cache from its own kept tokens (`engine.kept_counts`): AdaKV's
heads hold different numbers, ChunkKV keeps whole chunks, Quest reads per query head. The card
once split an AdaKV layer's budget evenly over its heads while the ledger counted each head.
"""

import numpy as np
import pytest

from kvviz import Spec, View, compare
from kvviz.analysis.ledger import budget_ledger
from kvviz.engine import budget_is_exact, kept_at_query, kept_counts, memory_for
from kvviz.sources.synthetic import make_synthetic
from synthetic_util import small_synthetic

SMALL = small_synthetic(context=150, steps=6, layers=3, n_anchors=5)

# every cache format the spec offers, at settings that exercise its overhead and residual
FORMATS = {
    "16-bit": dict(),
    "kivi-2": dict(key_bits=2, value_bits=2, group_size=32, residual=16),
    "int-4-zp-partial": dict(key_bits=4, value_bits=4, group_size=16, zero_point="int", partial="quantize"),
    "int-3-sym": dict(key_bits=3, value_bits=8, symmetric=True, key_axis="token"),
    "e4m3-tensor": dict(key_format="e4m3", value_format="e4m3", fp8_scale="tensor"),
    "e5m2-token": dict(key_format="e5m2", value_format="e4m3", fp8_scale="token", residual=8),
    "nvfp4": dict(key_format="nvfp4", value_format="nvfp4"),
    "mxfp4-rotated-hf": dict(key_format="mxfp4", value_format="mxfp4", rotate="keys", residual=16, residual_mode="hf"),
    "q4_0-q8_0": dict(key_format="q4_0", value_format="q8_0"),
    "e4m3-static-calibrated": dict(key_format="e4m3", value_format="e4m3", fp8_scale="static", fp8_calibrate=True),
}
ALLOCATIONS = ("uniform", "adakv", "pyramid")
# (scorer, extra settings): budget-filling scorers, the oracle, ChunkKV's whole chunks, Quest's reads
SCORERS = (
    ("snapkv", {}),
    ("expected_attention", {}),
    ("oracle", {}),
    ("chunkkv", {"chunk_size": 12}),
    ("quest", {"page_size": 8}),
    ("h2o", {}),
)
# the integer formats: the others need equal lengths per KV head, refused with AdaKV and Quest per query head
ADAKV_FORMATS = ("16-bit", "kivi-2", "int-4-zp-partial", "int-3-sym")


@pytest.fixture(scope="module")
def trace():
    return make_synthetic(SMALL)


def cases():
    for scorer, extra in SCORERS:
        for allocation in ALLOCATIONS:
            if allocation == "adakv" and scorer in ("h2o", "chunkkv"):
                continue  # refused by the spec (streaming; chunks)
            for fmt, quant in FORMATS.items():
                if allocation == "adakv" and fmt not in ADAKV_FORMATS:
                    continue
                if scorer == "quest" and fmt not in ADAKV_FORMATS:  # (refused per query head: equal lengths)
                    quant = {**quant, "quest_heads": "kv"}
                yield pytest.param(scorer, allocation, fmt, {**extra, **quant}, id=f"{scorer}-{allocation}-{fmt}")


@pytest.mark.parametrize("scorer,allocation,fmt,settings", list(cases()))
def test_memory_card_equals_ledger(trace, scorer, allocation, fmt, settings):
    spec = Spec(sink=2, recent=20, heavy=24, scorer=scorer, allocation=allocation, **settings)
    result = compare(trace, spec, View(layer=1, head=1, ensemble="heads"))
    totals = budget_ledger(trace, spec).totals
    assert result.memory.kv_bytes == pytest.approx(totals["stored_bytes"], rel=1e-12, abs=1e-9)
    assert result.memory.bytes_read == pytest.approx(totals["read_bytes"], rel=1e-12, abs=1e-9)
    assert result.memory.kv_bytes_full == pytest.approx(totals["full_bytes"], rel=1e-12)
    assert result.memory.kv_bytes_peak == pytest.approx(totals["prefill_bytes"], rel=1e-12)
    assert result.memory.peak == pytest.approx(totals["peak_bytes"], rel=1e-12)


def test_adakv_card_counts_each_head_not_an_even_split(trace):
    """The mutation the test above guards: an even split of AdaKV's layer budget gives other bytes."""
    spec = Spec(
        sink=2, recent=20, heavy=24, scorer="snapkv", allocation="adakv", key_bits=2, value_bits=2, group_size=32
    )
    qi = int(trace.evaluated_queries[-1])
    n = int(trace.query_positions[qi]) + 1
    counts = kept_counts(trace, spec, qi)
    assert not budget_is_exact(spec)
    assert len(set(counts.ravel().tolist())) > 1  # the heads really are ragged here
    for layer in range(trace.n_layers):  # each layer's total is the declared one
        assert counts[layer].sum() == trace.n_kv_heads * spec.budget
        assert counts[layer].tolist() == kept_at_query(trace, spec, layer, qi).sum(axis=1).tolist()
    exact = memory_for(trace, spec, n, counts).kv_bytes
    even = memory_for(trace, spec, n).kv_bytes  # what the card showed under the old AdaKV rule
    assert exact != even
    assert exact == pytest.approx(budget_ledger(trace, spec).totals["stored_bytes"], rel=1e-12)


@pytest.mark.parametrize("allocation,heavy", [("pyramid", 24), ("pyramid", 60), ("uniform", 130)])
@pytest.mark.parametrize("step", [0, -1])
@pytest.mark.parametrize("scorer", ["snapkv", "oracle"])
def test_counts_follow_the_budget_where_it_is_exact(trace, allocation, heavy, step, scorer):
    """Pyramid at heavy 60: layers of 128, 82 and 37 tokens; uniform at heavy 130: a budget of 152 tokens,
    one more than the 151 a query at step 0 has seen (it holds those 151)."""
    spec = Spec(sink=2, recent=20, heavy=heavy, scorer=scorer, allocation=allocation)
    qi = int(trace.evaluated_queries[step])
    counts = kept_counts(trace, spec, qi)
    masks = np.stack([kept_at_query(trace, spec, layer, qi).sum(axis=1) for layer in range(trace.n_layers)])
    assert budget_is_exact(spec)
    assert counts.dtype == np.int64 and counts.tolist() == masks.tolist()
    if heavy == 60:
        assert counts[:, 0].tolist() == [128, 82, 37]
    if heavy == 130:
        assert counts.ravel().tolist() == [min(152, int(trace.query_positions[qi]) + 1)] * 6
