"""The app under a hostile or careless link: the work budget's notice on every page, a rerun or a
closed session stopping a long build at its next chunk, and the pool that makes heavy sessions queue."""

import threading
import time
from pathlib import Path

import pytest
from apptest_util import app_test, plotly_charts
from streamlit.testing.v1 import AppTest

import kvviz.sources.synthetic as synthetic
from kvviz.app import guard
from kvviz.limits import set_max_bytes

ROOT = Path(__file__).resolve().parents[1]
HUGE = dict(
    source="synthetic", context=1_000_000_000, steps=1_000_000_000, layers=100_000, q_heads=100_000, kv_heads=100_000
)
PAGES = [
    "app.py",
    "pages/1_trade-offs.py",
    "pages/2_concentration.py",
    "pages/3_model-lab.py",
    "pages/4_decode-timeline.py",
    "pages/5_needle-test.py",
]
USES_THE_SOURCE = {"app.py", "pages/1_trade-offs.py", "pages/2_concentration.py", "pages/4_decode-timeline.py"}


@pytest.fixture(autouse=True)
def default_limit(monkeypatch):
    monkeypatch.delenv("KVVIZ_MAX_BYTES", raising=False)
    set_max_bytes(None)


def page(path: str, timeout: float = 120, **params) -> AppTest:
    at = app_test(str(ROOT / path), timeout)
    for k, v in params.items():
        at.query_params[k] = str(v)
    return at


@pytest.mark.parametrize("path", PAGES)
def test_the_huge_link_gives_a_notice_and_a_usable_page(path, monkeypatch):
    made = []
    real = synthetic.make_synthetic
    monkeypatch.setattr(
        synthetic, "make_synthetic", lambda spec=synthetic.SyntheticSpec(): made.append(spec) or real(spec)
    )
    at = page(path, **HUGE)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    warnings = " ".join(w.value for w in at.warning)
    if path not in USES_THE_SOURCE:
        assert "Too big" not in warnings
        return
    assert (
        "Too big for this server:** the synthetic pattern needs 2 × 32 layers × 32 KV heads × 33,280 "
        "positions × 64 dims × 4 B = 17.4 GB of keys and values, 26.3 GB in all" in warnings
    )
    assert "the limit is 1.5 GB (KVVIZ_MAX_BYTES): lower the context" in warnings
    assert "Showing the default setting instead" in warnings
    # what was built (if not cached already) is the default pattern, and the page drew its charts
    assert all(s.context == 512 and s.layers == 2 for s in made)
    assert plotly_charts(at)
    if path == "app.py":
        cards = {m.label: m.value for m in at.metric}
        assert cards["Tokens kept"].endswith("/ 544")  # the default pattern's 512 + 32 tokens


def test_after_a_refusal_the_previous_pattern_stays():
    at = page("app.py", source="synthetic", context=1024)
    at.run()
    assert not at.exception and not at.warning
    at.number_input(key="layers").set_value(32)
    at.number_input(key="q_heads").set_value(32)
    at.number_input(key="kv_heads").set_value(32)
    at.number_input(key="context").set_value(32768).run()
    assert not at.exception
    text = " ".join(w.value for w in at.warning)
    assert "Too big for this server" in text and "Showing the previous setting instead" in text
    assert {m.label: m.value for m in at.metric}["Tokens kept"].endswith("/ 1056")  # still 1024 + 32


def _counting_checkpoints(monkeypatch, on_call):
    """Wrap the synthetic source's checkpoint: count calls, let `on_call(n)` act, record what it raised."""
    real = synthetic.checkpoint
    calls, raised = [], []

    def counted():
        calls.append(1)
        on_call(len(calls))
        try:
            real()
        except BaseException as e:
            raised.append(type(e).__name__)
            raise

    monkeypatch.setattr(synthetic, "checkpoint", counted)
    return calls, raised


