"""Every private part of Streamlit that kvviz uses (kvviz/app/internals.py, the one module that reaches into
Streamlit) is still where and what that module expects: a Streamlit upgrade that moves one fails here, by
name, instead of quietly costing what the part bought. (What each does is checked where it is used:
tests/test_serve.py on real sockets, the browser tests for the page addresses and the first paint.)"""

import inspect

import streamlit

from kvviz.app import internals


def test_the_pinned_streamlit_is_the_one_the_internals_were_read_from():
    assert streamlit.__version__ == internals.VERIFIED, (
        f"Streamlit {streamlit.__version__}: re-read each part in kvviz/app/internals.py against it (this "
        "file says which), then set VERIFIED"
    )


def test_the_socket_binding_takes_an_address_a_port_and_a_backlog():
    from streamlit.web.server.starlette import starlette_server

    assert list(inspect.signature(starlette_server._bind_socket).parameters)[:3] == ["address", "port", "backlog"]


def test_a_sessions_script_events_go_through_the_method_the_batching_replaces():
    from streamlit.runtime.app_session import AppSession

    own = getattr(AppSession._call_soon_on_event_loop, "original", AppSession._call_soon_on_event_loop)
    assert list(inspect.signature(own).parameters) == ["self", "callback"]
    assert "self._event_loop.call_soon_threadsafe(callback)" in inspect.getsource(own)
    for method in ("_on_scriptrunner_event", "handle_backmsg_exception"):  # every event, through that method
        assert "self._call_soon_on_event_loop(" in inspect.getsource(getattr(AppSession, method)), method


def test_the_flush_request_and_the_session_managers_copy_of_it_are_where_the_batching_expects():
    from streamlit.runtime.app_session import AppSession
    from streamlit.runtime.runtime import AsyncObjects, Runtime
    from streamlit.runtime.websocket_session_manager import WebsocketSessionManager

    own = getattr(Runtime._enqueued_some_message, "original", Runtime._enqueued_some_message)
    assert "call_soon_threadsafe(async_objs.need_send_data.set)" in inspect.getsource(own)
    assert {"eventloop", "need_send_data"} <= set(AsyncObjects._fields)
    assert '"message_enqueued_callback": self._enqueued_some_message' in inspect.getsource(Runtime.__init__)
    manager = inspect.getsource(WebsocketSessionManager)
    assert "self._message_enqueued_callback = message_enqueued_callback" in manager
    assert "message_enqueued_callback=self._message_enqueued_callback" in manager  # handed to every session
    assert "self._message_enqueued_callback()" in inspect.getsource(AppSession._enqueue_forward_msg)


def test_batched_script_events_run_in_order_at_one_wake_up_and_a_failing_one_stops_none():
    import threading

    assert internals.batch_script_events()
    # the server's loop in a thread of its own (a test before this one in the worker may have left a loop
    # marked running in this thread)
    failed = []
    thread = threading.Thread(target=lambda: _batched_events(failed))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if failed:
        raise failed[0]


def _batched_events(failed: list) -> None:
    import asyncio
    import threading
    import types

    from streamlit.runtime.app_session import AppSession
    from streamlit.runtime.runtime import Runtime

    loop = asyncio.new_event_loop()
    try:
        wake_ups, seen, errors = [], [], []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda callback, *args: (wake_ups.append(callback), real(callback, *args))[1]
        loop.set_exception_handler(lambda _, context: errors.append(str(context["exception"])))
        session = types.SimpleNamespace(_event_loop=loop)  # a session as far as the batching reads one
        call_soon = AppSession._call_soon_on_event_loop

        def fail():
            raise ValueError("one event failed")

        def script_thread():
            for i in range(50):
                call_soon(session, fail if i == 20 else lambda i=i: seen.append(i))

        thread = threading.Thread(target=script_thread)
        thread.start()
        thread.join()
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert seen == [i for i in range(50) if i != 20] and errors == ["one event failed"]
        assert len(wake_ups) == 1  # fifty events, one wake-up
        call_soon(session, lambda: seen.append("next"))  # a later event: a wake-up of its own
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert seen[-1] == "next" and len(wake_ups) == 2
        # the flush request: on the loop's own thread the event is set at once, from another thread through
        # the loop (a wake-up)
        objs = types.SimpleNamespace(eventloop=loop, need_send_data=asyncio.Event())
        runtime = types.SimpleNamespace(_get_async_objs=lambda: objs)  # a runtime as far as the request reads one
        flush = Runtime._enqueued_some_message

        async def on_the_loop():
            flush(runtime)
            return objs.need_send_data.is_set()

        assert loop.run_until_complete(on_the_loop()) and len(wake_ups) == 2
        objs.need_send_data.clear()
        other = threading.Thread(target=flush, args=(runtime,))
        other.start()
        other.join()
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert objs.need_send_data.is_set() and len(wake_ups) == 3
    except BaseException as e:  # noqa: BLE001 - raised again in the test's own thread
        failed.append(e)
    finally:
        loop.close()


def test_the_first_element_check_and_its_flag_are_there():
    from streamlit import delta_generator

    assert callable(delta_generator._maybe_print_use_warning)
    assert hasattr(delta_generator, "_use_warning_has_been_displayed")


def test_the_run_context_and_its_cancel_check():
    from streamlit.runtime.scriptrunner import get_script_run_ctx
    from streamlit.runtime.scriptrunner_utils.script_run_context import get_run_yield_check

    assert "suppress_warning" in inspect.signature(get_script_run_ctx).parameters
    assert internals.run_context() is None  # outside a run
    assert callable(get_run_yield_check)


def test_the_page_manager_names_the_page_asked_for_and_the_legacy_flag():
    from streamlit.runtime.pages_manager import PagesManager

    for name in ("intended_page_name", "intended_page_script_hash", "set_script_intent"):
        assert hasattr(PagesManager, name) or name in inspect.getsource(PagesManager), name
    assert isinstance(PagesManager.uses_pages_directory, (bool, type(None)))


def test_streamlits_plotly_chunk_is_one_file_that_sets_window_plotly():
    """Every chart is drawn in place with the plotly code Streamlit ships (kvviz.app.livechart); where the
    chunk is renamed, split or no longer sets window.Plotly, plotly_chunk() says None and the charts fall
    back to st.plotly_chart -- this test says so first."""
    chunk = internals.plotly_chunk()
    assert chunk is not None and chunk.startswith("PlotlyChart.") and chunk.endswith(".js")


def test_the_module_says_what_each_part_buys():
    names = [
        name
        for name, f in inspect.getmembers(internals, inspect.isfunction)
        if f.__module__ == internals.__name__ and not name.startswith("_")
    ]
    assert names and [name for name in names if f"`{name}`" not in internals.__doc__] == []


def test_no_other_module_reaches_into_streamlit():
    """Outside kvviz/app/internals.py the app uses Streamlit's public API only (`import streamlit as st`)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    private = re.compile(r"^\s*(from|import) streamlit\.", re.M)
    found = [
        str(p.relative_to(root))
        for p in [root / "app.py", *root.glob("kvviz/**/*.py"), *root.glob("pages/*.py")]
        if p.name != "internals.py" and private.search(p.read_text(encoding="utf-8"))
    ]
    assert found == []
