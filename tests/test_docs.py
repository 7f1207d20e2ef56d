"""The docs tell the truth: the fenced commands and snippets of README.md and docs/*.md run as written.

How a fenced block is read (docs/development.md, "The docs are tested"):

- ```bash: every command (one line; a trailing backslash continues it) runs in bash and must exit 0.
- ```console: a line `$ COMMAND` runs and must exit 0; the lines under it, up to the next `$ `, are what it
  prints. Each must be a line of its output (stdout and stderr, `\\r` progress lines split), in that order,
  with runs of spaces compared as one; a line `...` stands for any lines, and `...` inside a line for any
  text. A command expected to fail is written as it would be typed to see that: `CMD; echo "exit $?"`.
- ```python: runs as a script and must exit 0. A block whose first line is `# NAME.py` is a file the docs
  use (a plug-in): it is written as NAME.py into every block's folder, and run once itself.
- Other fences (toml, mermaid, plain output) are not run.

An HTML comment on the line just before the opening fence (or just after the closing one) changes that:
`<!-- docs-test: skip (REASON) -->` leaves the block out (the reason is required, and a test keeps the
skips few); `<!-- docs-test: model -->` (or `ray`, comma-separated) runs it under those pytest markers, so
`make test` runs it and `make test-fast` (`-m core`) does not; `slow` marks a block of minutes (a decode
loop, a model study, the full handbook lesson), which runs only when KVVIZ_DOCS_SLOW=1 is set, so that
the suite does not grow by minutes: `KVVIZ_DOCS_SLOW=1 pytest tests/test_docs.py` runs every block.

Each block runs in a new empty folder holding links to the repository's files (`examples/...`,
`kvviz/data/sample.txt` resolve; what a command writes stays out of the checkout), where `kvviz`,
`python` and `.venv/bin/python` run this interpreter on this checkout, offline (HF_HUB_OFFLINE=1), with
the trace and needle caches (KVVIZ_CACHE_DIR) in the folder. Skipped blocks are still checked for what
can be checked without running them: their `kvviz` imports resolve and the repository paths they name
exist. Markdown links between the docs must resolve, anchors included.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash", "console", "python"}
MARKERS = {"model", "slow", "ray"}  # pytest markers a block may carry (pyproject.toml registers them)
MAX_SKIPS = 13  # of 30 runnable blocks: what cannot run here at all
TIMEOUT = {"model": 900, "slow": 900, "ray": 600}  # seconds a command may take, by its block's marker
DEFAULT_TIMEOUT = 180
MARK = re.compile(r"^<!--\s*docs-test:\s*(?P<what>[a-z, ]+?)\s*(?:\((?P<reason>.*)\))?\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marks: set = field(default_factory=set)
    skip: str | None = None  # the reason, when skipped

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def file_name(self) -> str | None:
        """NAME.py when this python block is a file the docs use (its first line is `# NAME.py`)."""
        m = (
            re.match(r"#\s*([\w.-]+\.py)\s*$", self.text.splitlines()[0])
            if self.lang == "python" and self.text
            else None
        )
        return m.group(1) if m else None


def _marker(line: str, where: str) -> tuple[set, str | None] | None:
    """(markers, reason) of a docs-test comment: a line of its own, from its first column (an indented
    one is an example in the text, not a marker)."""
    if not line.startswith("<!--"):
        return None
    m = MARK.match(line.rstrip())
    if not m:
        if "docs-test" in line:
            raise ValueError(f"{where}: unreadable docs-test comment {line.strip()!r}")
        return None
    words = {w for w in re.split(r"[,\s]+", m.group("what")) if w}
    unknown = words - MARKERS - {"skip"}
    if unknown:
        raise ValueError(f"{where}: unknown docs-test word(s) {sorted(unknown)} (skip, {', '.join(sorted(MARKERS))})")
    reason = (m.group("reason") or "").strip()
    if "skip" in words and not reason:
        raise ValueError(f"{where}: a docs-test skip needs its reason: <!-- docs-test: skip (why) -->")
    return words, reason or None


def parse(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with their docs-test markers."""
    lines = path.read_text().splitlines()
    blocks, i, used = [], 0, set()
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path.name}:{i + 1}: a fence that never closes")
        block = Block(path, i + 1, m.group("lang"), textwrap.dedent("\n".join(lines[i + 1 : j])))
        for k in (i - 1, j + 1):  # the line before the opening fence, the line after the closing one
            if 0 <= k < len(lines) and (found := _marker(lines[k], f"{path.name}:{k + 1}")):
                if k in used:
                    raise ValueError(f"{path.name}:{k + 1}: this docs-test comment touches two blocks")
                used.add(k)
                words, reason = found
                block.marks |= words & MARKERS
                if "skip" in words:
                    block.skip = reason
        blocks.append(block)
        i = j + 1
    markers = {k for k, line in enumerate(lines) if line.startswith("<!--") and "docs-test" in line}
    loose = markers - used
    if loose:
        raise ValueError(f"{path.name}:{min(loose) + 1}: a docs-test comment next to no fence")
    return blocks


