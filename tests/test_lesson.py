"""Lessons: the app's link table outside the app, the grid, the packed page and `kvviz lesson export`.

The browser side (sliders, what the page shows at grid points, no network, escaping) is in
tests/test_lesson_browser.py.
"""

import base64
import hashlib
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from kvviz import Spec, View, compare
from kvviz.analysis.frames import bin_edges, binned_frame, token_frame, with_band
from kvviz.analysis.lesson import (
    BIN_COLUMNS,
    MAX_CELLS,
    MAX_VALUES,
    TOKEN_COLUMNS,
    compute_lesson,
    default_grid,
    grid_specs,
    lesson_grid,
    parse_grid,
)
from kvviz.analysis.readout import card_values
from kvviz.cli import main
from kvviz.links import (
    PARAMS,
    defaults,
    encode_query,
    parse_query,
    source_from_values,
    spec_from_values,
    synthetic_preset_values,
    view_from_values,
)
from kvviz.plots.lesson import FIELDS, export_lesson, page_data, point_texts
from kvviz.sources import SyntheticSpec, handbook_trace, make_synthetic, save_trace
from kvviz.spec import SpecError

from cli_util import run_cli

SMALL_GRID = {"sink": (0, 4), "recent": (0, 8), "heavy": (0, 2, 8), "bits": (2, 4, 16)}


def point(meta, **values) -> int:
    """The index of a grid point in a page's arrays (C order over the sliders, as the page's script)."""
    i = 0
    for s in meta["sliders"]:
        i = i * len(s["values"]) + s["values"].index(values[s["name"]])
    return i


def expected_frame(trace, spec, view, for_seed=None, bars="std"):
    comp = compare(trace, spec, view, trace_for_seed=for_seed)
    binned = len(comp.tokens) > 256
    return comp, with_band(binned_frame(comp) if binned else token_frame(comp), bars), binned


# --- the link table, below the app ------------------------------------------------------------------


def test_the_app_reads_the_same_table():
    from kvviz.app import compression, params

    assert params.PARAMS is PARAMS and compression.spec_from_values is spec_from_values


def test_a_link_reads_back_to_the_values_the_app_wrote():
    values = {
        **defaults(),
        "source": "synthetic",
        "context": 96,
        "sink": 2,
        "bits": 4,
        "scorer": "tova",
        "ensemble": "heads",
        "bars": "ci95",
        "symmetric": True,
    }
    query = encode_query(values)
    assert "bits=4" in query and "symmetric=1" in query and "recent" not in query  # defaults are not written
    for link in (query, "?" + query, "http://lecture-hall:8501/?" + query):
        back, notes = parse_query(link)
        assert notes == [] and back == values
    spec = spec_from_values(back)
    assert (spec.sink, spec.recent, spec.key_bits, spec.value_bits, spec.scorer) == (
        2,
        PARAMS["recent"].default,
        4,
        4,
        "tova",
    )
    assert view_from_values(back) == View(ensemble="heads", ensemble_size=8)
    assert view_from_values(defaults()).ensemble == "seeds"  # auto: seeds for the handbook


def test_a_bad_link_says_what_is_wrong():
    values, notes = parse_query("sink=abc&bits=11&utm=x&ens_size=99")
    assert values["sink"] == PARAMS["sink"].default and values["bits"] == 16 and values["ens_size"] == 32
    assert len(notes) == 4 and "`utm` is not a kvviz setting" in notes


def test_linked_sources_are_the_apps():
    hb = source_from_values(defaults())
    assert hb.label == "handbook example" and hb.trace_for_seed(3).k.tobytes() == handbook_trace(seed=3).k.tobytes()
    syn = source_from_values(synthetic_preset_values("topic shift"))
    assert syn.trace.n_positions == 512 + 48 and syn.label == "synthetic pattern (512 tokens)"
    assert (
        syn.trace_for_seed(2).q.tobytes()
        == make_synthetic(SyntheticSpec(steps=48, topic_shift=12.0, seed=2)).q.tobytes()
    )
    with pytest.raises(SpecError, match="trace"):
        source_from_values({**defaults(), "source": "real"})


# --- the grid ---------------------------------------------------------------------------------------


def test_default_grid_for_the_handbook():
    grid, start = lesson_grid(64, Spec(sink=4, recent=8, heavy=2))
    assert grid == {
        "sink": (0, 1, 2, 4, 8, 16),
        "recent": (0, 1, 2, 4, 8, 16, 32, 64),
        "heavy": (0, 1, 2, 4, 8, 16, 32, 64),
        "bits": (1, 2, 3, 4, 6, 8, 16),
    }
    assert start == {"sink": 4, "recent": 8, "heavy": 2, "bits": 16}
    assert all(len(v) <= MAX_VALUES for v in grid.values())


