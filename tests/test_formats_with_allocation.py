"""Where the serving formats (FP8, FP4, llama.cpp's blocks) meet the budget allocations and the ledger."""

import pytest

from kvviz import Spec, SpecError, compare, memory_for, View
from kvviz.analysis.ledger import budget_ledger

from test_policies_new import random_trace


@pytest.mark.parametrize(
    "fmt",
    [
        dict(key_format="e4m3", value_format="e4m3"),
        dict(key_format="nvfp4", value_format="mxfp4"),
        dict(key_bits=2, value_bits=2, key_axis="token", rotate="keys"),
        dict(key_bits=4, value_bits=4),
    ],
)
@pytest.mark.parametrize("allocation", ["uniform", "pyramid"])
def test_ledger_bytes_are_the_memory_cards_bytes_in_every_format(fmt, allocation):
    trace = random_trace(3)
    spec = Spec(sink=2, recent=6, heavy=10, scorer="snapkv", allocation=allocation, **fmt)
    ledger = budget_ledger(trace, spec)
    memory = memory_for(trace, spec, ledger.n_tokens)
    assert ledger.totals["stored_bytes"] == pytest.approx(memory.kv_bytes, rel=1e-12)
    assert ledger.totals["full_bytes"] == pytest.approx(memory.kv_bytes_full, rel=1e-12)


def test_fp8_costs_a_byte_a_value_plus_its_scales_in_the_ledger():
    trace = random_trace(4)
    spec = Spec(
        sink=2,
        recent=6,
        heavy=10,
        scorer="snapkv",
        key_format="e4m3",
        value_format="e4m3",
        fp8_scale="token",
        residual=0,
    )
    row = budget_ledger(trace, spec).rows[0]
    kept, d = row["kept_tokens"], trace.head_dim
    assert row["payload_bytes"] == 2 * kept * d  # K and V, 1 byte a value
    assert row["overhead_bytes"] == 2 * kept * 4  # one FP32 scale per token, K and V


def test_adakv_refuses_formats_that_quantize_heads_together():
    with pytest.raises(SpecError, match="AdaKV"):
        Spec(sink=2, recent=6, heavy=10, scorer="snapkv", allocation="adakv", key_format="e4m3")
    Spec(sink=2, recent=6, heavy=10, scorer="snapkv", allocation="adakv", key_bits=4, value_bits=4)  # integer: fine
    trace = random_trace(5)
    c = compare(
        trace,
        Spec(
            sink=2, recent=6, heavy=10, scorer="snapkv", allocation="pyramid", key_format="nvfp4", value_format="nvfp4"
        ),
        View(layer=1),
    )
    assert 0 < c.primary.metrics.mass_retained <= 1
