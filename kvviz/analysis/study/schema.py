"""The study file (TOML): what to run as a grid, checked whole before anything runs.

    name = "quarter-cache"
    [source]                 kind = "synthetic" | "model" | "needle", and that kind's settings
    [grid]                   the lists the cells are the product of

Every key is checked for its name, its type and its range; an unknown key, a wrong type or an
impossible cell is one `StudyError` naming the key (`[grid] budgets: ...`). Lists are the grid's
axes; a cell is one value of each, and its columns are the keys' singular names (`seeds` -> `seed`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvviz.spec import FULL_BITS, SpecError

FORMAT = 1  # bump when a cell's meaning changes: every cell id changes with it
KINDS = ("synthetic", "model", "needle")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "auto", "mps")
SAMPLE = "sample"  # the bundled English sample text (kvviz/data/sample.txt)
MIN_MODEL_BUDGET = 8  # tokens: 4 sinks + a window (as `kvviz eval-sweep --budgets`)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class StudyError(SpecError):
    """A study file that cannot run as written; the message names the key to change."""


@dataclass(frozen=True)
class Key:
    """One key of a table: its type, default, and (for a list) the singular column it becomes."""

    type: str  # int | float | str | bool | ints | floats | strs
    default: Any = None  # None + required=False: absent means "not set"
    required: bool = False
    axis: str | None = None  # a list the grid runs over: the column name of one value
    choices: tuple = ()
    # changes a cell's numbers (False: scheduling only, e.g. GPUs per actor)
    identity: bool = True
    # left out of the cell ids at its default: a key added later keeps the ids of the studies written before it
    later: bool = False


def _synthetic_keys() -> dict[str, Key]:
    from kvviz.sources.synthetic import SyntheticSpec

    keys = {
        f.name: Key("float" if isinstance(f.default, float) else "int", f.default)
        for f in fields(SyntheticSpec)
        if f.name != "seed"
    }
    keys["seeds"] = Key("ints", required=True, axis="seed")
    keys["layer"] = Key("int", 0)
    keys["ensemble"] = Key("str", "heads", choices=("heads", "layers", "steps"))
    return keys


_MODEL_COMMON = {
    "models": Key("strs", required=True, axis="model"),
    "dtype": Key("str", "float32", choices=DTYPES),
    "device": Key("str", "cpu", choices=DEVICES),
    "gpus": Key("int", 0, identity=False),
}
SOURCE_KEYS: dict[str, dict[str, Key]] = {
    "synthetic": {},  # filled lazily (SyntheticSpec's fields): see source_keys()
    "model": {
        **_MODEL_COMMON,
        "texts": Key("strs", [SAMPLE], axis="text"),
        "prompt_tokens": Key("int", 206),
        "continuation_tokens": Key("int", None),
        # a question after the context (kvviz eval --question); "" = none
        "question": Key("str", "", later=True),
    },
    "needle": {
        **_MODEL_COMMON,
        "lengths": Key("ints", required=True, axis="length"),
        "depths": Key("floats", required=True, axis="depth"),
        "seed": Key("int", 0),
        "haystack": Key("str", "filler", choices=("filler", "sample")),
        "question_after_compression": Key("bool", False),
        "new_tokens": Key("int", 8),
        # what is hidden and asked (kvviz.analysis.needle.tasks); a leaderboard runs several
        "tasks": Key("strs", ["passkey"], axis="task", later=True),
    },
}
GRID_KEYS: dict[str, dict[str, Key]] = {
    "synthetic": {
        "scorers": Key("strs", required=True, axis="scorer"),
        "budgets": Key("floats", required=True, axis="budget"),
        "bits": Key("ints", [FULL_BITS], axis="bits"),
        "formats": Key("strs", [], axis="format"),
    },
    "model": {
        "methods": Key("strs", required=True, axis="method"),
        "budgets": Key("floats", [], axis="budget"),
        "bits": Key("ints", [FULL_BITS], axis="bits"),
        # with a [source] question: where the cache is compressed (kvviz eval --compression-point)
        "question_points": Key(
            "strs", ["before-question"], axis="question_point", choices=("before-question", "after-question")
        ),
    },
    "needle": {
        "scorers": Key("strs", required=True, axis="scorer"),
        "budgets": Key("floats", [0.25], axis="budget"),
        "bits": Key("ints", [FULL_BITS], axis="bits"),
        # both question protocols as an axis (a leaderboard); empty: [source] question_after_compression decides
        "protocols": Key("strs", [], axis="protocol", choices=("question-aware", "query-agnostic"), later=True),
    },
}
# Spec settings that are not axes of their own here: the grid's scorers / budgets / bits / formats set them, the
# synthetic source has its own seeds, and the key positions are the real-model decode's
NOT_SETTING_AXES = frozenset(
    {"sink", "recent", "heavy", "scorer", "seed", "positions", "key_bits", "value_bits", "key_format", "value_format"}
)
_LIST_OF = {"int": "ints", "float": "floats", "bool": "bools", "choice": "strs"}


def setting_axes() -> dict[str, Key]:
    """A synthetic study's axes over Spec settings, one per declared setting (kvviz.settings), named as the
    Spec keyword: `[grid] chunk_size = [10, 20]`. An empty list (the default) is no axis: the cells keep the
    setting's default and their ids do not mention it."""
    from kvviz.settings import SETTINGS

    return {
        name: Key(_LIST_OF[s.kind], [], axis=name, choices=s.values if s.kind == "choice" else ())
        for name, s in SETTINGS.items()
        if name not in NOT_SETTING_AXES
    }


