"""The work budget (kvviz.limits): sizes stated before allocating, one clear refusal, and cancellation
between chunks of long work."""

import gc
import json
import struct
import tracemalloc

import numpy as np
import pytest

from kvviz import Spec, SpecError, View, compare
from kvviz.attention import CHUNK_BYTES, chunk_rows
from kvviz.engine import compare_work
from kvviz.limits import (
    DEFAULT_MAX_BYTES,
    BudgetError,
    Cancelled,
    CancelToken,
    Part,
    Work,
    cancellable,
    checkpoint,
    fmt_bytes,
    max_bytes,
    parse_bytes,
    set_max_bytes,
)
from kvviz.sources import load_trace, save_trace
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.sources.tracefile import trace_from_bytes

HUGE = dict(context=32768, steps=512, layers=32, q_heads=32, kv_heads=8, head_dim=64)


@pytest.fixture(autouse=True)
def default_limit(monkeypatch):
    monkeypatch.delenv("KVVIZ_MAX_BYTES", raising=False)
    set_max_bytes(None)
    yield
    set_max_bytes(None)


def test_the_issue_example_is_named_knob_by_knob():
    queries = Part("queries", ((32, "layers"), (32, "heads"), (33_280, "positions"), (64, "")))
    assert queries.bytes == 32 * 32 * 33_280 * 64 * 4 == 8_724_152_320
    work = Work("this request", (queries,), lower="the context or the heads")
    with pytest.raises(BudgetError) as e:
        work.check(limit=1_500_000_000)
    assert str(e.value) == (
        "this request needs 32 layers × 32 heads × 33,280 positions × 64 × 4 B = 8.7 GB of "
        "queries; the limit is 1.5 GB (KVVIZ_MAX_BYTES): lower the context or the heads"
    )
    assert isinstance(e.value, SpecError) and e.value.work is work and e.value.limit == 1_500_000_000
    assert work.check(limit=queries.bytes) is work  # exactly at the limit is allowed


def test_sizes_and_the_limit_from_the_environment(monkeypatch):
    assert [parse_bytes(x) for x in ("1500000000", "1.5GB", "2.5e9", "800 MB", "2GiB", "64k")] == [
        1_500_000_000,
        1_500_000_000,
        2_500_000_000,
        800_000_000,
        2 * 1024**3,
        64_000,
    ]
    assert [fmt_bytes(x) for x in (8_724_152_320, 512e6, 3000, 12)] == ["8.7 GB", "512 MB", "3.0 kB", "12 B"]
    assert max_bytes() == DEFAULT_MAX_BYTES == 1_500_000_000
    monkeypatch.setenv("KVVIZ_MAX_BYTES", "3GB")
    assert max_bytes() == 3_000_000_000
    set_max_bytes("20GB")  # a program's own (the server option) wins
    assert max_bytes() == 20_000_000_000
    set_max_bytes(None)
    for bad, words in (("lots", "is not a size"), ("1MB", "at least 16.0 MB")):
        monkeypatch.setenv("KVVIZ_MAX_BYTES", bad)
        with pytest.raises(SpecError, match=words):
            max_bytes()