def test_longer_sources_get_coarser_grids_so_the_page_stays_small():
    assert default_grid(222) == {
        "sink": (0, 1, 4, 16),
        "recent": (0, 8, 16, 32, 64, 128),
        "heavy": (0, 8, 16, 32, 64, 128),
        "bits": (2, 3, 4, 8, 16),
    }
    for n in (8, 64, 100, 222, 256, 257, 544, 4096):
        grid = default_grid(n)
        columns = n * len(TOKEN_COLUMNS) if n <= 256 else len(bin_edges(n)) * len(BIN_COLUMNS)
        assert math.prod(map(len, grid.values())) * columns <= MAX_CELLS
        assert max(grid["recent"]) == max(grid["heavy"]) == 2 ** (n.bit_length() - 1)


def test_grid_takes_the_current_setting_and_refuses_what_it_cannot_show():
    grid, _ = lesson_grid(544, Spec(sink=3, recent=100, heavy=0, key_bits=5, value_bits=5, symmetric=True))
    assert grid == {
        "sink": (0, 1, 3, 4, 8, 16),
        "recent": (0, 16, 32, 64, 100, 128, 256, 512),
        "heavy": (0, 16, 32, 64, 128, 256, 512),
        "bits": (2, 3, 4, 5, 8, 16),
    }  # symmetric: no 1 bit
    with pytest.raises(SpecError, match="at most 12"):
        lesson_grid(64, Spec(sink=5), {"sink": tuple(range(0, 24, 2))})
    with pytest.raises(SpecError, match="more than the 64 tokens"):
        lesson_grid(64, Spec(sink=500))
    with pytest.raises(SpecError, match="keys and values together"):
        lesson_grid(64, Spec(key_bits=4, value_bits=2))
    with pytest.raises(SpecError, match="noise"):
        lesson_grid(64, Spec(quant_model="noise"))
    with pytest.raises(SpecError, match="impossible"):
        grid_specs(
            Spec(symmetric=True, key_bits=2, value_bits=2),
            {"sink": (0,), "recent": (0,), "heavy": (0,), "bits": (1, 2)},
        )


@pytest.mark.parametrize(
    "item, words",
    [
        ("sink", "NAME=V1"),
        ("depth=1,2", "NAME=V1"),
        ("sink=a,b", "whole numbers"),
        ("sink=", "at least one"),
        ("heavy=-1,2", "0 or more"),
        ("bits=16,12", "1-8"),
        (f"recent={','.join(map(str, range(13)))}", "12"),
    ],
)
def test_bad_grid_items(item, words):
    with pytest.raises(SpecError, match=words):
        parse_grid([item])


def test_parse_grid_sorts_and_dedupes():
    assert parse_grid(["bits=16, 4,2,4", "sink=8,0"]) == {"bits": (2, 4, 16), "sink": (0, 8)}


# --- every point is what kvviz.compare gives ---------------------------------------------------------


def test_every_handbook_point_is_compare_bit_for_bit():
    src = source_from_values(defaults())
    view, base = View(ensemble="seeds", ensemble_size=8), Spec(sink=4, recent=8, heavy=2)
    grid, start = lesson_grid(64, base, SMALL_GRID)
    lesson = compute_lesson(src.trace, base, view, grid, start, trace_for_seed=src.trace_for_seed)
    assert lesson.points == 2 * 2 * 3 * 3 == len(lesson.specs) and lesson.columns == TOKEN_COLUMNS
    assert len(lesson.rows) < lesson.points  # budgets that keep the same tokens share one row
    for i, spec in enumerate(lesson.specs):
        comp, frame, _ = expected_frame(src.trace, spec, view, src.trace_for_seed)
        got = lesson.frame(i)
        for col in TOKEN_COLUMNS:
            assert np.array_equal(got[col], frame[col].to_numpy(), equal_nan=True), (i, col)
        assert np.array_equal(got["reason"], comp.primary.reason)
        assert lesson.metrics[i] == comp.metrics
        assert np.array_equal(lesson.original, comp.primary.original)
    i = lesson.index(sink=4, recent=8, heavy=2, bits=16)
    assert lesson.specs[i] == base and card_values(lesson.metrics[i])["Tokens kept"] == "14 / 64"
    with pytest.raises(SpecError, match="not on the lesson's grid"):
        lesson.index(sink=3, recent=8, heavy=2, bits=16)


