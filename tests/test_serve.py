"""The launcher `make run` uses (kvviz.app.serve): what it changes in Streamlit's server, checked on real
sockets. The browser tests start the app through it (tests/conftest.serve_app(launcher=True))."""

import socket

import pytest
from streamlit.web.server.starlette import starlette_server

from kvviz.app import internals, serve


def _accepted_no_delay(bind) -> int:
    """TCP_NODELAY on a connection accepted by a listening socket from `bind` (Streamlit's signature)."""
    listener = bind("127.0.0.1", 0, 8)
    try:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        listener.setblocking(True)
        conn, _ = listener.accept()
        try:
            return conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            conn.close()
            client.close()
    finally:
        listener.close()


def test_connections_the_server_accepts_send_small_writes_at_once(monkeypatch):
    """Streamlit binds its listening socket with protocol 0, so asyncio leaves Nagle's algorithm on for every
    connection it accepts: a response's body then waits 40 ms for the browser's delayed ACK of its headers.
    The launcher turns it off on the listening socket, which the accepted connections inherit."""
    monkeypatch.setattr(starlette_server, "_bind_socket", starlette_server._bind_socket)  # restored afterwards
    assert _accepted_no_delay(starlette_server._bind_socket) == 0, (
        "Streamlit now turns Nagle off itself: kvviz.app.serve._no_delay can go"
    )
    serve._no_delay()
    assert _accepted_no_delay(starlette_server._bind_socket) != 0
    patched = starlette_server._bind_socket
    serve._no_delay()  # twice: not wrapped twice
    assert starlette_server._bind_socket is patched


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="no Unix sockets here")
def test_a_unix_socket_is_left_as_it_is(monkeypatch, tmp_path):
    """TCP options only on TCP sockets: a server bound to a Unix socket path starts as before."""
    made = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    monkeypatch.setattr(starlette_server, "_bind_socket", lambda address, port, backlog: made)
    serve._no_delay()
    try:
        assert starlette_server._bind_socket("unused", 0, 1) is made
    finally:
        made.close()


def test_the_first_element_check_is_done_before_the_first_visit(monkeypatch):
    """Streamlit's once-per-process REPL check (a walk of the whole stack) is made by the launcher, not by
    the first visitor's page run."""
    from streamlit import delta_generator

    monkeypatch.setattr(delta_generator, "_use_warning_has_been_displayed", False)
    internals.ask_first_element_check()
    assert delta_generator._use_warning_has_been_displayed is True


def test_plain_streamlit_run_finds_the_apps_start_up_hook():
    """`streamlit run app.py` serves app.py's st.App (Streamlit's own discovery, by the file's syntax), so
    the app's start-up hook runs at server start, not only under `make run`'s launcher."""
    from pathlib import Path

    from streamlit.web.server.app_discovery import discover_asgi_app

    found = discover_asgi_app(Path(__file__).resolve().parents[1] / "app.py")
    assert found.is_asgi_app and found.import_string == "app:app"


def test_the_hook_turns_nagle_off_on_a_socket_that_is_already_listening():
    """Under `streamlit run app.py` the server has bound and listens before the hook runs: the hook finds
    the listening socket and sets TCP_NODELAY on it, which the connections accepted afterwards inherit."""
    bind = starlette_server._bind_socket
    assert _accepted_no_delay(bind) == 0

    def bind_then_hook(address, port, backlog):
        sock = bind(address, port, backlog)
        assert serve.no_delay_on_listening() >= 1
        return sock

    assert _accepted_no_delay(bind_then_hook) != 0
