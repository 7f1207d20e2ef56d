"""Sub-commands of `kvviz` beyond compare / sweep, one module each.

Each module defines `register(subparsers)`, adding its parser with
`set_defaults(func=handler)`. Modules must not import torch at import time: the
handler imports what it needs, so `kvviz compare` stays fast.
"""

import importlib

MODULES = ("capture", "evaluate", "needle")


def register_all(subparsers) -> None:
    for name in MODULES:
        try:
            module = importlib.import_module(f"kvviz.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvviz.cli.{name}":
                raise
            continue  # not written yet
        module.register(subparsers)
