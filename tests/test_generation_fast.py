"""The fast paths of compressed decoding (kvviz.decode) against the exact step loop:
one shared prefill, teacher forcing in one masked pass for one-shot policies, and the
quantized cache quantizing a token (or a group) once. Tiny random Llama: fast, exact."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvviz.spec import Spec  # noqa: E402
from kvviz import decode as gen  # noqa: E402
from kvviz.decode import hook  # noqa: E402
from kvviz.decode.loop import decode, prefill  # noqa: E402


ONE_SHOT = [
    Spec(sink=2, recent=6, heavy=6, scorer="snapkv"),
    Spec(sink=4, recent=8, scorer="streaming"),
    Spec(sink=0, recent=9, scorer="streaming"),
    Spec(sink=2, recent=5, heavy=7, scorer="knorm"),
    Spec(sink=2, recent=5, heavy=7, scorer="random", seed=3),
    Spec(key_bits=2, value_bits=2, group_size=4, residual=3),  # KIVI axes
    Spec(key_bits=2, value_bits=4, key_axis="token", group_size=8, residual=0),
    Spec(key_bits=3, value_bits=2, group_size=4, residual=2, partial="quantize", symmetric=True),
    Spec(sink=2, recent=6, heavy=6, scorer="snapkv", key_bits=2, value_bits=2, group_size=4, residual=2),
    Spec(sink=2, recent=5, heavy=7, scorer="knorm", key_bits=4, value_bits=4, key_axis="token", group_size=8),
    Spec(sink=4, recent=8, scorer="streaming", positions="cache"),
    Spec(),
]


@pytest.mark.parametrize("spec", ONE_SHOT, ids=lambda s: s.label())
def test_one_masked_pass_equals_the_step_loop(tiny, spec):
    model, ids = tiny
    n, steps = 24, 30
    loop, _, c1 = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps])
    pre = prefill(model, ids[: n + steps + 1])
    fast, fed, c2 = decode(model, ids[:n], spec, steps, feed=ids[n : n + steps], prefix=pre, block=True)
    assert c2.block, "the one-shot spec did not take the masked pass"
    assert fed == ids[n : n + steps] and fast.shape == loop.shape == (steps + 1, 97)
    assert (fast - loop).abs().max() < 1e-5
    for a, b in zip(c1.kept, c2.kept):  # the same cache at the end
        assert np.array_equal(a, b)
    if spec.evicts or spec.quantizes:  # and it does compress
        full, _ = gen.plain_decode(model, ids[:n], steps, feed=ids[n : n + steps])
        assert (fast - full).abs().max() > 1e-3


@pytest.mark.parametrize(
    "spec",
    [
        Spec(sink=2, recent=5, heavy=7, scorer="h2o"),
        Spec(sink=2, recent=5, heavy=7, scorer="tova"),
        Spec(sink=1, recent=3, heavy=4, scorer="oracle"),
    ],
    ids=lambda s: s.scorer,
)
def test_streaming_policies_keep_the_step_loop(tiny, spec):
    model, ids = tiny
    loop, _, _ = decode(model, ids[:24], spec, 12, feed=ids[24:36])
    fast, _, cache = decode(model, ids[:24], spec, 12, feed=ids[24:36], prefix=prefill(model, ids[:40]), block=True)
    assert not cache.block
    assert (fast - loop).abs().max() < 1e-5


def test_shared_prefill_is_the_prompts_own_prefill(tiny):
    """The first n positions of one pass over n + m tokens are the prefill of the first n."""
    model, ids = tiny
    pre = prefill(model, ids[:50])
    with torch.inference_mode():
        own = model(input_ids=torch.tensor([ids[:50]]), use_cache=False).logits[0]
    assert (pre.logits - own).abs().max() < 1e-4  # our attention = the model's eager one
    short = prefill(model, ids[:20])
    assert (pre.logits[:20] - short.logits).abs().max() < 1e-5
    assert torch.allclose(pre.k[:, :, :20], short.k, atol=1e-5) and np.allclose(pre.q[:, :, :20], short.q, atol=1e-5)
    assert pre.covers(ids[:20]) and not pre.covers(ids[1:21]) and not pre.covers(ids[:51])
    # a greedy run from the shared prefill gives the same tokens as one that runs its own
    spec = Spec(sink=2, recent=4, scorer="streaming")
    streamed = []
    got = gen.greedy(model, ids[:20], spec, 10, prefix=pre, on_token=lambda i, t: streamed.append((i, t)))
    assert got == gen.greedy(model, ids[:20], spec, 10)
    assert streamed == list(enumerate(got))


def test_evaluate_one_pass_equals_step_loop(tiny):
    """evaluate() (shared prefill + masked pass) gives the step loop's quality numbers."""
    model, ids = tiny
    ref = gen.reference(model, _Tok(), ids[:50], 24, 26)
    spec = Spec(sink=2, recent=6, heavy=6, scorer="snapkv", key_bits=4, value_bits=4, group_size=4)
    fast = gen.evaluate(model, ref, spec)
    slow = gen.evaluate(model, ref, spec, block=False)
    np.testing.assert_allclose(fast.nll, slow.nll, atol=1e-5)
    np.testing.assert_allclose(fast.kl, slow.kl, atol=1e-5)
    assert np.array_equal(fast.top1, slow.top1) and fast.kv_bytes == slow.kv_bytes


class _Tok:
    def decode(self, xs):
        return f"t{xs[0]}"


def test_an_interrupted_greedy_run_leaves_the_model_usable(tiny):
    model, ids = tiny

    class Stop(Exception):
        pass

    def stop(i, t):
        if i == 3:
            raise Stop

    with pytest.raises(Stop):
        gen.greedy(model, ids[:20], Spec(sink=2, recent=4), 10, on_token=stop)
    assert model.config._attn_implementation == "eager" and not hook._ACTIVE


def test_batched_runs_equal_separate_runs(tiny):
    """decode_many: a full-cache greedy run, a compressed greedy run and an H2O teacher-forced
    run in one batched loop give what each gives alone."""
    model, ids = tiny
    n = 24
    specs = [Spec(), Spec(sink=2, recent=4, scorer="streaming"), Spec(sink=2, recent=5, heavy=7, scorer="h2o")]
    steps, feeds = [7, 7, 15], [None, None, ids[n : n + 15]]
    seen = []
    out = gen.decode_many(
        model,
        ids[:n],
        specs,
        steps,
        feeds,
        prefix=prefill(model, ids[:40]),
        on_step=lambda r, i, _: seen.append((r, i)),
    )
    for (logits, fed, cache), spec, st, feed in zip(out, specs, steps, feeds):
        alone, fed_alone, c = decode(model, ids[:n], spec, st, feed=feed)
        assert fed == fed_alone and logits.shape == alone.shape
        assert (logits - alone).abs().max() < 1e-4
        assert all(np.array_equal(a, b) for a, b in zip(cache.kept, c.kept))
    assert len(seen) == sum(steps) and seen[:3] == [(0, 0), (1, 0), (2, 0)]