# The Spec-setting axes a needle study takes: what its GridRequest carries (compression during decoding)
NEEDLE_SETTING_AXES = ("compress_every",)


def study_setting_axes(kind: str) -> dict[str, Key]:
    """The Spec-setting axes of a study kind: every declared setting for synthetic and model studies (a model
    cell's spec takes a value where the setting applies to its method), NEEDLE_SETTING_AXES for a needle study."""
    axes = setting_axes()
    return axes if kind != "needle" else {k: axes[k] for k in NEEDLE_SETTING_AXES}


def grid_keys(kind: str) -> dict[str, Key]:
    """The [grid] keys of a study kind, the Spec-setting axes included (study_setting_axes)."""
    return GRID_KEYS[kind] | study_setting_axes(kind)


TOP_KEYS = {
    "name": Key("str", required=True),
    "description": Key("str", ""),
    "source": Key("table", required=True),
    "grid": Key("table", required=True),
}


def source_keys(kind: str) -> dict[str, Key]:
    keys = {"kind": Key("str", required=True, choices=KINDS)}
    return keys | (_synthetic_keys() if kind == "synthetic" else SOURCE_KEYS[kind])


# --- reading ----------------------------------------------------------------------------------

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "ints": "a list of integers",
    "floats": "a list of numbers",
    "strs": "a list of strings",
    "bools": "a list of true / false",
    "table": "a table",
}


def _check_value(where: str, key: Key, value: Any) -> Any:
    def bad() -> StudyError:
        return StudyError(f"{where}: expected {_TYPE_WORDS[key.type]}, got {value!r}")

    def one(kind: str, v: Any) -> Any:
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad()
            return v
        if kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad()
            return float(v)
        if kind == "str":
            if not isinstance(v, str):
                raise bad()
            return v
        if kind == "bool":
            if not isinstance(v, bool):
                raise bad()
            return v
        if kind == "table":
            if not isinstance(v, dict):
                raise bad()
            return v
        raise AssertionError(kind)

    if key.type in ("ints", "floats", "strs", "bools"):
        if not isinstance(value, list):
            raise bad()
        items = [one(key.type[:-1], v) for v in value]
        if key.required and not items:
            raise StudyError(f"{where}: give at least one value")
        dup = next((v for i, v in enumerate(items) if v in items[:i]), None)
        if dup is not None:
            raise StudyError(f"{where}: {dup!r} is listed twice")
        if key.choices:
            wrong = [v for v in items if v not in key.choices]
            if wrong:
                raise StudyError(f"{where}: {wrong[0]!r} is not one of {', '.join(map(str, key.choices))}")
        return items
    out = one(key.type, value)
    if key.choices and out not in key.choices:
        raise StudyError(f"{where}: {out!r} is not one of {', '.join(map(str, key.choices))}")
    return out