BLOCKS = [b for p in DOCS for b in parse(p)]
RUNNABLE = [b for b in BLOCKS if b.lang in RUN]
FILES = {b.file_name: b.text for b in RUNNABLE if b.file_name}


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) in the block's order; bash blocks expect nothing printed."""
    out: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    k = 0
    while k < len(lines):
        line = lines[k]
        if block.lang == "console" and not line.startswith("$ "):
            if not out:
                raise ValueError(f"{block.name}: console output before any `$ ` command")
            out[-1][1].append(line)
            k += 1
            continue
        cmd = line[2:] if block.lang == "console" else line
        while cmd.rstrip().endswith("\\") and k + 1 < len(lines):
            k += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[k].strip()
        if cmd.strip() and not cmd.lstrip().startswith("#"):
            out.append((cmd, []))
        k += 1
    return out


def _norm(s: str) -> str:
    return " ".join(s.split())


def missing_output(expected: list[str], output: str) -> str | None:
    """None if every expected line is a line of `output`, in order (`...` lines skipped; `...` within a
    line matches any text); else the first expected line that is not there."""
    got = [_norm(x) for x in re.split(r"[\r\n]+", output)]
    pos = 0
    for want in (_norm(x) for x in expected):
        if not want or want == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")))
        while pos < len(got) and not pattern.fullmatch(got[pos]):
            pos += 1
        if pos == len(got):
            return want
        pos += 1
    return None


def workdir(tmp: Path) -> tuple[Path, dict]:
    """A folder of links to the repository's files, with shims that run this interpreter; its environment."""
    tmp.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if (entry.name.startswith(".") and entry.name != ".streamlit") or entry.name in (
            "runs",
            "test-artifacts",
            "test-results",
            "mutants",
            "build",
            "dist",
            "__pycache__",
        ):
            continue
        (tmp / entry.name).symlink_to(entry)
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, args in (("python", ""), ("python3", ""), ("kvviz", " -m kvviz"), ("streamlit", " -m streamlit")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        shim.chmod(0o755)
    for name, text in FILES.items():
        (tmp / name).write_text(text + "\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "KVVIZ_CACHE_DIR": str(tmp / ".kvviz-cache"),
        "COLUMNS": "200",
    }
    return tmp, env


def run_block(block: Block, tmp: Path) -> None:
    """Run every command of the block in a fresh folder; fail with the command and its output."""
    cwd, env = workdir(tmp)
    timeout = max([TIMEOUT[m] for m in block.marks] or [DEFAULT_TIMEOUT])
    if block.lang == "python":
        script = cwd / (block.file_name or f"docs_block_{block.line}.py")
        script.write_text(block.text + "\n")
        todo = [(f'python "{script.name}"', [])]
    else:
        todo = commands(block)
    assert todo, f"{block.name}: a {block.lang} block with nothing to run"
    for cmd, expected in todo:
        try:
            r = subprocess.run(
                ["bash", "-c", cmd],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.name}: `{cmd}` ran past {timeout} s")
        output = r.stdout  # stdout and stderr as one stream, in the order they were written
        tail = output[-3000:]
        assert r.returncode == 0, f"{block.name}: `{cmd}` exited {r.returncode}:\n{tail}"
        if expected:
            wrong = missing_output(expected, output)
            assert wrong is None, f"{block.name}: `{cmd}` did not print the line\n  {wrong}\nit printed:\n{tail}"


SLOW = os.environ.get("KVVIZ_DOCS_SLOW") == "1"


def _params():
    for b in RUNNABLE:
        if b.skip:
            continue
        marks = [getattr(pytest.mark, m) for m in sorted(b.marks)]
        if "slow" in b.marks and not SLOW:
            marks.append(pytest.mark.skip(reason="a docs block of minutes: KVVIZ_DOCS_SLOW=1 runs it"))
        yield pytest.param(b, id=b.name, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_doc_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


def test_the_docs_have_blocks_to_run() -> None:
    """The parser reads the docs (a broken fence or marker raises while collecting, above)."""
    assert {b.path.name for b in RUNNABLE} >= {"README.md", "cli.md", "studies.md", "lesson.md", "plugins.md"}
    assert sum(1 for b in RUNNABLE if not b.skip and not b.marks) >= 8


def test_skips_are_few_and_each_says_why() -> None:
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert all(b.lang in RUN for b in skipped), [b.name for b in skipped if b.lang not in RUN]
    assert all(len(b.skip) >= 10 for b in skipped), [b.name for b in skipped if len(b.skip) < 10]
    assert len(skipped) <= MAX_SKIPS, f"{len(skipped)} skipped blocks: " + ", ".join(b.name for b in skipped)
    assert 2 * len(skipped) < len(RUNNABLE), "half of the runnable blocks are skipped"


IMPORT = re.compile(
    r"^[ \t]*from[ \t]+(kvviz[\w.]*)[ \t]+import[ \t]+(?:\(([\w\s,]+)\)|([\w \t,]+))|^[ \t]*import[ \t]+(kvviz[\w.]*)",
    re.M,
)


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.lang == "python"], ids=lambda b: b.name)
def test_kvviz_imports_in_python_blocks_resolve(block: Block) -> None:
    """Every python block's kvviz imports exist, the skipped ones' too (a renamed module shows here)."""
    for m in IMPORT.finditer(block.text):
        module = importlib.import_module(m.group(1) or m.group(4))
        for name in filter(None, (n.strip() for n in (m.group(2) or m.group(3) or "").split(","))):
            assert hasattr(module, name), f"{block.name}: {module.__name__} has no {name}"


