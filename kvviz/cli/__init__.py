"""The `kvviz` command line: the parser and shared argument groups (`parser`), one command a module.

May import: every layer below the app (core, sources, policies, quant, engine, analysis, decode,
models), never `kvviz.app` or Streamlit. Command modules import torch only inside their handlers,
so `kvviz compare` starts fast.
"""

from kvviz.cli.parser import main

__all__ = ["main"]
