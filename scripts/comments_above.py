"""Move trailing comments that push a line past the line length onto their own line above the code.

    python scripts/comments_above.py [--width 100] PATH...

Run once, before `ruff format`, when the project went from 120 to 100 columns: the formatter
wraps code but never moves a comment, and a comment at the end of a long line is better read above it.
Comments that speak to tools about their own line (`# noqa`, `# type:`, `# pragma`) stay where they are.
A comment is found with Python's own tokenizer, so a '#' inside a string is never touched.
"""

from __future__ import annotations

import argparse
import io
import sys
import tokenize
from pathlib import Path

KEEP = ("# noqa", "# type:", "# pragma", "# fmt:")


def move_comments(text: str, width: int) -> str:
    lines = text.splitlines(keepends=True)
    moves: dict[int, tuple[int, str]] = {}  # line index -> (column of the comment, comment)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        line = lines[row - 1]
        if not line[:col].strip() or len(line.rstrip("\n")) <= width:
            continue  # a comment line already, or short enough
        if tok.string.lower().startswith(KEEP):
            continue
        moves[row - 1] = (col, tok.string)
    for i in sorted(moves, reverse=True):
        col, comment = moves[i]
        line = lines[i]
        code = line[:col].rstrip()
        indent = line[: len(line) - len(line.lstrip())]
        lines[i] = code + "\n"
        lines.insert(i, indent + comment + "\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=100)
    p.add_argument("paths", nargs="+", type=Path)
    a = p.parse_args(argv)
    files = [f for path in a.paths for f in (sorted(path.rglob("*.py")) if path.is_dir() else [path])]
    changed = 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        new = move_comments(text, a.width)
        if new != text:
            compile(new, str(f), "exec")  # the moved comments change no code
            f.write_text(new, encoding="utf-8")
            changed += 1
    print(f"{changed} of {len(files)} files changed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