def test_a_rerun_stops_a_long_synthetic_build_at_its_next_chunk(monkeypatch):
    """A rerun request that arrives while the pattern is generated ends that run at the next checkpoint;
    the rerun then builds it once, whole."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx
    from streamlit.runtime.scriptrunner_utils.script_requests import RerunData

    def rerun_at_third(n):
        if n == 3:  # a visitor moves a slider: Streamlit queues a rerun for this session
            get_script_run_ctx().script_requests.request_rerun(RerunData(query_string="source=synthetic"))

    calls, raised = _counting_checkpoints(monkeypatch, rerun_at_third)
    at = page("app.py", source="synthetic", syn_seed=7)
    at.run()
    assert not at.exception
    per_build = 2 * (2 + 4)  # a checkpoint after every KV head and query head of 2 layers
    assert raised == ["RerunException"]
    assert len(calls) == 3 + per_build  # 3 before the rerun stopped it, then one whole build


def test_a_closed_session_stops_a_long_synthetic_build(monkeypatch):
    """Streamlit asks a disconnected session's script to stop; AppTest does the same when a run times
    out. The build stops at its next checkpoint instead of running to the end."""
    hold = threading.Event()

    def slow(n):
        hold.wait(0.5)  # each head takes a while

    page("app.py").run()  # imports done, so the timeout falls inside the build
    calls, raised = _counting_checkpoints(monkeypatch, slow)
    at = page("app.py", source="synthetic", syn_seed=8, layers=8)
    with pytest.raises(RuntimeError, match="timed out"):
        at.run(timeout=2.0)
    assert raised == ["StopException"]
    assert len(calls) < 8 * (2 + 4)  # stopped long before the 48th head


# --- the pool of run slots -----------------------------------------------------------------------------


def test_the_pool_serves_in_order_and_says_how_many_are_ahead():
    p = guard.Pool(2)
    a, b, c, d = (object() for _ in range(4))
    p.acquire(a, lambda: None)
    p.acquire(b, lambda: None)
    assert p.busy
    got = []
    waiters = [threading.Thread(target=lambda t=t: (p.acquire(t, lambda: None), got.append(t))) for t in (c, d)]
    waiters[0].start()
    while c not in p._queue:
        pass
    waiters[1].start()
    while d not in p._queue:
        pass
    assert p.ahead_of(c) == 2 and p.ahead_of(d) == 3  # two running, and c before d
    p.release()
    waiters[0].join(5)
    assert got == [c] and p.ahead_of(d) == 2
    p.release()
    waiters[1].join(5)
    assert got == [c, d]


def test_the_pool_counts_the_other_runs():
    p = guard.Pool(1)
    assert p.others(holding=False) == 0
    p.acquire(object(), lambda: None)
    assert p.others(holding=True) == 0 and p.others(holding=False) == 1  # the caller's own run is not other work
    waiter = threading.Thread(target=lambda: p.acquire(object(), lambda: None))
    waiter.start()
    while not p._queue:
        pass
    assert p.others(holding=True) == 1
    p.release()
    waiter.join(5)
    assert p.others(holding=True) == 0


def test_a_check_that_raises_leaves_the_line():
    p = guard.Pool(1)
    p.acquire(object(), lambda: None)

    class Rerun(BaseException):
        pass

    def check():
        raise Rerun

    with pytest.raises(Rerun):
        p.acquire(object(), check)
    assert p._queue == [] and p._running == 1


def test_a_queued_page_says_so_and_runs_when_a_slot_frees(monkeypatch):
    p = guard.Pool(1)
    monkeypatch.setattr(guard, "pool", lambda: p)
    p.acquire(object(), lambda: None)  # another visitor's page holds the only slot
    shown = []
    real = guard.queued_text
    monkeypatch.setattr(guard, "queued_text", lambda n: shown.append(n) or real(n))

    def release_once_shown():
        deadline = time.monotonic() + 30
        while not shown and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        p.release()

    threading.Thread(target=release_once_shown, daemon=True).start()
    at = page("app.py", source="synthetic", syn_seed=9)
    at.run()
    assert not at.exception and at.metric
    assert shown[0] == 1
    assert real(1).startswith(
        "Queued behind 1 other visitor's page (1 run at a time on this server): this page starts when one finishes."
    )
    assert real(3).startswith("Queued behind 3 other visitors' pages")
    assert p._running == 0 and p._queue == []  # the page gave its slot back


def test_the_status_line_of_a_queued_run_waits_then_follows_the_line():
    class Holder:
        def __init__(self):
            self.calls = []

        def info(self, text, icon=None):
            self.calls.append(text)

        def empty(self):
            self.calls.append(None)

    p, holder, ticket = guard.Pool(1), Holder(), object()
    p.acquire(object(), lambda: None)
    p._queue += [object(), ticket]  # one run holds the slot, one waits ahead of this ticket
    status = guard._Status(holder, ticket, p)
    status(guard.SHOW_AFTER_S / 2)
    assert holder.calls == []  # a short wait says nothing
    status(guard.SHOW_AFTER_S)
    assert holder.calls == [guard.queued_text(2)]
    p._queue.pop(0)
    status(guard.SHOW_AFTER_S + guard.TICK_SECONDS / 2)
    assert len(holder.calls) == 1  # refreshed once a tick, not on every wait
    status(guard.SHOW_AFTER_S + guard.TICK_SECONDS)
    assert holder.calls[-1] == guard.queued_text(1)
    status.clear()
    assert holder.calls[-1] is None
    quiet = Holder()
    guard._Status(quiet, ticket, p).clear()
    assert quiet.calls == []  # never shown: nothing to clear


def test_a_queued_page_leaves_the_line_when_its_session_closes(monkeypatch):
    page("app.py").run()  # imports done, so the run reaches the line in time
    p = guard.Pool(1)
    monkeypatch.setattr(guard, "pool", lambda: p)
    p.acquire(object(), lambda: None)
    queued = threading.Event()

    def watch():
        while not p._queue:
            threading.Event().wait(0.01)
        queued.set()

    threading.Thread(target=watch, daemon=True).start()
    with pytest.raises(RuntimeError, match="timed out"):  # AppTest then asks the run to stop
        page("app.py").run(timeout=3.0)
    assert queued.is_set()  # it waited in line...
    assert p._queue == [] and p._running == 1  # ...and left it; the holder still runs
    p.release()


def test_server_options():
    o = guard.options(["--max-bytes", "3GB", "--workers", "4", "--other"])
    assert (o.max_bytes, o.workers) == ("3GB", 4)
    assert guard.options([]).max_bytes is None


def test_background_work_waits_until_no_run_has_held_a_slot_for_the_quiet_time():
    import time

    p = guard.Pool(1)
    p.acquire(object(), lambda: None)
    assert p.wait_quiet(0.05, timeout=0.3) is False  # a run holds the slot the whole time
    p.release()
    released = time.monotonic()
    assert p.wait_quiet(0.2, timeout=5.0) is True
    assert time.monotonic() - released >= 0.2  # quiet for the whole `quiet`, counted from the release


def test_the_background_model_load_pauses_between_its_steps_while_a_run_computes(monkeypatch):
    import time

    from kvviz.app import sources
    from kvviz.models import BUNDLED

    p = guard.Pool(1)
    monkeypatch.setattr(guard, "pool", lambda: p)
    status = {"wanted": threading.Event()}
    p._last_busy -= sources.YIELD_QUIET_S
    t0 = time.monotonic()
    sources.yield_to_runs(status)  # no run for a while: no wait
    assert time.monotonic() - t0 < sources.YIELD_QUIET_S
    p.acquire(object(), lambda: None)
    t0 = time.monotonic()
    threading.Timer(0.4, p.release).start()
    sources.yield_to_runs(status)
    # waited for the run to give its slot back, then for the page to be drawn
    assert time.monotonic() - t0 >= 0.4 + sources.YIELD_QUIET_S
    p.acquire(object(), lambda: None)
    t0 = time.monotonic()
    sources.yield_to_runs(status, limit=0.3)  # a run that goes on: one step waits `limit` at most
    assert 0.3 <= time.monotonic() - t0 < 5
    # a page run waiting for this very load: the load no longer yields to it (it would wait for itself)
    store, key = sources._model_store(), (BUNDLED, "cpu", "float32")
    status.update(done=threading.Event(), f=1.0, msg="", t0=time.time())
    status["done"].set()
    monkeypatch.setitem(store, "loading", {key: status})
    monkeypatch.setitem(store["models"], key, "the model")
    assert sources.shared_model(BUNDLED) == "the model" and status["wanted"].is_set()
    t0 = time.monotonic()
    sources.yield_to_runs(status)
    assert time.monotonic() - t0 < 5 and p.others(holding=False) == 1
    p.release()