def test_a_synthetic_request_past_the_limit_is_refused_before_any_allocation(monkeypatch):
    tracemalloc.start()
    try:
        with pytest.raises(BudgetError) as e:
            SyntheticSpec(**HUGE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # refused from the knobs alone
    assert str(e.value).startswith(
        "the synthetic pattern needs 32 layers × 32 query heads × 33,280 positions × "
        "64 dims × 4 B = 8.7 GB of queries, 13.2 GB in all with keys and values and "
        "scratch; the limit is 1.5 GB"
    )
    assert e.value.work.bytes == 8_724_152_320 + 2 * 4_362_076_160 // 2 + 6 * 33_280 * 64 * 8 == 13_188_464_640
    spec = SyntheticSpec(context=64, steps=4)
    q, kv = 2 * 4 * 68 * 64 * 4, 2 * 2 * 2 * 68 * 64 * 4
    assert spec.work().bytes == q + kv + 6 * 68 * 64 * 8
    t = make_synthetic(spec)
    assert t.q.nbytes + t.k.nbytes + t.v.nbytes == q + kv  # the stated size is what is allocated
    made = SyntheticSpec(context=8192, layers=4, q_heads=8, kv_heads=8)  # 50 MB: fits 1.5 GB
    monkeypatch.setenv("KVVIZ_MAX_BYTES", "20MB")
    with pytest.raises(BudgetError, match="the limit is 20.0 MB"):
        SyntheticSpec(context=8192, layers=4, q_heads=8, kv_heads=8)
    with pytest.raises(BudgetError, match="the limit is 20.0 MB"):  # made under the old limit
        make_synthetic(made)


def test_a_trace_file_is_checked_from_its_header_before_its_arrays_are_read(tmp_path, monkeypatch):
    """A header that declares a 1000-layer trace is refused from its shapes, whatever the file holds."""
    header = {
        "__metadata__": {
            "format": "kvviz-trace",
            "version": "1",
            "context_len": "4",
            "tokens": json.dumps(["a"] * 4),
            "meta": "{}",
        },
        "q": {"dtype": "F16", "shape": [1000, 64, 32768, 128], "data_offsets": [0, 8]},
        "k": {"dtype": "F32", "shape": [1, 1, 4, 1], "data_offsets": [8, 24]},
        "query_positions": {"dtype": "I64", "shape": [4], "data_offsets": [24, 56]},
    }
    blob = json.dumps(header).encode()
    data = struct.pack("<Q", len(blob)) + blob + bytes(56)
    path = tmp_path / "forged.safetensors"
    path.write_bytes(data)
    import safetensors.numpy

    monkeypatch.setattr(safetensors.numpy, "load", lambda *a, **k: pytest.fail("read the arrays"))
    for load in (lambda: load_trace(path), lambda: trace_from_bytes(data, "forged.safetensors")):
        with pytest.raises(BudgetError) as e:
            load()
        # float16 is widened to float32 when read: 2 + 4 bytes a value
        assert "1,000 layers × 64 query heads × 32,768 positions × 128 dims × 6 B = 1.6 TB of tensor 'q'" in str(
            e.value
        )


def test_a_trace_file_within_the_limit_still_loads(tmp_path):
    path = save_trace(make_synthetic(SyntheticSpec(context=64, steps=4)), tmp_path / "t.safetensors")
    assert load_trace(path).n_positions == 68


def test_compare_states_its_peak_and_refuses_a_seeds_ensemble_of_big_traces(monkeypatch):
    t = make_synthetic(SyntheticSpec(context=64, steps=4))
    work = compare_work(t, True, View(ensemble="heads", ensemble_size=3))
    chunk = chunk_rows(4, 68)
    assert chunk == 512
    assert work.bytes == (
        t.q.nbytes
        + t.k.nbytes
        + t.v.nbytes  # the trace itself
        + 3 * 68 * 12 * 8  # the rows' float64 arrays
        + 2 * 4 * 68 * 64 * 4  # the policy's queries and keys
        + 2 * 4 * 512 * 68 * 4  # attention chunks
        + 3 * 2 * 68
    )  # kept masks
    monkeypatch.setenv("KVVIZ_MAX_BYTES", "16MB")
    spec = SyntheticSpec(context=1024, steps=0, layers=2, q_heads=4, kv_heads=4)  # 6.3 MB a trace
    big = make_synthetic(spec)
    with pytest.raises(BudgetError, match="seed traces"):
        compare(
            big,
            Spec(),
            View(ensemble="seeds", ensemble_size=8),
            trace_for_seed=lambda r: pytest.fail("built a seed trace"),
        )
    assert compare(big, Spec(), View(ensemble="seeds", ensemble_size=8)).members  # no new traces: fits


def test_attention_chunks_stay_under_their_bound():
    assert chunk_rows(4, 544) == 512
    assert chunk_rows(32, 33_280) == CHUNK_BYTES // (4 * 32 * 33_280) == 15
    assert chunk_rows(10_000, 10_000_000) == 1


def test_a_cancel_token_stops_synthetic_generation_at_the_next_head():
    calls = []
    token = CancelToken()

    def check():
        calls.append(1)
        if len(calls) == 3:
            token.cancel()
        token()

    with cancellable(check), pytest.raises(Cancelled):
        make_synthetic(SyntheticSpec(context=64, steps=4, layers=2, q_heads=4, kv_heads=2))
    assert len(calls) == 3  # stopped at the checkpoint that saw the cancel
    checkpoint()  # outside `cancellable`: no check, nothing happens


def test_a_check_that_raises_stops_compare_between_chunks():
    t = make_synthetic(SyntheticSpec(context=2048, steps=8))
    calls = []

    class Stop(Exception):
        pass

    def check():
        calls.append(1)
        if len(calls) > 2:
            raise Stop

    with cancellable(check), pytest.raises(Stop):
        compare(t, Spec(sink=4, recent=64, heavy=64, scorer="h2o"), View(ensemble="heads"))
    assert len(calls) == 3
    full = compare(t, Spec(sink=4, recent=64, heavy=64, scorer="h2o"), View(ensemble="heads"))
    assert full.metrics["kept_tokens"] == 132  # nothing half-done was kept


def test_the_score_cache_does_not_keep_a_trace_alive():
    import weakref

    t = make_synthetic(SyntheticSpec(context=64, steps=4))
    compare(t, Spec(sink=4, recent=8, heavy=8, scorer="h2o"))
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None


def test_np_is_not_touched_by_a_refusal(monkeypatch):
    """The refusal happens in the spec: make_synthetic never runs, so no array is created."""
    monkeypatch.setattr(np, "zeros", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(BudgetError):
        SyntheticSpec(**HUGE)


def test_a_timeline_states_its_masks_and_is_refused_past_the_limit(monkeypatch):
    from kvviz.analysis.timeline import timeline, timeline_work

    t = make_synthetic(SyntheticSpec(context=64, steps=8))
    work = timeline_work(t, 8, 3)
    assert work.bytes == t.q.nbytes + t.k.nbytes + t.v.nbytes + 8 * 72 * 8 + 3 * 4 * 8 * 72 + 8 * 2 * 72
    monkeypatch.setattr("kvviz.limits.max_bytes", lambda: work.bytes - 1)
    with pytest.raises(BudgetError, match="this timeline needs"):
        timeline(t, Spec(sink=4, recent=8, heavy=8, scorer="oracle"), policies=("h2o", "tova", "streaming"))


def test_a_real_model_prefill_and_capture_state_their_size():
    from kvviz.models.config import prefill_work
    from kvviz.sources.request import capture_work

    dims = (30, 9, 3, 64)  # SmolLM2-135M
    assert prefill_work(dims, 4096).bytes == (
        3 * 9 * 4096 * 4096 * 4 + 30 * 9 * 4096 * 64 * 4 + 4 * 30 * 3 * 4096 * 64 * 4
    )
    with pytest.raises(
        BudgetError,
        match=r"3 × 9 query heads × 8,192 tokens × 8,192 keys × 4 B = 7.2 GB of "
        r"attention scores",
    ):
        prefill_work(dims, 8192).check()
    # a 2048-token SmolLM2 capture in memory: 141 MB of q, 47 MB each of k and v (the capture module's own
    # figures); eager attention on the CPU adds one layer's scores, sdpa (blocks) and a GPU (not host) none
    work = capture_work(dims, 30, 2048, 2048, attention="eager")
    assert [p.bytes for p in work.parts] == [
        30 * 9 * 2048 * 64 * 4,
        2 * 30 * 3 * 2048 * 64 * 4,
        3 * 9 * 2048 * 2048 * 4,
    ]
    assert round(work.parts[0].bytes / 1e6) == 142 and round(work.parts[1].bytes / 2e6) == 47
    assert capture_work(dims, 30, 2048, 2048, attention="sdpa").parts == work.parts[:2]
    assert capture_work(dims, 30, 2048, 2048, attention="eager", on_host=False).parts == work.parts[:2]
    # to a file, in bfloat16: one layer's rows on the host, twice - whatever the length of the whole trace
    to_file = capture_work((32, 32, 8, 128), 32, 32768, 32768, attention="sdpa", item_bytes=2)
    assert to_file.bytes == 2 * (32 + 2 * 8) * 32768 * 128 * 2 < 1.5e9


def test_a_real_model_text_past_the_limit_is_refused_before_the_forward_pass(tiny, monkeypatch):
    from kvviz.decode import quality

    model, ids = tiny
    monkeypatch.setattr("kvviz.limits.max_bytes", lambda: 100_000)
    monkeypatch.setattr(quality, "prefill", lambda *a, **k: pytest.fail("ran the model"))
    with pytest.raises(BudgetError, match="this text needs"):
        quality.reference(model, None, ids, 40, 20)