def _table(where: str, raw: dict, keys: dict[str, Key]) -> dict[str, Any]:
    unknown = [k for k in raw if k not in keys]
    if unknown:
        raise StudyError(f"{where}: unknown key {unknown[0]!r}; the keys here are {', '.join(keys)}")
    out = {}
    for name, key in keys.items():
        label = f"{where} {name}" if where else name
        if name in raw:
            out[name] = _check_value(label, key, raw[name])
        elif key.required:
            raise StudyError(f"{label}: missing (required)")
        else:
            out[name] = list(key.default) if isinstance(key.default, list) else key.default
    return out


@dataclass(frozen=True)
class Cell:
    """One task of the grid: its settings (column -> value) and its id (a hash of every setting
    that changes its numbers)."""

    id: str
    kind: str
    settings: dict = field(hash=False)

    def label(self) -> str:
        columns = [*AXIS_COLUMNS, *(k for k in self.settings if k not in AXIS_COLUMNS and k in setting_axes())]
        return " ".join(
            f"{k}={self.settings[k]:g}" if isinstance(self.settings[k], float) else f"{k}={self.settings[k]}"
            for k in columns
            if k in self.settings
        )


# the columns a grid runs over (the singular names of the list keys)
AXIS_COLUMNS = (
    "model",
    "text",
    "seed",
    "length",
    "depth",
    "method",
    "scorer",
    "budget",
    "bits",
    "format",
    "question_point",
)


@dataclass(frozen=True)
class Study:
    """A checked study file: the name, the kind, the fixed settings and the grid's axes."""

    name: str
    kind: str
    description: str
    source: dict  # every [source] key, defaults filled in
    grid: dict  # every [grid] key, defaults filled in
    text: str = ""  # the file as written
    base_dir: str = "."  # where relative text paths are read from

    def fixed(self) -> dict:
        """The settings every cell shares (not a list the grid runs over): a folder's results are
        comparable only under the same fixed settings."""
        keys = source_keys(self.kind)
        return {
            "name": self.name,
            "kind": self.kind,
            **{
                k: v
                for k, v in self.source.items()
                if k != "kind"
                and not keys[k].axis
                and keys[k].identity
                and not (keys[k].later and v == keys[k].default)
            },
        }

    def axes(self) -> dict:
        keys = source_keys(self.kind) | grid_keys(self.kind)
        return {k: v for k, v in (self.source | self.grid).items() if k in keys and keys[k].axis}


def read_study(text: str, base_dir: str | Path = ".", origin: str = "study file") -> Study:
    """A Study from TOML text with every key's name and type checked (StudyError naming the key);
    kvviz.analysis.study.grid.parse_study also checks the ranges and every cell."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise StudyError(f"{origin} is not valid TOML: {exc}") from None
    top = _table("", raw, TOP_KEYS)
    if not NAME_RE.match(top["name"]):
        raise StudyError(
            "name: use letters, digits, '-', '_' or '.' (up to 64), starting with a letter or digit; "
            f"got {top['name']!r}"
        )
    kind = raw["source"].get("kind")
    if kind not in KINDS:
        raise StudyError(f"[source] kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    source = _table("[source]", top["source"], source_keys(kind))
    grid = _table("[grid]", top["grid"], grid_keys(kind))
    return Study(
        name=top["name"],
        kind=kind,
        description=top["description"],
        source=source,
        grid=grid,
        text=text,
        base_dir=str(Path(base_dir).resolve()),
    )


def cell_id(kind: str, fixed: dict, settings: dict) -> str:
    """16 hex digits of sha256 over everything that decides the cell's numbers."""
    blob = json.dumps({"format": FORMAT, "kind": kind, "fixed": fixed, "cell": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


__all__ = [
    "AXIS_COLUMNS",
    "Cell",
    "DEVICES",
    "DTYPES",
    "FORMAT",
    "GRID_KEYS",
    "KINDS",
    "Key",
    "MIN_MODEL_BUDGET",
    "SAMPLE",
    "SOURCE_KEYS",
    "Study",
    "StudyError",
    "cell_id",
    "grid_keys",
    "read_study",
    "setting_axes",
    "source_keys",
    "study_setting_axes",
]
