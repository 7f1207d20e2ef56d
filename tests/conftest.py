"""Fixtures for the browser end-to-end tests: a live `streamlit run app.py` and headless Chromium.

The server starts on a free localhost port (headless, usage stats off) and is stopped
afterwards. Chromium is Debian's /usr/bin/chromium driven by Playwright's sync API through
`executable_path` (never `playwright install`). Without Chromium or Playwright the browser
tests skip with the reason, unless KVVIZ_REQUIRE_BROWSER=1 (CI), where they fail instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# no background model load in test app runs (tests that need the model load it themselves)
os.environ.setdefault("KVVIZ_WARMUP", "0")
# Model lab results precomputed on this machine must not change what the app tests see
os.environ.setdefault("KVVIZ_LAB_DIR", tempfile.mkdtemp(prefix="kvviz-lab-test-"))
# the Studies page opens folders under this root only (an empty one per test session)
os.environ.setdefault("KVVIZ_STUDIES_DIR", tempfile.mkdtemp(prefix="kvviz-studies-test-"))

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("KVVIZ_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


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


@pytest.fixture(scope="session")
def app_url(chromium_path) -> str:
    """Start `streamlit run app.py` on a free port; yield its URL; stop it."""
    port = _free_port()
    streamlit = shutil.which("streamlit", path=str(Path(sys.executable).parent)) or "streamlit"
    cmd = [streamlit, "run", str(ROOT / "app.py"), "--server.headless", "true", "--server.port", str(port),
           "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none", "--server.runOnSave", "false"]
    log = (ARTIFACTS / "streamlit-server.log")
    ARTIFACTS.mkdir(exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"streamlit did not become healthy within 60 s; see {log}")
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
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh page whose console errors and uncaught exceptions are collected in `page.errors`."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
    pg.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    pg.errors = errors
    try:
        yield pg
    finally:
        context.close()


def tiny_llama(hidden_size: int = 64):
    """A tiny random Llama (2 layers, 4 query heads over 2 KV heads, eager attention) and 60 token ids:
    fast and exact, for the decode paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids


@pytest.fixture(scope="module")
def tiny():
    """tiny_llama() once per test module (a module may define its own `tiny`)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return tiny_llama()
