"""The settings a Spec is made of, each declared once by the file that owns it.

A scorer's settings live in the scorer's file (SnapKV's observation window in
`kvviz/policies/snapkv.py`), a quantization format's in the format's file, the budgets in
`kvviz/spec.py`. Each is a `Setting`: its Spec keyword, type, range, default, label, help and
the names a link and the command line give it. Everything that offers settings to a person is
made from this one table: the `Spec(...)` keywords, the link parameters (`kvviz.links`), the
command-line flags (`kvviz.cli.args`), the app's widgets (`kvviz.app.compression`) and the
study grid's axes (`kvviz.analysis.study.schema`). Adding a setting is one `declare(...)`.

Rules between settings (SnapKV's window must fit inside the recent window) are functions of
the whole Spec, registered with `rule`; `kvviz.spec.check_spec` runs them after the
per-setting checks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("int", "float", "bool", "choice")


@dataclass(frozen=True)
class Setting:
    """One setting: what it is called where, what values it takes, and how a person sets it."""

    name: str  # the Spec keyword and attribute (page_size)
    kind: str  # int | float | bool | choice
    default: Any
    lo: float | None = None  # int / float: the valid range, both ends included
    hi: float | None = None
    # choice: the values (a function when they are known later)
    choices: tuple | Callable[[], tuple] = ()
    label: str = ""  # the widget's label and the CLI's short description
    help: str = ""  # the widget's tooltip and the CLI's help
    url: str = ""  # the link's name (today's names; default: `name`)
    # the command line's flag (default: --name-with-dashes); "-" = none
    cli: str = ""
    # (setting, a value, a tuple of values or a test): shown only when e.g. ("scorer", "snapkv") holds
    owner: tuple = ()
    quantizes: bool = False  # says only how kept K/V are stored, never what is kept
    # default None: the value a link / flag / widget writes for None (0 = auto)
    none_as: Any = None
    # widget and link presets, where not every value in range is offered
    options: tuple = ()
    option_labels: dict = field(default_factory=dict)  # choice value -> what the widget says
    step: float | None = None  # the widget's step
    fmt: str | None = None  # the widget's number format
    # one more rule on the value: None, or what is wrong
    valid: Callable[[Any], str | None] | None = None

    @property
    def url_name(self) -> str:
        return self.url or self.name

    @property
    def flag(self) -> str | None:
        if self.cli == "-":
            return None
        return self.cli or "--" + self.name.replace("_", "-")

    @property
    def values(self) -> tuple:
        """A choice's values (evaluated now: a scorer list grows when plug-ins load)."""
        return tuple(self.choices()) if callable(self.choices) else tuple(self.choices)

    def coerce(self, value: Any) -> Any:
        """numpy and Python numbers alike: an integral value of an int setting becomes an int, a real value
        of a float setting a float (so Spec(heavy=np.int64(8)) == Spec(heavy=8)); anything else is kept
        for `problem` to name."""
        if isinstance(value, bool) or value is None:
            return value
        if self.kind == "int" and isinstance(value, numbers.Integral):
            return int(value)
        if self.kind == "float" and isinstance(value, numbers.Real):
            return float(value)
        return value

    def problem(self, value: Any) -> str | None:
        """None if `value` is valid, else what is wrong, in words a person can act on."""
        what = self.label or self.name
        if value is None and self.default is None:
            return None
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"{self.name} must be true or false, got {value!r}"
        if self.kind == "choice":
            allowed = self.values
            if value not in allowed:
                return f"{self.name} must be one of {', '.join(map(str, allowed))}, got {value!r}"
        else:
            number = (int,) if self.kind == "int" else (int, float)
            if (
                isinstance(value, bool)
                or not isinstance(value, number)
                or (isinstance(value, float) and not math.isfinite(value))
            ):
                return f"{what} must be {'an integer' if self.kind == 'int' else 'a finite number'}, got {value!r}"
            if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
                return f"{what} must be {_num(self.lo)}-{_num(self.hi)}, got {_num(value)}"
        return self.valid(value) if self.valid else None


def _num(x) -> str:
    if x is None:
        return "any"
    return f"{x:,g}" if isinstance(x, float) else f"{x:,}"


SETTINGS: dict[str, Setting] = {}  # Spec keyword -> Setting, in declaration order
RULES: list[Callable[[Any], None]] = []  # rules over a whole Spec (raise kvviz.spec.SpecError)
# scorer name -> how Spec.label names it; "+setting" -> what a setting adds to the eviction's label ("" when off)
LABELS: dict[str, Callable[[Any], str]] = {}


def declare(*settings: Setting) -> tuple[Setting, ...]:
    """Add settings to the table; a name or link name already taken is a programming error."""
    for s in settings:
        if s.kind not in KINDS:
            raise ValueError(f"setting {s.name!r}: kind must be one of {', '.join(KINDS)}, got {s.kind!r}")
        taken = {t.url_name: t.name for t in SETTINGS.values() if t.name != s.name}
        if s.url_name in taken:
            raise ValueError(f"setting {s.name!r}: link name {s.url_name!r} is {taken[s.url_name]!r}'s")
        if s.name in SETTINGS and SETTINGS[s.name] != s:
            raise ValueError(f"setting {s.name!r} is declared twice, differently")
        SETTINGS[s.name] = s
    return settings


def rule(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Register a rule over a whole Spec (a decorator): it raises SpecError when the Spec is impossible."""
    if check not in RULES:
        RULES.append(check)
    return check


def shown(setting: Setting, values: dict) -> bool:
    """Whether a setting applies under these other settings (its owner's condition), e.g. SnapKV's window
    only when the scorer is SnapKV. `values` maps setting names (Spec keywords) to values. The wanted value
    may be one value, a tuple of them, or a test of the value (any one-shot scorer)."""
    if not setting.owner:
        return True
    name, wanted = setting.owner
    if callable(wanted):
        return bool(wanted(values.get(name)))
    return values.get(name) == wanted or (isinstance(wanted, tuple) and values.get(name) in wanted)
