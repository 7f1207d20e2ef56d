"""The Explorer's "Export this as a lesson" (AppTest): folded it computes nothing; built, it is the page
`kvviz lesson export --from-url` writes for the same link, number for number."""

import numpy as np
from apptest_util import run_app

from kvviz.cli import main
from kvviz.plots.lesson import page_data
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a tiny synthetic source (8 tokens, one head) keeps the default grid quick: 5 x 5 x 5 x 7 points
TINY = {
    "source": "synthetic",
    "context": "8",
    "steps": "0",
    "layers": "1",
    "q_heads": "1",
    "kv_heads": "1",
    "n_anchors": "0",
    "sink": "1",
    "recent": "2",
    "heavy": "1",
    "bits": "4",
}


def test_the_explorer_exports_the_lesson_the_cli_writes(tmp_path):
    at = run_app(str(ROOT / "app.py"), 300, opened=("_lesson_open",), **TINY)
    assert [e for e in at.expander if e.label.startswith("Export this as a lesson")]
    assert "_kvviz_lesson" not in at.session_state  # folded: nothing computed
    at.button(key="_lesson_build").click().run(timeout=600)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    built = at.session_state["_kvviz_lesson"]
    data, lesson, points = built["page"], built["lesson"], built["lesson"].points
    assert points == 5 * 5 * 5 * 7
    button = [b for b in at.get("download_button") if b.proto.id.endswith("_lesson_download")]
    assert (
        button and button[0].proto.label.startswith("Download the lesson (") and "875 settings" in button[0].proto.label
    )
    out = tmp_path / "cli.html"
    link = "&".join(f"{k}={v}" for k, v in TINY.items())
    assert main(["lesson", "export", "--out", str(out), "--from-url", link, "--quiet"]) == 0
    app_meta, app_arrays = page_data(data.decode("utf-8"))
    cli_meta, cli_arrays = page_data(out.read_text())
    for name in ("rows", "row_of", "marks", "mark_of", "text_of"):
        assert np.array_equal(app_arrays[name], cli_arrays[name]), name
    assert app_arrays["strings"] == cli_arrays["strings"]
    app_meta["link"].pop("base")
    cli_meta["link"].pop("base")
    assert app_meta == cli_meta

    at.text_area(key="_lesson_text").set_value("Week 3: <b>sinks</b>").run(timeout=120)  # words: no recompute
    built = at.session_state["_kvviz_lesson"]
    assert built["lesson"] is lesson and page_data(built["page"].decode())[0]["lecturer"] == "Week 3: <b>sinks</b>"
