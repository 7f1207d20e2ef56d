"""The command line for allocation and the new scorers' settings; bad values in one line."""

import json

import pytest

from cli_util import SYNTHETIC_64, WINDOW_4_8_8, run_cli, run_or_exit

# three layers under expected attention with a pyramid allocation of beta 4
PYRAMID = (
    "compare",
    *SYNTHETIC_64,
    "--steps",
    "2",
    "--layers",
    "3",
    *WINDOW_4_8_8,
    "--scorer",
    "expected_attention",
    "--allocation",
    "pyramid",
    "--pyramid-beta",
    "4",
)


def test_allocation_and_scorer_flags_reach_the_spec(capsys):
    code, out, _ = run_cli(capsys, *PYRAMID, "--ea-horizon", "32", "--ea-no-covariance", "--layer", "2", "--json")
    assert code == 0
    d = json.loads(out)
    s = d["spec"]
    assert (s["allocation"], s["pyramid_beta"], s["ea_horizon"], s["ea_covariance"]) == ("pyramid", 4.0, 32, False)
    from kvviz.policies.allocation import pyramid_budgets, pyramid_totals

    assert pyramid_totals(20, 12, 64, 3, 4.0) is None  # kvpress: min 20.5 / 4 < the window
    assert sum(d["kept"]) == 20  # so every layer keeps the uniform budget
    code, out, _ = run_cli(capsys, *PYRAMID, "--pyramid-schedule", "heavy", "--layer", "2", "--json")
    assert code == 0 and json.loads(out)["spec"]["pyramid_schedule"] == "heavy"
    assert sum(json.loads(out)["kept"]) == 4 + 8 + pyramid_budgets(8, 3, 4.0)[2]  # the top layer's budget
    chunks = ("--scorer", "chunkkv", "--chunk-size", "4", "--chunk-scorer", "keydiff")
    code, out, _ = run_cli(capsys, "compare", *chunks, *WINDOW_4_8_8, "--json")
    assert code == 0 and json.loads(out)["spec"]["chunk_size"] == 4
    quest = ("--scorer", "quest", "--page-size", "8")
    code, out, _ = run_cli(capsys, "compare", *quest, "--sink", "0", "--recent", "8", "--heavy", "16")
    assert code == 0 and "saves memory read, not memory stored" in out
    adakv = ("--scorer", "snapkv", "--allocation", "adakv", "--adakv-alpha", "0.5")
    code, out, _ = run_cli(
        capsys, "compare", *SYNTHETIC_64, "--steps", "2", *adakv, *WINDOW_4_8_8, "--ensemble", "heads", "--json"
    )
    assert code == 0 and json.loads(out)["spec"]["adakv_alpha"] == 0.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--adakv-alpha", "1.5", "--allocation", "adakv", "--scorer", "snapkv"],
            "--adakv-alpha: must be at least 0 and at most 1, got 1.5",
        ),
        (["--pyramid-beta", "0.5"], "--pyramid-beta: must be at least 1"),
        (["--scorer", "tova", "--allocation", "adakv"], "AdaKV"),
        (["--scorer", "nope"], "unknown scorer 'nope'"),
        (["--page-size", "0", "--scorer", "quest"], "--page-size: must be 1-4,096, got 0"),
    ],
)
def test_bad_values_are_one_line(capsys, argv, message):
    # a range the parser checks exits through argparse; the spec's own checks return 2
    code, err = run_or_exit(capsys, "compare", "--sink", "4", "--recent", "8", "--heavy", "4", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
