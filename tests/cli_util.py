"""Shared test helpers for the command line: run `kvviz ...` in this process and read what it printed."""

import json

# The small synthetic source the command-line tests compare on: 64 tokens, fast enough for any test.
SYNTHETIC_64 = ("--source", "synthetic", "--context", "64")
# A window of 4 sink, 8 recent and 8 heavy tokens (20 kept of the 64).
WINDOW_4_8_8 = ("--sink", "4", "--recent", "8", "--heavy", "8")


def run_cli(capsys, *argv):
    """Run the command line on argv (each value str()-ed, so paths and numbers pass as they are);
    returns (exit status, stdout, stderr)."""
    from kvviz.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_or_exit(capsys, *argv):
    """(exit status, stderr) whether the parser exits (SystemExit) or main returns."""
    from kvviz.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def eval_json(capsys, *argv) -> dict:
    """Run `kvviz eval *argv --quiet --json`, which must succeed; returns the JSON object it printed."""
    code, out, err = run_cli(capsys, "eval", *argv, "--quiet", "--json")
    assert code == 0, err
    return json.loads(out)
