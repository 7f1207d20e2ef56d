"""The command line: compare (table and JSON), sweep CSV, one-line errors."""

import csv
import io
import json

import numpy as np
import pytest

from kvviz import Spec, View, compare
from kvviz.cli import main
from kvviz.sources import handbook_trace, save_trace

from cli_util import SYNTHETIC_64, run_cli, run_or_exit
from test_engine import TO_JSON_KEYS

KEYS = (
    "mass_retained",
    "tv_distance",
    "kl",
    "kl_forward",
    "js",
    "max_abs_error",
    "output_rel_error",
    "output_cosine",
    "kv_bytes",
    "kv_bytes_full",
    "compression_ratio",
)


def test_compare_json_matches_engine(capsys):
    code, out, _ = run_cli(capsys, "compare", "--sink", "4", "--recent", "8", "--heavy", "2", "--bits", "4", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {*TO_JSON_KEYS, "definitions"}
    assert set(KEYS) <= set(data["metrics"])
    assert data["metrics"]["kl_forward"] is None  # infinite: tokens were evicted
    assert "KL(compressed || original)" in data["definitions"]["kl"]
    expected = compare(handbook_trace(), Spec(sink=4, recent=8, heavy=2, key_bits=4, value_bits=4))
    assert data["metrics"]["tv_distance"] == pytest.approx(expected.metrics["tv_distance"], abs=1e-15)
    assert np.flatnonzero(data["kept"]).tolist() == [0, 1, 2, 3, 15, 28, *range(56, 64)]
    assert data["tokens"][:2] == ["t0", "t1"]


def test_compare_table_and_synthetic_ensemble(capsys):
    code, out, _ = run_cli(
        capsys,
        "compare",
        *SYNTHETIC_64,
        "--steps",
        "4",
        "--heavy",
        "8",
        "--recent",
        "8",
        "--ensemble",
        "heads",
        "--ensemble-size",
        "4",
    )
    assert code == 0 and "attention mass retained" in out and "error bars over 4 heads" in out


def test_compare_trace_file(capsys, tmp_path):
    path = save_trace(handbook_trace(), tmp_path / "h.safetensors")
    code, out, _ = run_cli(
        capsys,
        "compare",
        "--source",
        str(path),
        "--json",
        "--ensemble",
        "seeds",
        "--quant-model",
        "noise",
        "--noise-sigma",
        "0.1",
        "--ensemble-size",
        "5",
    )
    data = json.loads(out)
    assert code == 0 and max(data["error_std_sample"]) > 0
    # the numbers are the engine's on the same trace (a file round trip changes nothing)
    expected = compare(
        handbook_trace(), Spec(quant_model="noise", noise_sigma=0.1), View(ensemble="seeds", ensemble_size=5)
    )
    for key in ("output_cosine", "tv_distance", "mass_retained"):
        assert data["metrics"][key] == pytest.approx(expected.metrics[key], rel=1e-12, abs=1e-15), key
    np.testing.assert_allclose(data["error_std_sample"], expected.spread.std, rtol=1e-12, atol=1e-15)
    assert 0 < data["metrics"]["output_cosine"] < 1  # noise moved the output


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--sink", "-2"], "--sink: must be 0-1,000,000, got -2"),
        (["--bits", "0"], "bits"),
        (["--head", "3"], "head 3"),
        (["--source", "missing.safetensors"], "missing.safetensors"),
        (["--layer", "7"], "layer 7"),
    ],
)
def test_bad_arguments_one_line(capsys, argv, words):
    code, err = run_or_exit(capsys, "compare", *argv)
    assert code == 2 and words in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_sweep_csv(capsys, tmp_path):
    out_file = tmp_path / "s.csv"
    code, _, _ = run_cli(
        capsys,
        "sweep",
        *SYNTHETIC_64,
        "--steps",
        "4",
        "--scorers",
        "h2o,streaming",
        "--budgets",
        "0.25,1",
        "--bits-list",
        "16,4",
        "--out",
        str(out_file),
    )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out_file.read_text())))
    assert {r["method"] for r in rows} == {"h2o", "streaming", "full"}
    assert {"method", "budget", "bits", "memory_ratio", "tv", "kl_compressed_vs_original", "js", "output_error"} <= set(
        rows[0]
    )
    full16 = [r for r in rows if r["method"] == "full" and r["bits"] == "16"][0]
    assert float(full16["tv"]) == 0 and float(full16["memory_ratio"]) == 1
    quarter = [float(r["memory_ratio"]) for r in rows if r["method"] == "h2o" and r["bits"] == "16"][0]
    assert quarter == pytest.approx(0.25, abs=0.02)


