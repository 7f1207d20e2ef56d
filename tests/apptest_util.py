"""Shared AppTest helper (imported by the AppTest modules)."""

from streamlit.testing.v1 import AppTest


def run_app(path: str, timeout: float = 120, **params) -> AppTest:
    """Run a page with the given URL query parameters; fail on any exception in the page."""
    at = AppTest.from_file(path, default_timeout=timeout)
    for k, v in params.items():
        at.query_params[k] = str(v)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at
