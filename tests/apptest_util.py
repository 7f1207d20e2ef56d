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


def unfold(at: AppTest, key: str) -> AppTest:
    """Open a folded (state-tracking) expander, as a click on it does, and rerun; fail on any exception."""
    at.session_state[key] = True
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def share_one_model_load(monkeypatch):
    """Patch kvviz.models.load_model so the page and the test share one load per model name; return
    the patched loader. Skips the test where the bundled model is not installed."""
    import pytest

    import kvviz.models

    if kvviz.models.bundled_model_file() is None:
        pytest.skip("the bundled model is not installed")
    real, loaded = kvviz.models.load_model, {}

    def load_once(name="bundled", **kwargs):
        if name not in loaded:
            loaded[name] = real(name, **kwargs)
        return loaded[name]

    monkeypatch.setattr(kvviz.models, "load_model", load_once)
    return load_once
