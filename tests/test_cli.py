"""The command line: compare (table and JSON), sweep CSV, one-line errors."""

import csv
import io
import json

import numpy as np
import pytest

from kvviz import Spec, View, compare
from kvviz.cli import main
from kvviz.sources import handbook_trace, save_trace

KEYS = ("mass_retained", "tv_distance", "kl", "kl_forward", "js", "max_abs_error", "output_rel_error",
        "output_cosine", "kv_bytes", "kv_bytes_full", "compression_ratio")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compare_json_matches_engine(capsys):
    code, out, _ = run(capsys, "compare", "--sink", "4", "--recent", "8", "--heavy", "2", "--bits", "4", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("tokens", "original", "compressed", "kept", "error_mean", "error_std_sample", "error_ci95_lo",
                "error_ci95_hi", "error_min", "error_max", "metrics", "definitions"):
        assert key in data
    assert set(KEYS) <= set(data["metrics"])
    assert data["metrics"]["kl_forward"] is None          # infinite: tokens were evicted
    assert "KL(compressed || original)" in data["definitions"]["kl"]
    expected = compare(handbook_trace(), Spec(sink=4, recent=8, heavy=2, key_bits=4, value_bits=4))
    assert data["metrics"]["tv_distance"] == pytest.approx(expected.metrics["tv_distance"], abs=1e-15)
    assert np.flatnonzero(data["kept"]).tolist() == [0, 1, 2, 3, 15, 28, *range(56, 64)]
    assert data["tokens"][:2] == ["t0", "t1"]


def test_compare_table_and_synthetic_ensemble(capsys):
    code, out, _ = run(capsys, "compare", "--source", "synthetic", "--context", "64", "--steps", "4",
                       "--heavy", "8", "--recent", "8", "--ensemble", "heads", "--ensemble-size", "4")
    assert code == 0 and "attention mass retained" in out and "error bars over 4 heads" in out


def test_compare_trace_file(capsys, tmp_path):
    path = save_trace(handbook_trace(), tmp_path / "h.safetensors")
    code, out, _ = run(capsys, "compare", "--source", str(path), "--json", "--ensemble", "seeds",
                       "--quant-model", "noise", "--noise-sigma", "0.1", "--ensemble-size", "5")
    data = json.loads(out)
    assert code == 0 and max(data["error_std_sample"]) > 0
    # the numbers are the engine's on the same trace (a file round trip changes nothing)
    expected = compare(handbook_trace(), Spec(quant_model="noise", noise_sigma=0.1),
                       View(ensemble="seeds", ensemble_size=5))
    for key in ("output_cosine", "tv_distance", "mass_retained"):
        assert data["metrics"][key] == pytest.approx(expected.metrics[key], rel=1e-12, abs=1e-15), key
    np.testing.assert_allclose(data["error_std_sample"], expected.spread.std, rtol=1e-12, atol=1e-15)
    assert 0 < data["metrics"]["output_cosine"] < 1                    # noise moved the output


@pytest.mark.parametrize("argv, words", [
    (["--sink", "-2"], "0 or more"), (["--bits", "0"], "bits"), (["--head", "3"], "head 3"),
    (["--source", "missing.safetensors"], "missing.safetensors"), (["--layer", "7"], "layer 7"),
])
def test_bad_arguments_one_line(capsys, argv, words):
    code, out, err = run(capsys, "compare", *argv) if argv[0] != "--sink" else (None, "", "")
    if argv[0] == "--sink":
        with pytest.raises(SystemExit) as exc:
            main(["compare", *argv])
        code = exc.value.code
        err = capsys.readouterr().err
    assert code == 2 and words in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_sweep_csv(capsys, tmp_path):
    out_file = tmp_path / "s.csv"
    code, _, _ = run(capsys, "sweep", "--source", "synthetic", "--context", "64", "--steps", "4",
                     "--scorers", "h2o,streaming", "--budgets", "0.25,1", "--bits-list", "16,4", "--out", str(out_file))
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out_file.read_text())))
    assert {r["method"] for r in rows} == {"h2o", "streaming", "full"}
    assert {"method", "budget", "bits", "memory_ratio", "tv", "kl_compressed_vs_original", "js",
            "output_error"} <= set(rows[0])
    full16 = [r for r in rows if r["method"] == "full" and r["bits"] == "16"][0]
    assert float(full16["tv"]) == 0 and float(full16["memory_ratio"]) == 1
    quarter = [float(r["memory_ratio"]) for r in rows if r["method"] == "h2o" and r["bits"] == "16"][0]
    assert quarter == pytest.approx(0.25, abs=0.02)
