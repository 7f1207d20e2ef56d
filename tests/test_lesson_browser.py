"""An exported lesson in headless Chromium, opened from disk with the network blocked.

At several grid points the sliders are set and what the page shows - the metrics line, the memory
card, the setting's caption, the kept tokens and every bar, tick and error bar of both charts (each
carries its value) - is compared with kvviz.compare (and once with `kvviz compare --json`) for that
setting. Also: no request leaves the file, keyboard moves, token text stays text, 1024x768 fits.
Fixtures (Chromium through executable_path) in conftest.py; KVVIZ_UPDATE_SCREENSHOT=1 refreshes
docs/lesson.png.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvviz import Spec, View, compare
from kvviz.analysis.frames import binned_frame, ranges_text, token_frame, with_band
from kvviz.analysis.readout import card_values
from kvviz.cli import main
from kvviz.links import defaults, source_from_values
from kvviz.sources import SyntheticSpec, make_synthetic, save_trace

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
HANDBOOK_GRID = {"sink": (0, 2, 4), "recent": (0, 4, 8, 16), "heavy": (0, 2, 8, 32), "bits": (2, 4, 16)}
POINTS = [
    dict(sink=4, recent=8, heavy=2, bits=16),
    dict(sink=0, recent=16, heavy=8, bits=4),
    dict(sink=2, recent=0, heavy=32, bits=2),
    dict(sink=0, recent=0, heavy=0, bits=16),
    dict(sink=4, recent=4, heavy=0, bits=2),
]

SHOWN = """() => {
  const cards = {};
  document.querySelectorAll('[data-card]').forEach(d => {
    const small = d.querySelector('small');
    cards[d.dataset.card] = [d.querySelector('dd').firstChild.textContent, small ? small.textContent : ''];
  });
  const bars = sel => Array.from(document.querySelectorAll(sel)).map(e => [+e.dataset.i, e.dataset.v]);
  return {cards, setting: document.getElementById('setting').textContent,
          kept: document.getElementById('kept').textContent,
          warnings: Array.from(document.querySelectorAll('#warnings .warn')).map(e => e.textContent),
          original: bars('#attention rect.original'), compressed: bars('#attention rect.compressed'),
          evicted_mass: bars('#attention rect.original.evicted'),
          eviction: bars('#error rect.eviction'), quantization: bars('#error rect.quantization'),
          total: bars('#error line.total'),
          band: Array.from(document.querySelectorAll('#error .band')).map(
            e => [+e.dataset.i, e.dataset.lo, e.dataset.hi]),
          point: window.kvvizLesson.point};
}"""

# the lesson is the app's view, with the app's defaults (kvviz.links): a partial group is quantized there
APP_PARTIAL = defaults()["partial"]


def export(tmp, name, *argv) -> Path:
    out = tmp / f"{name}.html"
    assert main(["lesson", "export", "--out", str(out), "--quiet", *argv]) == 0
    return out


def grid_args(grid):
    return [a for k, v in grid.items() for a in ("--grid", f"{k}={','.join(map(str, v))}")]


@pytest.fixture(scope="module")
def handbook_lesson(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("lesson"), "handbook", *grid_args(HANDBOOK_GRID))


@pytest.fixture
def offline_page(browser):
    """A page in an offline context that records every request and aborts any that is not the file itself."""
    context = browser.new_context(viewport={"width": 1024, "height": 768}, offline=True)
    pg = context.new_page()
    pg.requests, pg.errors, pg.dialogs = [], [], []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            r.abort()

    context.route("**/*", route)
    pg.on("request", lambda req: pg.requests.append(req.url))
    pg.on("console", lambda m: pg.errors.append(m.text) if m.type in ("error", "warning") else None)
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    try:
        yield pg
    finally:
        context.close()


def open_lesson(pg, path: Path) -> None:
    pg.goto(path.as_uri())
    # Poll with evaluate (CDP, outside the page's CSP): wait_for_function compiles its predicate with
    # eval inside the page, which the lesson's CSP (no 'unsafe-eval') rightly refuses.
    deadline = time.monotonic() + 30
    while not pg.evaluate("Boolean(window.kvvizLesson && window.kvvizLesson.ready)"):
        assert time.monotonic() < deadline, "the lesson page did not get ready in 30 s"
        pg.wait_for_timeout(50)


def set_point(pg, **values) -> None:
    grid = {s["name"]: s["values"] for s in pg.evaluate("kvvizLesson.meta.sliders")}
    for name, value in values.items():
        pg.locator(f"#s-{name}").fill(str(grid[name].index(value)))


def number(v: str) -> float:
    return float(v)


def check_point(shown, comp, frame, binned=False):
    """Everything the page shows at one point == what kvviz.compare gives there (values bit for bit)."""
    cards = card_values(comp.metrics)
    assert shown["cards"]["mass"][0] == cards["Attention mass retained"]
    assert shown["cards"]["tv"][0] == cards["TV distance"] and shown["cards"]["tvq"][0] == cards["TV from quantization"]
    assert shown["cards"]["kl"][0] == cards["KL divergence"] and shown["cards"]["out"][0] == cards["Output error"]
    assert shown["cards"]["kv"][0] == cards["KV memory"] and shown["cards"]["ratio"][0] == cards["Memory vs 16-bit"]
    assert shown["cards"]["kept"][0] == cards["Tokens kept"]
    assert shown["cards"]["ratio"][1] == f"({comp.metrics['compression_ratio']:.1f}× smaller)"
    assert shown["setting"].endswith(comp.spec.label() or "no compression")
    compressed = frame["compressed"].to_numpy()
    drawn = {i: number(v) for i, v in shown["compressed"]}
    assert all(drawn[i] == compressed[i] for i in drawn)
    if not binned:
        p = comp.primary
        assert sorted(drawn) == [i for i in range(len(p.kept)) if p.kept[i]]  # evicted: no compressed bar
        assert all(compressed[i] == 0 for i in range(len(p.kept)) if i not in drawn)
        assert sorted(i for i, _ in shown["original"]) == list(range(len(p.kept)))
        assert all(number(v) == p.original[i] for i, v in shown["original"])
        if comp.spec.evicts:
            assert shown["kept"] == f"Kept tokens: {ranges_text(frame.index[frame['kept']])}"
    for part in ("eviction", "quantization"):
        values = frame[f"error_{part}_mean"].to_numpy()
        got = {i: number(v) for i, v in shown[part]}
        assert got == {i: values[i] for i in range(len(values)) if values[i] != 0}
    mean = frame["error_mean"].to_numpy()
    assert [(i, number(v)) for i, v in shown["total"]] == list(enumerate(mean))
    lo, hi = frame["band_lo"].to_numpy(), frame["band_hi"].to_numpy()
    if len(comp.members) > 1:
        assert [(i, number(a), number(b)) for i, a, b in shown["band"]] == [(i, lo[i], hi[i]) for i in range(len(lo))]
    else:
        assert shown["band"] == []


def test_the_page_shows_what_compare_computes_at_every_point_tried(offline_page, handbook_lesson):
    pg = offline_page
    open_lesson(pg, handbook_lesson)
    src = source_from_values(defaults())
    view = View(ensemble="seeds", ensemble_size=8)
    seen = set()
    for k, values in enumerate(POINTS):
        if k:  # the first is where the page opens: drawn from its JSON before the grid is unpacked
            set_point(pg, **values)
        shown = pg.evaluate(SHOWN)
        spec = Spec(
            sink=values["sink"],
            recent=values["recent"],
            heavy=values["heavy"],
            key_bits=values["bits"],
            value_bits=values["bits"],
            partial=APP_PARTIAL,
        )
        comp = compare(src.trace, spec, view, trace_for_seed=src.trace_for_seed)
        check_point(shown, comp, with_band(token_frame(comp), "std"))
        seen.add(shown["point"])
    assert len(seen) == len(POINTS)
    assert pg.requests == [handbook_lesson.as_uri()] and pg.errors == [] and pg.dialogs == []


def test_the_page_agrees_with_the_kvviz_compare_command(offline_page, handbook_lesson):
    pg = offline_page
    open_lesson(pg, handbook_lesson)
    set_point(pg, sink=0, recent=16, heavy=8, bits=4)
    shown = pg.evaluate(SHOWN)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvviz",
            "compare",
            "--sink",
            "0",
            "--recent",
            "16",
            "--heavy",
            "8",
            "--bits",
            "4",
            "--partial-groups",
            APP_PARTIAL,
            "--ensemble",
            "seeds",
            "--ensemble-size",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    printed = json.loads(out.stdout)
    assert [number(v) for _, v in shown["total"]] == printed["error_mean"]
    assert {i: number(v) for i, v in shown["compressed"]} == {i: c for i, c in enumerate(printed["compressed"]) if c}
    assert [number(lo) for _, lo, _ in shown["band"]] == [
        m - s for m, s in zip(printed["error_mean"], printed["error_std_sample"])
    ]
    metrics = {**printed["metrics"], "output_rel_error": printed["metrics"]["output_rel_error"]}
    cards = card_values(metrics)
    assert (
        shown["cards"]["mass"][0] == cards["Attention mass retained"] and shown["cards"]["kv"][0] == cards["KV memory"]
    )
    assert shown["cards"]["tv"][0] == cards["TV distance"] and shown["cards"]["kept"][0] == cards["Tokens kept"]


def test_keyboard_moves_a_slider_along_its_grid(offline_page, handbook_lesson):
    pg = offline_page
    open_lesson(pg, handbook_lesson)
    heavy = pg.locator("#s-heavy")
    heavy.focus()
    assert pg.locator("#s-heavy-value").text_content() == "2"
    before = pg.evaluate("kvvizLesson.point")
    heavy.press("ArrowRight")
    assert pg.locator("#s-heavy-value").text_content() == "8"
    assert pg.evaluate("kvvizLesson.point") == before + 3  # bits is the fastest axis (3 values)
    assert pg.locator('[data-card="kept"] dd').text_content() == "20 / 64"
    heavy.press("End")
    assert pg.locator("#s-heavy-value").text_content() == "32"
    assert pg.locator("#s-heavy").get_attribute("aria-valuetext") == "32"
    assert pg.errors == []


def test_token_text_is_shown_as_text(offline_page, tmp_path):
    trace = make_synthetic(SyntheticSpec(context=24, steps=2, layers=1, q_heads=2, kv_heads=1))
    tokens = ("<script>alert(1)</script>",) + tuple(f" w{i}" for i in range(1, trace.n_positions))
    trace = replace(trace, tokens=tokens, meta={"source": "model", "model": "<b>bold</b> model"})
    path = save_trace(trace, tmp_path / "t.safetensors")
    page = export(
        tmp_path,
        "xss",
        "--trace",
        str(path),
        "--grid",
        "sink=0,1",
        "--grid",
        "recent=4",
        "--grid",
        "heavy=0",
        "--grid",
        "bits=16",
        "--text",
        "<img src=x onerror=alert(2)>",
        "--title",
        "</title><script>alert(3)</script>",
    )
    pg = offline_page
    open_lesson(pg, page)
    assert pg.dialogs == [] and pg.evaluate("document.querySelectorAll('img').length") == 0
    assert pg.evaluate("Array.from(document.querySelectorAll('b')).map(b => b.textContent)") == ["Kept tokens: "]
    assert pg.evaluate("document.scripts.length") == 3
    assert pg.locator("#lecturer").text_content() == "<img src=x onerror=alert(2)>"
    assert pg.locator("h1").text_content() == "</title><script>alert(3)</script>"
    pg.locator('#attention rect[data-i="0"]').first.hover()
    tip = pg.locator("#attention .tip")
    assert tip.is_visible() and tip.text_content().startswith("<script>alert(1)</script> (position 0)")
    labels = pg.evaluate("Array.from(document.querySelectorAll('#attention .xaxis text')).map(t => t.textContent)")
    assert labels[0] == "<script>al"  # the axis shows its first 10 characters
    assert pg.locator("#source").text_content().startswith("<b>bold</b> model: ")
    assert pg.requests == [page.as_uri()] and pg.errors == []


def test_a_long_source_is_binned_and_exact(offline_page, tmp_path):
    values = {"context": 300, "steps": 2, "layers": 1, "q_heads": 2, "kv_heads": 1}
    link = "source=synthetic&" + "&".join(f"{k}={v}" for k, v in values.items()) + "&sink=4&recent=32&heavy=16&bits=4"
    page = export(
        tmp_path,
        "binned",
        "--from-url",
        link,
        "--grid",
        "sink=4",
        "--grid",
        "recent=0,32",
        "--grid",
        "heavy=16",
        "--grid",
        "bits=4,16",
    )
    pg = offline_page
    open_lesson(pg, page)
    trace = make_synthetic(SyntheticSpec(**values))
    for recent, bits in ((32, 4), (0, 16)):
        set_point(pg, recent=recent, bits=bits)
        shown = pg.evaluate(SHOWN)
        comp = compare(
            trace,
            Spec(sink=4, recent=recent, heavy=16, key_bits=bits, value_bits=bits, partial=APP_PARTIAL),
            View(ensemble="heads", ensemble_size=8),
        )
        frame = with_band(binned_frame(comp), "std")
        check_point(shown, comp, frame, binned=True)
        evicted = frame["evicted_mass"].to_numpy()
        assert {i: number(v) for i, v in shown["evicted_mass"]} == {
            i: evicted[i] for i in range(len(evicted)) if evicted[i] > 0
        }
        assert shown["kept"] == "302 tokens: the charts show 101 bins of up to 3 tokens each."
    assert pg.errors == []


def test_fits_a_projector(offline_page, handbook_lesson):
    pg = offline_page
    open_lesson(pg, handbook_lesson)
    assert pg.evaluate("document.documentElement.scrollWidth") <= 1024
    right = pg.evaluate("""() => Math.max(...['sliders', 'metrics', 'memory', 'attention', 'error'].map(
        id => document.getElementById(id).getBoundingClientRect().right))""")
    assert right <= 1024
    assert pg.locator("#attention svg").is_visible() and pg.locator("#s-bits").is_visible()
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    pg.screenshot(path=str(artifacts / "lesson.png"), full_page=True)
    if os.environ.get("KVVIZ_UPDATE_SCREENSHOT") == "1":  # docs/lesson.md: the default handbook lesson
        full = export(handbook_lesson.parent, "full")
        open_lesson(pg, full)
        set_point(pg, sink=4, recent=16, heavy=16, bits=2)  # 36 kept tokens: keys fill a group, both errors
        pg.evaluate("document.activeElement.blur()")
        pg.screenshot(
            path=str(ROOT / "docs" / "lesson.png"), clip={"x": 0, "y": 0, "width": 1024, "height": 1380}, full_page=True
        )


def test_the_request_recorder_sees_what_a_page_loads(offline_page):
    """The check above can fail: a page that does load something is caught (and the load aborted)."""
    pg = offline_page
    pg.set_content("<img src='http://127.0.0.1:9/x.png'>")
    pg.wait_for_timeout(300)
    assert "http://127.0.0.1:9/x.png" in pg.requests