# --- the work budget and argument ranges: exit 2, one line, before anything is built ----------


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["compare", "--source", "synthetic", "--layers", "100000", "--heads", "100000"],
            "argument --layers: must be 1-128, got 100,000",
        ),
        (
            [
                "compare",
                "--source",
                "synthetic",
                "--context",
                "32768",
                "--layers",
                "32",
                "--heads",
                "32",
                "--kv-heads",
                "8",
            ],
            "the synthetic pattern needs 32 layers × 32 query heads × 32,800 positions × 64 dims × 4 B = 8.6 GB of "
            "queries",
        ),
        (["compare", "--source", "synthetic", "--head-dim", "0"], "argument --head-dim: must be 8-1,024, got 0"),
        (["compare", "--ensemble-size", "100000"], "argument --ensemble-size: must be 1-256, got 100,000"),
        (["compare", "--context", "1e9"], "argument --context: expected an integer, got '1e9'"),
        (["sweep", "--budgets", "-1,abc"], "a value that starts with '-' must be attached with '=': --budgets=-1,abc"),
        (["sweep", "--budgets=-1,abc"], "argument --budgets: '-1' in '-1,abc': must be above 0 and at most 1, got -1"),
        (["sweep", "--budgets=0.5,abc"], "argument --budgets: 'abc' in '0.5,abc': expected a number"),
        (["sweep", "--bits-list", "16,99"], "argument --bits-list: '99' in '16,99': must be 1-16, got 99"),
        (["solve", "--target-mass", "nan"], "argument --target-mass: expected a finite number"),
        (
            ["capture", "--new-tokens", "-3", "--prompt", "hi", "--out", "x.safetensors"],
            "argument --new-tokens: must be 0-1,024, got -3",
        ),
    ],
)
def test_out_of_range_and_oversized_requests_are_one_line(capsys, monkeypatch, argv, words):
    import kvviz.models
    import kvviz.sources.synthetic

    monkeypatch.setattr(kvviz.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(kvviz.sources.synthetic.np, "zeros", lambda *a, **k: pytest.fail("allocated a trace"))
    code, err = run_or_exit(capsys, *argv)
    assert code == 2 and words in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_oversized_trace_file_is_refused_from_its_header(capsys, tmp_path, monkeypatch):
    """Format 1 is read whole: refused from its header's sizes. Format 2 opens lazily: the budget
    applies to what the view reads (one layer), so the same trace in format 2 opens."""
    from trace_util import save_trace_format_1

    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

    traces = {
        n: make_synthetic(SyntheticSpec(context=n, steps=0, layers=2, q_heads=4, kv_heads=4)) for n in (1024, 2048)
    }
    small = save_trace_format_1(traces[1024], tmp_path / "small.safetensors")
    big = save_trace_format_1(traces[2048], tmp_path / "big.safetensors")
    monkeypatch.setenv("KVVIZ_MAX_BYTES", "16MB")  # loading holds a file's bytes and its arrays: 2 x 6.3 MB fits
    code, err = run_or_exit(capsys, "compare", "--source", str(small))
    assert code == 0
    code, err = run_or_exit(capsys, "compare", "--source", str(big))  # 2 x 12.6 MB does not
    assert code == 2 and "the trace file big.safetensors needs" in err and "the limit is 16.0 MB" in err
    assert len(err.strip().splitlines()) == 1
    lazy = save_trace(traces[2048], tmp_path / "big2.safetensors")
    code, err = run_or_exit(capsys, "compare", "--source", str(lazy), "--layer", "1")
    assert code == 0, err


def test_compare_help_opens_with_examples_that_run_as_shown(capsys):
    import shlex

    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    shown = capsys.readouterr().out
    assert shown.index("examples:") < shown.index("options:") and shown.startswith("usage: kvviz compare [options]")
    commands, line = [], ""
    for text in shown.split("options:")[0].splitlines():  # a command, continued after a backslash
        text = text.strip()
        if line or text.startswith("kvviz compare"):
            line += " " + text.removesuffix("\\")
            if not text.endswith("\\"):
                commands.append(line.strip())
                line = ""
    assert len(commands) == 3
    for command in commands:
        argv = shlex.split(command)[1:]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0 and not err, (command, err)
        assert "spec:" in out and "pos token" in out, command  # the table, token by token
