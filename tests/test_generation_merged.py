"""The fast masked pass against the step loop for the serving formats and the budget
allocations: the pass must give exactly what the loop gives, or the loop must be taken."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz.spec import Spec  # noqa: E402
from kvviz.decode.loop import decode, plain_decode, prefill  # noqa: E402


SPECS = [
    Spec(key_format="e4m3", value_format="e4m3", fp8_scale="head"),
    Spec(key_format="e4m3", value_format="e5m2", fp8_scale="tensor", sink=2, recent=6, heavy=6, scorer="snapkv"),
    Spec(key_format="nvfp4", value_format="mxfp4", rotate="keys-values"),
    Spec(key_bits=2, value_bits=2, key_axis="token", group_size=8, residual=0, rotate="keys"),
    Spec(key_bits=4, value_bits=4, key_axis="token", value_axis="token", group_size=8, residual=5, residual_mode="hf"),
    Spec(sink=2, recent=6, heavy=6, scorer="snapkv", allocation="pyramid", pyramid_beta=4.0),
    Spec(sink=2, recent=6, heavy=6, scorer="snapkv", allocation="adakv"),
    Spec(sink=2, recent=6, heavy=6, scorer="keydiff"),
    Spec(sink=2, recent=6, heavy=6, scorer="expected_attention"),
    Spec(sink=2, recent=4, heavy=8, scorer="chunkkv", chunk_size=4),
    Spec(sink=2, recent=4, heavy=8, scorer="quest", page_size=4),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_the_fast_pass_equals_the_step_loop(tiny, spec):  # noqa: F811
    model, ids = tiny
    n, steps = 24, 20
    loop, _, _ = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps])
    fast, fed, _ = decode(
        model, ids[:n], spec, steps, feed=ids[n : n + steps], prefix=prefill(model, ids[: n + steps + 1]), block=True
    )
    assert fed == ids[n : n + steps]
    assert (fast - loop).abs().max() < 1e-5
    full, _ = plain_decode(model, ids[:n], steps, feed=ids[n : n + steps])
    assert (fast - full).abs().max() > 1e-4  # and it does compress
