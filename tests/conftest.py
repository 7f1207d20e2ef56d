"""Fixtures for the browser end-to-end tests: a live `streamlit run app.py` and headless Chromium.

The server starts on a free localhost port (headless, usage stats off) and is stopped
afterwards. Chromium is Debian's /usr/bin/chromium driven by Playwright's sync API through
`executable_path` (never `playwright install`). Without Chromium or Playwright the browser
tests skip with the reason, unless KVVIZ_REQUIRE_BROWSER=1 (CI), where they fail instead.

Also here: the hypothesis profiles (`ci`: derandomized, a fixed example budget; `dev`:
more examples; HYPOTHESIS_PROFILE picks one, dev by default, `.ci/run` sets ci); the pytest-xdist
grouping (a module's tests stay in one worker where the module builds its own module-scoped
fixtures; the browser tests share one worker, server and Chromium); a shorter
timeout for browser tests; and, when a browser test fails or times out, its page's screenshot and
console saved under test-results/.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

# pandas imported whole before any test starts a thread: an AppTest's page run and the app's warm-up
# thread importing it at the same moment could meet CPython's import-deadlock guard, which hands one of
# them the half-initialised module ("partially initialized module 'pandas'"), seen in Model lab AppTests.
import pandas  # noqa: F401
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# Property tests are reproducible in CI: the same examples every run (derandomize, no example
# database), so a bug that one random draw finds cannot pass the next run by chance. Locally the
# `dev` profile draws more, random examples; a failing example it finds is kept in the test as
# @example. The budget is set here, not per test, so the two profiles mean what they say.
# too_slow is not a correctness check, and a shared 2-core machine trips it at random.
hypothesis_settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
hypothesis_settings.register_profile(
    "dev", max_examples=150, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Under pytest-xdist every worker gets one of the 2 cores: torch / OpenMP use one thread each
# (set before torch is first imported) instead of both workers fighting over both cores.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# no background model load in test app runs (tests that need the model load it themselves)
os.environ.setdefault("KVVIZ_WARMUP", "0")


def _own_folder(variable: str, prefix: str) -> None:
    """A fresh temporary folder in `variable` unless one was given, one per pytest-xdist worker: the workers
    inherit the controlling process's environment, and two workers writing the same study or lab result into
    one folder raced (the Studies live-link test found the example already run by another worker)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    given = Path(os.environ.get(variable) or "").name
    if not given or (worker and given.startswith(prefix) and not given.startswith(f"{prefix}{worker}-")):
        os.environ[variable] = tempfile.mkdtemp(prefix=f"{prefix}{worker}-" if worker else prefix)


# Model lab results precomputed on this machine must not change what the app tests see
_own_folder("KVVIZ_LAB_DIR", "kvviz-lab-test-")
# the Studies page opens folders under this root only (an empty one per test session and worker)
_own_folder("KVVIZ_STUDIES_DIR", "kvviz-studies-test-")

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
RESULTS = ROOT / "test-results"  # a failed or timed-out browser test's screenshot and console
BROWSER_TIMEOUT = int(os.environ.get("KVVIZ_BROWSER_TEST_TIMEOUT", "300"))  # seconds a browser test may take
CHROMIUM = os.environ.get("KVVIZ_CHROMIUM", "/usr/bin/chromium")
TIMEOUT = int(os.environ.get("KVVIZ_BROWSER_TIMEOUT_MS", "60000"))  # a busy 2-core machine needs it
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("KVVIZ_REQUIRE_BROWSER") == "1":
        pytest.fail(f"browser tests are required (KVVIZ_REQUIRE_BROWSER=1) but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright Python package is not installed (pip install playwright)")
    return CHROMIUM


