"""The `kvviz` command line: one parser, one sub-command a module (each has `register(sub)`).

Command modules import torch only inside their handlers, so `kvviz compare` starts fast.
"""

from __future__ import annotations

import sys

from kvviz.cli import capture, compare, evaluate, leaderboard, ledger, lesson, needle, solve, study, sweep, trace
from kvviz.cli.args import CliError, OneLineParser
from kvviz.limits import ENV
from kvviz.spec import SpecError
from kvviz.trace import TraceError

# in the order --help lists them
COMMANDS = (compare, sweep, solve, ledger, capture, trace, evaluate, needle, leaderboard, lesson, study)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="kvviz", description="See what KV-cache compression does to attention.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    OneLineParser.argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    except (SpecError, TraceError, CliError) as exc:
        print(f"kvviz: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C in a long computation: one line, the shell's status for SIGINT
    except KeyboardInterrupt:
        print("kvviz: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(
            f"kvviz: error: out of memory; lower the sizes, or the work budget ({ENV}) so kvviz refuses "
            "such a request up front",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:  # ModelError and friends: one line, no traceback
        from kvviz.models import ModelError

        if isinstance(exc, (ModelError, FileNotFoundError, PermissionError)):
            print(f"kvviz: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
