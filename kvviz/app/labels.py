"""What the app calls things: sources, scorers, allocations, cache formats and bit widths.

Display text only; the values they label are in kvviz.app.params.
"""

from __future__ import annotations

from kvviz.settings import SETTINGS
from kvviz.spec import FULL_BITS

SOURCE_LABELS = {
    "handbook": "Handbook example",
    "synthetic": "Synthetic pattern",
    "real": "Real model",
    "file": "Trace file",
}


class _Labels:
    """Scorer labels, from each scorer's own class (kvviz.policies: `title`, `short`, `menu`); a plug-in that
    sets none is labelled by its name and the start of its description."""

    def __init__(self, attr: str):
        self.attr = attr

    def get(self, key, default=None):
        from kvviz.policies import POLICIES

        p = POLICIES.get(key)
        if p is None:
            return default if default is not None else str(key)
        text = (
            getattr(p, self.attr)
            or (p.title if self.attr != "title" else "")
            or (p.short if self.attr == "menu" else "")
        )
        if text:
            return text
        return f"{key} (plug-in)" if self.attr == "short" else f"{key} (plug-in: {p.description[:60]})"

    def __getitem__(self, key):
        return self.get(key)


SCORER_SHORT = _Labels("short")
SCORER_LABELS = _Labels("menu")
ALLOCATION_LABELS = SETTINGS["allocation"].option_labels
FORMAT_LABELS = SETTINGS["key_format"].option_labels


def bits_label(b: int) -> str:
    return "16 (off)" if b == FULL_BITS else str(b)


def scorer_help() -> str:
    from kvviz.policies import POLICIES
    from kvviz.policies.registry import load_entry_points

    load_entry_points()

    def line(name, p):
        extra = "; ".join(x for x in (p.paper, f"kvpress: {p.kvpress}" if p.kvpress else "") if x)
        return f"- **{SCORER_LABELS.get(name)}**: {p.description}." + (f" ({extra})" if extra else "")

    return "How heavy hitters are ranked:\n\n" + "\n".join(line(name, p) for name, p in POLICIES.items())