REPO_PATH = re.compile(r"(?<![\w/.~:-])((?:benchmarks|scripts|examples|tests|kvviz|docs|pages)/[\w./-]*\w)")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in RUN and b.lang != "python"], ids=lambda b: b.name)
def test_repository_paths_in_commands_exist(block: Block) -> None:
    """Each repository file a command names is there, in skipped blocks too (a moved script shows here)."""
    for cmd, _ in commands(block):
        for p in REPO_PATH.findall(cmd.split(" #")[0]):
            assert (ROOT / p).exists() or p.endswith((".png", ".csv", ".html")), (
                f"{block.name}: no {p} in the repository"
            )


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().splitlines():
        if m := re.match(r"^#{1,6}\s+(.*)", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_the_docs_resolve(path: Path) -> None:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(dest), f"{path.name}: link to {target}: no such heading in {dest.name}"


def test_the_needle_grid_in_the_docs_is_the_shipped_one() -> None:
    """docs/needle.md's grid (too slow to recompute here) is what the shipped grid prints."""
    from kvviz.analysis import needle as nd

    # the shipped file's two grids: after and before the question (a grid compressed again while decoding is
    # another run, which its own block runs under KVVIZ_DOCS_SLOW=1)
    blocks = [
        b for b in BLOCKS if b.lang == "console" and "kvviz needle" in b.text and "--compress-every" not in b.text
    ]
    assert len(blocks) == 2
    for block in blocks:
        [(cmd, expected)] = commands(block)
        grid = nd.load_default(question_after_compression="--question-after-compression" in cmd)
        shown = nd.format_grid(grid).splitlines()
        assert [_norm(x) for x in expected if x.strip()] == [_norm(x) for x in shown if x.strip()]
        s = grid.settings  # the command line names the shipped grid's settings
        assert f"--lengths {','.join(map(str, s['lengths']))}" in cmd
        assert f"--scorers {','.join(s['scorers'])}" in cmd and f"--budget {s['budgets'][0]:g}" in cmd


def test_the_checker_fails_on_a_wrong_line_or_a_failing_command(tmp_path: Path) -> None:
    """run_block can fail: a command that exits 1, a line that is not printed, lines out of order."""

    def block(lang, text):
        return Block(ROOT / "README.md", 1, lang, text)

    run_block(block("console", '$ printf "a\\n  b   c\\nd\\n"\na\n...\nb c\nd'), tmp_path / "ok")
    run_block(block("console", '$ printf "x 1.5 y\\n"\nx ... y'), tmp_path / "wild")
    for i, (lang, text) in enumerate(
        [
            ("bash", "true\nfalse"),
            ("console", "$ echo a\nb"),
            ("console", '$ printf "a\\nb\\n"\nb\na'),
            ("python", "raise SystemExit(3)"),
        ]
    ):
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            run_block(block(lang, text), tmp_path / str(i))