def test_long_sources_are_binned_as_in_the_explorer():
    trace = make_synthetic(SyntheticSpec(context=300, steps=2, layers=1, q_heads=2, kv_heads=1))
    view, base = (View(ensemble="heads", ensemble_size=8), Spec(sink=4, recent=32, heavy=16, key_bits=4, value_bits=4))
    grid, start = lesson_grid(302, base, {"sink": (4,), "recent": (0, 32), "heavy": (16,), "bits": (4, 16)})
    lesson = compute_lesson(trace, base, view, grid, start)
    assert lesson.binned and lesson.columns == BIN_COLUMNS and lesson.members == 2
    for i, spec in enumerate(lesson.specs):
        _, frame, binned = expected_frame(trace, spec, view)
        assert binned
        got = lesson.frame(i)
        for col in BIN_COLUMNS:
            assert np.array_equal(got[col], frame[col].to_numpy(), equal_nan=True), (i, col)
        assert np.array_equal(got["kept_tokens"], frame["kept_tokens"].to_numpy())


# --- the page ---------------------------------------------------------------------------------------


def export_handbook_page():
    """The handbook's lesson at 4 bits over SMALL_GRID, with a lecturer's text that tries to end the
    page's script: (page, lesson)."""
    values = {**defaults(), "bits": 4}
    return export_lesson(
        source_from_values(values),
        spec_from_values(values),
        view_from_values(values),
        values,
        SMALL_GRID,
        bars="std",
        lecturer="Week 3: </script><script>alert(1)</script>",
    )


@pytest.fixture(scope="module")
def handbook_page():
    return export_handbook_page()


def test_the_page_holds_the_lesson_exactly(handbook_page):
    page, lesson = handbook_page
    meta, arrays = page_data(page)
    assert np.array_equal(arrays["rows"], lesson.rows) and np.array_equal(arrays["row_of"], lesson.row_of)
    assert np.array_equal(arrays["marks"], lesson.marks) and np.array_equal(arrays["mark_of"], lesson.mark_of)
    assert meta["original"] == lesson.original.tolist() and meta["columns"] == list(TOKEN_COLUMNS)
    assert [s["start"] for s in meta["sliders"]] == [1, 1, 1, 1]  # sink 4, recent 8, heavy 2, bits 4
    strings = arrays["strings"]
    for i in range(lesson.points):
        shown = {f: strings[arrays["text_of"][i, j]] for j, f in enumerate(FIELDS)}
        assert shown == point_texts(lesson, i)
    i = lesson.index(sink=0, recent=8, heavy=2, bits=2)
    # the app quantizes a group the kept tokens do not fill (partial=quantize): 10 kept keys, 2 bits,
    # and no "keys are not quantized" warning
    assert "not quantized" not in strings[arrays["text_of"][i, FIELDS.index("warnings")]]
    start = lesson.index(sink=4, recent=8, heavy=2, bits=4)
    first = lesson.frame(start)
    assert meta["first"]["marks"] == first.pop("reason").tolist() and meta["first"]["text"] == point_texts(
        lesson, start
    )
    assert meta["first"]["columns"] == {k: v.tolist() for k, v in first.items()}
    assert meta["link"]["query"] == {} and meta["link"]["defaults"] == {"sink": 4, "recent": 8, "heavy": 2, "bits": 16}