@contextlib.contextmanager
def serve_app(log: Path, env: dict | None = None, launcher: bool = False):
    """`streamlit run app.py` on a free localhost port (headless, usage stats off): yield its URL once
    healthy, stop it afterwards. Raises RuntimeError if it exits or is not healthy within 60 s.
    launcher=True starts it as `make run` does (`python -m kvviz.app.serve`: the app warm from the start)."""
    from kvviz.app.serve import local_command

    port = _free_port()
    cmd = local_command(port, ROOT / "app.py", launcher=launcher)
    log.parent.mkdir(exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=None if env is None else {**os.environ, **env}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"streamlit did not become healthy within 60 s; see {log}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def quarter_study() -> str:
    """The small example study (examples/studies/quarter-cache.toml), run once into the server's studies
    root ($KVVIZ_STUDIES_DIR, above) for the browser tests that open it; its folder name."""
    from kvviz.analysis.study import run_study

    out = Path(os.environ["KVVIZ_STUDIES_DIR"]) / "quarter"
    if not (out / "study.json").exists():
        run_study(ROOT / "examples" / "studies" / "quarter-cache.toml", out)
    return out.name


@pytest.fixture(scope="session")
def app_url(chromium_path, browser) -> str:
    """Start `streamlit run app.py` on a free port; yield its URL; stop it."""
    try:
        with serve_app(ARTIFACTS / "streamlit-server.log") as url:
            yield url
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


# Installed in every page before its scripts run (see tests/test_browser.py):
# - counts the app's script runs: stApp's data-test-script-state leaves "notRunning" once per run (full or
#   fragment); `changed` is when it last changed;
# - __kvvizView(): every widget's shown value by kind and label (a chart's animation slider among them), every
#   metric, the headings, and a digest of every chart outside an expander (trace names, point counts, sums) --
#   what "the same view" means;
# - __kvvizHeadline(): the part of the view only a script run can change (metrics, headings, charts, and
#   the text of `window.__kvvizExtra`, a selector), sampled with the address bar's query once a frame
#   while the page changes and right after every address change (with the time), so a test can ask
#   what the address bar held when the page first showed a new view.
PAGE_PROBE_JS = """
window.__kvviz = {runs: 0, state: null, changed: performance.now(), drawn: 0, samples: [], order: 0, asked: 0,
                  started: 0, early: false};
// Runs are counted from the server's messages, not from the page: a quick run's "running" and
// "notRunning" can reach React in one batch and never touch the DOM (seen once the server's
// connections sent each message at once: kvviz.app.serve._no_delay). Every run, full or fragment,
// starts with a ForwardMsg carrying new_session (field 4) and ends with one carrying script_finished
// (field 6, a varint: 2 is FINISHED_EARLY_FOR_RERUN, a run stopped because another one follows at once:
// st.rerun, st.switch_page, input while it ran). Every run the page asks for is a BackMsg carrying
// rerun_script (field 11): a widget, a page link, a component's report. So the app has nothing more to
// do once a run has started after the page last asked for one and has finished, not stopped for the
// next: idle() reads that instead of waiting for the page to stay quiet a long while.
const fields = (data) => {     // a protobuf message's top-level fields: {field: varint value or true}
  const out = {};
  const b = data instanceof ArrayBuffer ? new Uint8Array(data)
          : ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : null;
  if (!b) return out;
  let i = 0;
  const varint = () => {
    let x = 0, f = 1, c;
    do { c = b[i++]; x += (c & 0x7f) * f; f *= 128; } while (c & 0x80 && i < b.length);
    return x;
  };
  while (i < b.length) {
    const tag = varint(), field = Math.floor(tag / 8), wire = tag % 8;
    if (wire === 0) out[field] = varint(); else if (wire === 2) { const n = varint(); i += n; out[field] = true; }
    else if (wire === 1) i += 8; else if (wire === 5) i += 4; else return out;
  }
  return out;
};
const Socket = window.WebSocket;
window.WebSocket = class extends Socket {
  constructor(...args) {
    super(...args);
    this.addEventListener('message', (e) => {
      const k = window.__kvviz, f = fields(e.data);
      if (f[4] === true) { k.started = ++k.order; k.changed = performance.now(); }
      if (typeof f[6] === 'number') { k.runs++; k.early = f[6] === 2; k.changed = performance.now(); }
    });
  }
  send(data) {
    if (fields(data)[11] === true) { const k = window.__kvviz; k.asked = ++k.order; k.changed = performance.now(); }
    return super.send(data);
  }
};
// Every state the app passed through, in order (what the page shows while it runs).
const enter = (s) => {
  if (s === window.__kvviz.state) return;
  window.__kvviz.state = s;
  window.__kvviz.changed = performance.now();
};
new MutationObserver((records) => {
  const app = document.querySelector('[data-testid="stApp"]');
  const states = records.filter(r => r.type === 'attributes' && r.target === app).map(r => r.oldValue);
  for (const s of states.slice(1)) enter(s);
  enter(app ? app.getAttribute('data-test-script-state') : null);
}).observe(document, {subtree: true, childList: true, attributes: true, attributeOldValue: true,
                      attributeFilter: ['data-test-script-state']});

const txt = (e) => e ? e.textContent.trim() : null;
const outside = (e) => !e.closest('[data-testid="stExpander"]');
const digest = (a) => { let s = 0, n = 0;
  const walk = (x) => { if (typeof x === 'number') { if (isFinite(x)) { s += x; n++; } }
                        else if (x && typeof x !== 'string' && x.length !== undefined) for (const v of x) walk(v); };
  walk(a); return n ? `${n}:${Math.abs(s) < 1e-9 ? 0 : s.toPrecision(6)}` : ''; };

// A chart's digest walks all its data (a heatmap's z: thousands of numbers), and sample() asks for it every
// 100 ms and every frame the page changes: it is kept per drawn figure. Plotly builds a new _fullData array
// on every draw (Plotly.react, restyle, an animation step: plots.supplyDefaults), so the same array is
// the same drawn data; a chart not drawn yet (data only) is walked each time.
const drawnDigests = new WeakMap();
const chartDigest = (p) => {
  const full = p._fullData, known = full && drawnDigests.get(full);
  if (known !== undefined) return known;
  const d = (full || p.data || []).map(t =>
    `${t.name || ''}|${t.type || ''}|${digest(t.x)}|${digest(t.y)}|${digest(t.z)}`).join(' ; ');
  if (full) drawnDigests.set(full, d);
  return d;
};

function results(put) {
  document.querySelectorAll('[data-testid="stMetric"]').forEach(m =>
    put(`metric: ${txt(m.querySelector('[data-testid="stMetricLabel"]'))}`,
        txt(m.querySelector('[data-testid="stMetricValue"]'))));
  put('headings', Array.from(document.querySelectorAll('h1, h2, h3')).filter(outside).map(txt).join(' | '));
  Array.from(document.querySelectorAll('.js-plotly-plot')).filter(outside)
    .forEach((p, i) => put(`chart ${i}`, chartDigest(p)));
  if (window.__kvvizExtra)
    put('extra', Array.from(document.querySelectorAll(window.__kvvizExtra)).map(txt).join(' | '));
}

window.__kvvizView = () => {
  const out = {};
  const label = (w) => txt(w.querySelector('[data-testid="stWidgetLabel"]'))
                       || w.querySelector('[aria-label]')?.getAttribute('aria-label');
  const put = (k, v) => { let key = k, i = 2; while (key in out) key = `${k} #${i++}`; out[key] = v; };
  const each = (sel, kind, value) => document.querySelectorAll(sel).forEach(w => put(`${kind}: ${label(w)}`, value(w)));
  each('[data-testid="stSlider"]', 'slider',
       w => Array.from(w.querySelectorAll('input[type="range"]'))
              .map(i => i.getAttribute('aria-valuetext')).join(' – '));
  each('[data-testid="stSelectbox"]', 'selectbox', w => w.querySelector('input')?.value);
  each('[data-testid="stNumberInput"]', 'number', w => w.querySelector('input')?.value);
  each('[data-testid="stCheckbox"]', 'checkbox', w => w.querySelector('input')?.checked);
  each('[data-testid="stRadio"]', 'radio', w => txt(w.querySelector('input:checked')?.closest('label')));
  each('[data-testid="stMultiSelect"]', 'multiselect',
       w => Array.from(w.querySelectorAll('[data-tag] [title], [data-baseweb="tag"]')).map(txt).join(', '));
  each('[data-testid="stButtonGroup"]', 'pills', w => Array.from(w.querySelectorAll('button'))
       .filter(b => (b.getAttribute('kind') || '').endsWith('Active')).map(txt).join(', '));
  each('[data-testid="stTextInput"], [data-testid="stTextArea"]', 'text',
       w => w.querySelector('input, textarea')?.value);
  // a chart's own animation slider (the Decode timeline's step) is a control: moved in the browser, reported after
  Array.from(document.querySelectorAll('.js-plotly-plot')).filter(outside).forEach((p, i) => {
    const slider = ((p._fullLayout || {}).sliders || [])[0];
    if (slider) put(`chart ${i} step`, slider.active);
  });
  results(put);
  return out;
};

window.__kvvizHeadline = () => {
  const parts = [];
  results((k, v) => parts.push(`${k}=${v}`));
  return parts.join('\\n');
};

const sample = () => {
  const k = window.__kvviz, h = window.__kvvizHeadline(), q = location.search, last = k.samples[k.samples.length - 1];
  if (!last || last[0] !== h || last[1] !== q) k.samples.push([h, q, performance.now()]);
};
let pending = false;   // one sample a frame while the page changes, one right after each address change
new MutationObserver(() => {
  window.__kvviz.drawn = performance.now();      // the page's last change (a chart redrawn after its run)
  if (!pending) { pending = true; requestAnimationFrame(() => { pending = false; sample(); }); }
}).observe(document, {subtree: true, childList: true, characterData: true});
for (const name of ['pushState', 'replaceState']) {
  const original = history[name];
  history[name] = function (...args) { const r = original.apply(this, args); sample(); return r; };
}
setInterval(sample, 100);
"""


def runs(page) -> int:
    """How many script runs (full or fragment) this page has seen (PAGE_PROBE_JS)."""
    return page.evaluate("window.__kvviz.runs")


def idle(page, after: int = 0, quiet_ms: int = 400) -> None:
    """Wait until the app has run more than `after` times and is idle: no run is pending (every run the
    page asked for has started, and the last one finished rather than stopped for a rerun: an st.rerun
    or a page switch; PAGE_PROBE_JS), its script-run state is "notRunning", neither it nor the page
    (its elements, results, address bar) has changed for `quiet_ms` (the page has drawn the run's
    last messages: a chart is redrawn after its run ends), no element is still loading (a skeleton; a
    chart that waits for plotly or draws a newer figure: kvviz.app.livechart) and every chart on screen
    is drawn. Not "a chart exists": a chart from the previous run exists too."""
    from playwright.sync_api import TimeoutError as WaitRanOut

    from kvviz.app.livechart import DRAWING, PENDING

    # still to come: not idle (a chart says it waits for plotly or draws a newer figure)
    loading = f'[data-testid="stSkeleton"], [{PENDING}], [{DRAWING}]'
    try:
        page.wait_for_function(
            """([after, quiet, loading]) => { const k = window.__kvviz, last = k.samples[k.samples.length - 1];
                                   return k.runs > after && k.state === 'notRunning'
                                   && k.started > k.asked && !k.early
                                   && performance.now() - Math.max(k.changed, k.drawn, last ? last[2] : 0) > quiet
                                   && !Array.from(document.querySelectorAll(loading))
                                            .some(c => c.offsetParent !== null)
                                   && Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"]'))
                                           .every(c => c.offsetParent === null || c.querySelector('.main-svg')); }""",
            arg=[after, quiet_ms, loading],
            timeout=TIMEOUT,
            polling=100,
        )
    except WaitRanOut as e:  # say what the app was doing, not only that the wait ran out
        state = page.evaluate(
            """(loading) => ({runs: window.__kvviz.runs, state: window.__kvviz.state,
            asked: window.__kvviz.asked, started: window.__kvviz.started, early: window.__kvviz.early,
            sinceChange: performance.now() - window.__kvviz.changed,
            sinceDrawn: performance.now() - window.__kvviz.drawn, samples: window.__kvviz.samples.length,
            sinceSample: performance.now() - (window.__kvviz.samples.at(-1) || [0, 0, 0])[2],
            skeletons: Array.from(document.querySelectorAll(loading)).filter(c => c.offsetParent !== null).length,
            undrawn: Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"]'))
                       .filter(c => c.offsetParent !== null && !c.querySelector('.main-svg')).length,
            url: location.href})""",
            loading,
        )
        raise AssertionError(f"the app did not become idle after run {after}: {state}") from e


def view(page) -> dict:
    """Every widget's value, metric, heading and chart digest on the page (PAGE_PROBE_JS)."""
    return page.evaluate("window.__kvvizView()")


def streamlit_probe(msg) -> bool:
    """Streamlit's own 404s when a page's address is opened directly: the frontend first tries the page's
    path as the server's base path (/trade-offs/_stcore/health, .../host-config), then the root."""
    url = msg.location.get("url") or ""
    return "status of 404" in msg.text and url.rsplit("/", 1)[-1] in ("health", "host-config") and "/_stcore/" in url


@pytest.fixture(scope="session")
def browser_context(browser):
    """One browser context per worker, shared by its browser tests' pages: Chromium's HTTP cache, and the
    compiled code it keeps for scripts it has run, then serve every page load after the first (Streamlit's
    frontend and plotly.js are several MB of JavaScript, re-fetched and re-compiled in a fresh context: ~8%
    of a page load's CPU on a 2-core machine, measured interleaved). What a test can leave in it (cookies,
    the origin's storage) is cleared after each test (`page`). Every page it opens is probed (PAGE_PROBE_JS)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_init_script(PAGE_PROBE_JS)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def page(browser_context):
    """A fresh page (a new Streamlit session: a new tab, 1400 x 1000) whose console errors and uncaught
    exceptions are collected in `page.errors`; closed after the test with every other page the test opened,
    and the context's cookies and the app's local storage cleared."""
    context = browser_context
    pg = context.new_page()
    pg.set_viewport_size({"width": 1400, "height": 1000})
    errors: list[str] = []
    pg.on(
        "console",
        lambda msg: (
            errors.append(f"console.{msg.type}: {msg.text} ({msg.location.get('url')})")
            if msg.type == "error" and not streamlit_probe(msg)
            else None
        ),
    )
    console: list[str] = []  # every console message, saved to test-results/ if the test fails
    pg.on("console", lambda msg: console.append(f"console.{msg.type}: {msg.text}"))
    pg.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    pg.on("pageerror", lambda exc: console.append(f"pageerror: {exc}"))
    pg.errors = errors
    pg.console = console
    try:
        yield pg
    finally:
        for opened in context.pages:
            with contextlib.suppress(Exception):  # a crashed page: closing it is all that is left
                if opened is pg and not opened.is_closed():
                    opened.evaluate("() => { try { localStorage.clear(); } catch (e) {} }")
                opened.close()
        context.clear_cookies()


def tiny_llama(hidden_size: int = 64):
    """A tiny random Llama (2 layers, 4 query heads over 2 KV heads, eager attention) and 60 token ids:
    fast and exact, for the decode paths."""
    import torch
    from tiny_llama_folder import TINY_SHAPE
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = TINY_SHAPE | {"hidden_size": hidden_size}
    cfg = LlamaConfig(
        **shape, vocab_size=97, num_hidden_layers=2, max_position_embeddings=256, attn_implementation="eager"
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids


@pytest.fixture(scope="module")
def tiny():
    """tiny_llama() once per test module (a module may define its own `tiny`)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return tiny_llama()


# --- pytest-xdist, timeouts, and what a failed browser test leaves behind ---------------

MODEL_FIXTURES = {"tiny", "tiny_dir", "tiny_trace", "bundled", "bundled_trace"}


def _names(item) -> set[str]:
    """The names a test can reach: its module's globals and the names its function's code uses."""
    module = getattr(item, "module", None)
    code = getattr(getattr(item, "function", None), "__code__", None)
    return set(vars(module) if module is not None else ()) | set(code.co_names if code is not None else ())


def _is_core(item) -> bool:
    """Core: no browser, no real or tiny model, no torch, no Streamlit AppTest (`make test-fast`)."""
    if any(item.get_closest_marker(m) for m in ("browser", "model", "slow", "ray")):
        return False
    if _names(item) & {"torch", "AppTest", "run_app", "share_one_model_load", "load_shared"}:
        return False
    return not (MODEL_FIXTURES & set(getattr(item, "fixturenames", ())))


def _part(item) -> str:
    """Which part of the suite a test is, for the time-by-part summary: browser, core, AppTest (a page run
    without a browser), or model (a real or tiny model, torch, Ray)."""
    if item.get_closest_marker("browser") is not None:
        return "browser"
    if item.get_closest_marker("core") is not None:
        return "core"
    return "AppTest" if _names(item) & {"AppTest", "run_app", "app_test"} else "model"


def _module_fixture(item) -> bool:
    """Whether the item uses a module-scoped fixture its own module defines (a model run, a grid, a
    capture: built once per module only while the module's tests share one worker)."""
    info = getattr(item, "_fixtureinfo", None)
    path = str(getattr(item, "path", ""))
    for defs in info.name2fixturedefs.values() if info is not None else ():
        for d in defs:
            if (
                d.scope == "module"
                and str(getattr(d, "baseid", "")).split("::")[0]
                and path.endswith(str(d.baseid).split("::")[0])
            ):
                return True
    return False


# The browser tests in one xdist group per worker (each group on its own worker, with its own app server
# and Chromium; the session fixtures above are per worker), dealt out by weight so the groups take about
# the same time: the seconds each test took in a measured run (tests/test_browser.py's tests case by case,
# every other browser module whole, as its module fixtures are built once), heaviest first onto the
# lightest group. Measured in a `make test` run on a 2-core machine (the proportions count, not the
# seconds). A browser test not named here weighs BROWSER_UNKNOWN.
BROWSER_SECONDS = {
    "test_model_lab_cancel_stops_the_run_and_keeps_the_previous_results": 34,
    "test_explorer_link_follows_every_single_interaction": 31,
    "test_decode_timeline_link_follows_every_single_interaction": 30,
    "test_tradeoffs_link_follows_every_single_interaction": 24,
    "test_concentration_link_follows_every_single_interaction": 20,
    "test_needle_link_follows_every_single_interaction": 20,
    "test_model_lab_link_follows_every_single_interaction": 19,
    "test_studies_link_follows_every_single_interaction": 15,
    "test_the_explorer_paints_fits_a_projector_and_follows_each_slider_move": 12,
    "test_a_fresh_server_opens_a_page_link_as_that_page": 10,  # each case
    "test_shared_url_reproduces_state": 10,
    "test_every_page_opens_from_the_explorer_fits_a_projector_and_links_its_first_move": 9,  # each case
    "test_a_page_link_clicked_while_the_charts_wait_for_plotly_is_followed": 8,
    "test_the_huge_link_gives_a_notice_and_the_server_stays_small": 6,  # each case
    "test_presentation_mode_puts_the_lesson_above_the_fold": 5,
    "test_a_locked_axis_shows_every_bar_on_screen": 5,
    "test_out_of_range_link_shows_notice": 2,
    "test_layout_browser": 35,
    "test_lesson_browser": 14,  # whole modules
    "test_zoom_browser": 10,
    "test_lecture_browser": 9,
    "test_study_browser": 7,
    "test_needle_browser": 7,
}
BROWSER_UNKNOWN = 15


def _browser_groups(items, n: int) -> dict[str, str]:
    """Each browser test's group ("browser-1" .. "browser-n") by node id: the units (a test_browser.py
    case, a whole other module) by weight, heaviest first (ties by name), each onto the group with the
    least weight so far (ties: the first). Every worker computes the same from the same collection."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(item.nodeid if item.path.stem == "test_browser" else item.path.stem, []).append(item)

    def weight(key: str) -> float:
        first = units[key][0]
        if first.path.stem != "test_browser":
            return BROWSER_SECONDS.get(first.path.stem, BROWSER_UNKNOWN * len(units[key]))
        return BROWSER_SECONDS.get(getattr(first, "originalname", first.name), BROWSER_UNKNOWN)

    loads, group = [0.0] * max(1, n), {}
    for key in sorted(units, key=lambda k: (-weight(k), k)):
        g = loads.index(min(loads))
        loads[g] += weight(key)
        for item in units[key]:
            group[item.nodeid] = f"browser-{g + 1}"
    return group


# tryfirst: xdist's worker reads the xdist_group markers in its own pytest_collection_modifyitems;
# added after it (as this hook did before) they grouped nothing. See also the group-id hook below.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """xdist groups (`--dist loadgroup`): the tests of a module with its own module-scoped fixtures stay
    in one worker, so the fixture is built once; the browser tests are one group per worker, of about
    equal time (BROWSER_SECONDS), each with its app server and Chromium. A group is one unit of work:
    xdist hands out the units with the most tests first, so the browser groups start at once.
    Browser tests get a timeout of BROWSER_TIMEOUT seconds; the core tests the `core` marker
    (`make test-fast` runs `-m core`)."""
    xdist = config.pluginmanager.hasplugin("xdist")  # -p no:xdist: its marker is not registered
    browser = _browser_groups(
        [i for i in items if i.get_closest_marker("browser") is not None],
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    )
    for item in items:
        if xdist and item.nodeid in browser:
            item.add_marker(pytest.mark.xdist_group(browser[item.nodeid]))
        elif xdist and _module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        if item.get_closest_marker("browser") is not None:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(BROWSER_TIMEOUT))
        elif _is_core(item):
            item.add_marker(pytest.mark.core)
        item.user_properties.append(("part", _part(item)))  # travels with each report (xdist too)
    items[:] = slow_first(items)


def slow_first(items: list) -> list:
    """The tests marked slow that are in no xdist group first, the rest in their order: xdist hands out the
    groups by size, then single tests in this order, so a 20-second test is not the last one a worker takes
    while the others have finished (it was: the weights cache's conversion, last by file name, 20 s after
    the other two workers)."""
    first = [i for i in items if i.get_closest_marker("slow") and not i.get_closest_marker("xdist_group")]
    chosen = set(map(id, first))
    return first + [i for i in items if id(i) not in chosen]


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_group_ids(config, items):
    """What pytest-xdist's worker means to do with `--dist loadgroup`: append each test's group to its
    node id (`path::test@group`), the key by which the controller hands a whole group to one worker.
    xdist 3.8 writes it to `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`),
    so every xdist_group was ignored: each module fixture was built in both workers and the browser
    tests were spread at random. Done here after xdist's own hook; a no-op where xdist's took effect."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers under --dist loadgroup
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if names and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def _save_page(page, name: str) -> list[Path]:
    """The page's screenshot and its console messages under test-results/; returns the files written."""
    RESULTS.mkdir(exist_ok=True)
    written = []
    log = RESULTS / f"{name}.console.txt"
    lines = [f"url: {getattr(page, 'url', '?')}", *getattr(page, "console", getattr(page, "errors", []))]
    log.write_text("\n".join(lines) + "\n")
    written.append(log)
    try:
        png = RESULTS / f"{name}.png"
        page.screenshot(path=str(png), full_page=True, timeout=15_000)
        written.append(png)
    except Exception as e:  # a crashed or closed page: the console log is still worth having
        log.write_text(log.read_text() + f"(no screenshot: {type(e).__name__}: {e})\n")
    return written


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A browser test that fails or times out (pytest-timeout fails it) saves its page to test-results/."""
    outcome = yield
    report = outcome.get_result()
    page = getattr(item, "funcargs", {}).get("page")
    if report.failed and report.when in ("setup", "call") and page is not None:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in item.nodeid)[-150:]
        try:
            files = _save_page(page, name)
        except Exception as e:  # never turn a test failure into an internal error
            files = [f"(could not save the page: {e})"]
        report.sections.append(("browser page saved", "\n".join(str(f) for f in files)))


# --- where the suite's time goes ---------------------------------------------------------------------

PARTS = ("browser", "AppTest", "model", "core")
_PART_SECONDS: dict[str, list] = {}  # part -> [seconds of setup + call + teardown, tests]


def pytest_runtest_logreport(report):
    """Add each test's time to its part (in the controlling process, every worker's reports included)."""
    part = dict(report.user_properties).get("part")
    if part is None:
        return
    seconds_tests = _PART_SECONDS.setdefault(part, [0.0, 0])
    seconds_tests[0] += report.duration
    seconds_tests[1] += report.when == "call"


def pytest_terminal_summary(terminalreporter, config):
    """The suite's time by part, after the test summary: seconds of test time summed over the workers (the
    wall time is about this over the number of workers, plus start-up), and the tests of each part."""
    if hasattr(config, "workerinput") or not _PART_SECONDS:
        return
    parts = ", ".join(
        f"{part} {_PART_SECONDS[part][0]:.0f} s ({_PART_SECONDS[part][1]} tests)"
        for part in PARTS
        if part in _PART_SECONDS
    )
    total = sum(seconds for seconds, _ in _PART_SECONDS.values())
    terminalreporter.write_line(f"test time by part, summed over workers: {parts}; {total:.0f} s in all")