def test_the_page_runs_only_its_own_script(handbook_page):
    page, _ = handbook_page
    assert page.count("<script") == 3 and "alert(1)</script>" not in page  # the lecturer's text is data
    policy = re.search(r'Content-Security-Policy" content="([^"]+)"', page).group(1)
    assert policy.startswith("default-src 'none'; script-src 'sha256-")
    script = re.search(r"<script>(.*)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in policy and "eval(" not in script and "innerHTML" not in script
    meta, _ = page_data(page)
    assert meta["lecturer"] == "Week 3: </script><script>alert(1)</script>"


def test_one_lesson_is_always_the_same_bytes(handbook_page):
    page, _ = handbook_page
    again, _ = export_handbook_page()
    assert again == page


# --- the command ------------------------------------------------------------------------------------


def small_grid_args():
    return [arg for name, values in SMALL_GRID.items() for arg in ("--grid", f"{name}={','.join(map(str, values))}")]


def test_export_from_a_link(capsys, tmp_path):
    out = tmp_path / "lesson.html"
    link = "http://hall:8501/?sink=0&recent=8&heavy=8&bits=2&scorer=tova&ensemble=none"
    code, _, err = run_cli(
        capsys, "lesson", "export", "--out", str(out), "--from-url", link, "--quiet", *small_grid_args()
    )
    assert code == 0 and f"wrote {out}" in err and "36 settings" in err
    meta, arrays = page_data(out.read_text())
    assert [s["values"][s["start"]] for s in meta["sliders"]] == [0, 8, 8, 2]
    assert meta["link"]["base"] == "http://hall:8501/" and meta["link"]["query"] == {
        "scorer": "tova",
        "ensemble": "none",
    }
    assert meta["members"] == 1 and meta["ensemble"].startswith("layer 0, query head 0")
    start = point(meta, sink=0, recent=8, heavy=8, bits=2)
    assert start == ((0 * 2 + 1) * 3 + 2) * 3 + 0
    comp = compare(
        handbook_trace(), Spec(recent=8, heavy=8, scorer="tova", key_bits=2, value_bits=2, partial="quantize"), View()
    )
    row = arrays["rows"][arrays["row_of"][start]]
    assert np.array_equal(row[0], comp.primary.compressed)
    assert (
        arrays["strings"][arrays["text_of"][start, FIELDS.index("mass")]]
        == card_values(comp.metrics)["Attention mass retained"]
    )


def test_export_a_real_models_trace(capsys, tmp_path):
    """A captured trace's layer and head; its token text goes into the page as data (escaped there)."""
    trace = make_synthetic(SyntheticSpec(context=40, steps=3, layers=2, q_heads=2, kv_heads=1))
    tokens = ("<script>alert(1)</script>",) + tuple(f" word{i}" for i in range(1, trace.n_positions))
    trace = replace(
        trace, tokens=tokens, meta={"source": "model", "model": "tiny-test", "prompt_tokens": 40, "new_tokens": 3}
    )
    path = save_trace(trace, tmp_path / "t.safetensors")
    out = tmp_path / "real.html"
    code, _, err = run_cli(
        capsys,
        "lesson",
        "export",
        "--trace",
        str(path),
        "--layer",
        "1",
        "--head",
        "1",
        "--out",
        str(out),
        "--quiet",
        "--grid",
        "sink=0,1",
        "--grid",
        "recent=4",
        "--grid",
        "heavy=0,4",
        "--grid",
        "bits=16,3",
    )
    assert code == 0, err
    page = out.read_text()
    assert "<script>alert" not in page and page.count("<script") == 3
    meta, arrays = page_data(page)
    assert meta["labels"][0] == "<script>alert(1)</script>" and meta["text_tokens"] is True
    assert meta["source"] == "tiny-test: 40 prompt tokens + 3 generated" and "layer 1, query head 1" in meta["row"]
    comp = compare(
        trace,
        Spec(sink=1, recent=4, heavy=4, key_bits=3, value_bits=3, partial="quantize"),
        View(layer=1, head=1, ensemble="heads"),
    )
    assert [s["values"] for s in meta["sliders"]] == [[0, 1, 4], [4, 8], [0, 2, 4], [3, 16]]  # + the defaults
    i = point(meta, sink=1, recent=4, heavy=4, bits=3)
    assert np.array_equal(arrays["rows"][arrays["row_of"][i]][0], comp.primary.compressed)


def test_cli_compare_and_the_lesson_agree_on_the_handbooks_seeds(capsys):
    """`kvviz compare` draws the handbook's other seeds as the app and the lesson do."""
    code, out, _ = run_cli(
        capsys,
        "compare",
        "--sink",
        "4",
        "--recent",
        "8",
        "--heavy",
        "2",
        "--bits",
        "4",
        "--ensemble",
        "seeds",
        "--ensemble-size",
        "8",
        "--json",
    )
    src = source_from_values(defaults())
    comp = compare(
        src.trace,
        Spec(sink=4, recent=8, heavy=2, key_bits=4, value_bits=4),
        View(ensemble="seeds", ensemble_size=8),
        trace_for_seed=src.trace_for_seed,
    )
    data = json.loads(out)
    assert code == 0 and data["error_std_sample"] == comp.spread.std.tolist() and max(data["error_std_sample"]) > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--from-url", "sink=abc"], "not a number"),
        (["--from-url", "source=file"], "--trace FILE"),
        (["--from-url", "sink=2", "--trace", "missing.safetensors"], "the link's source is the handbook"),
        (["--trace", "missing.safetensors"], "no such trace file"),
        (["--grid", "bits=9"], "bits must be"),
        (["--from-url", "sink=2&split=1&key_bits=4"], "keys and values together"),
        (["--from-url", "sink=70"], "more than the 64 tokens"),
        (["--layer", "3"], "layer 3 does not exist"),
    ],
)
def test_bad_exports_say_why_in_one_line_and_write_nothing(capsys, tmp_path, argv, words):
    out = tmp_path / "never.html"
    code, _, err = run_cli(capsys, "lesson", "export", "--out", str(out), "--quiet", *argv)
    assert code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_wrong_target(capsys, tmp_path):
    code, _, err = run_cli(capsys, "lesson", "export", "--out", str(tmp_path / "x.txt"))
    assert code == 2 and "must end in .html" in err
    code, _, err = run_cli(capsys, "lesson", "export", "--out", str(tmp_path / "no" / "x.html"))
    assert code == 2 and "does not exist" in err
    with pytest.raises(SystemExit):
        main(["lesson", "export", "--out", "x.html", "--preset", "handbook", "--from-url", "sink=1"])
