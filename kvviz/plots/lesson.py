"""The lesson page: one self-contained HTML file with live sliders over a precomputed grid.

`lesson_html(lesson, ...)` writes a `kvviz.analysis.lesson.Lesson` into the page template
(lesson_page.html, with the script lesson_page.js inlined): the small settings as JSON, the grid's
typed arrays and every text the page shows at each point (the app's card texts and warnings,
kvviz.analysis.readout) gzip-compressed and base64-encoded, which the browser unpacks with its own
DecompressionStream. The page loads nothing (a Content-Security-Policy with no source but its own
script's hash), runs no code but that script, and sets every text with textContent.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
import math
import re
from pathlib import Path

import numpy as np

from kvviz.analysis.lesson import SLIDERS, Lesson
from kvviz.analysis.readout import budget_warnings, card_values, quant_warnings
from kvviz.metrics import BANDS
from kvviz.spec import FULL_BITS
from kvviz.version import __version__

HERE = Path(__file__).resolve().parent
SLIDER_LABELS = {
    "sink": "Sink tokens",
    "recent": "Recent window",
    "heavy": "Heavy-hitter budget",
    "bits": "Quantization bits",
}
# the texts of each point, in the order the page reads them (lesson_page.js: p.text.<field>)
FIELDS = ("label", "mass", "tv", "tvq", "kl", "out", "cos", "kv", "ratio", "smaller", "kept", "warnings")


def slider_display(name: str, value: int) -> str:
    return "16 (off)" if name == "bits" and value == FULL_BITS else str(value)


def point_texts(lesson: Lesson, i: int) -> dict[str, str]:
    """What the page writes at point i: the Explorer's card texts, the setting's label and its warnings."""
    m, spec = lesson.metrics[i], lesson.specs[i]
    cards = card_values(m)
    ratio, cosine = m["compression_ratio"], m.get("output_cosine")
    warnings = budget_warnings(spec, lesson.n_tokens) + quant_warnings(spec, m["kept_tokens"])
    return {
        "label": spec.label() or "no compression",
        "mass": cards["Attention mass retained"],
        "tv": cards["TV distance"],
        "tvq": cards["TV from quantization"],
        "kl": cards["KL divergence"],
        "out": cards["Output error"],
        "cos": "" if cosine is None else f"cos {cosine:.2f}",
        "kv": cards["KV memory"],
        "ratio": cards["Memory vs 16-bit"],
        "smaller": f"({ratio:.1f}× smaller)" if math.isfinite(ratio) else "",
        "kept": cards["Tokens kept"],
        "warnings": "\n".join(warnings),
    }


def pack(arrays: dict[str, np.ndarray | list]) -> tuple[dict, str]:
    """(manifest, base64 text) of the arrays laid end to end, each 8-byte aligned, gzip-compressed.

    A list is stored as UTF-8 JSON (dtype "json"). gzip's time stamp is zero, so one lesson is always
    the same bytes.
    """
    manifest, chunks, offset = {}, [], 0
    for name, a in arrays.items():
        if isinstance(a, list):
            raw, dtype, shape = json.dumps(a, ensure_ascii=False).encode("utf-8"), "json", [0]
            shape = [len(raw)]
        else:
            a = np.ascontiguousarray(a)
            raw, dtype, shape = a.tobytes(), a.dtype.name, list(a.shape)
        manifest[name] = {"dtype": dtype, "shape": shape, "offset": offset}
        pad = -len(raw) % 8
        chunks.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    blob = gzip.compress(b"".join(chunks), compresslevel=9, mtime=0)
    return manifest, base64.b64encode(blob).decode("ascii")


def unpack(manifest: dict, text: str) -> dict:
    """The arrays `pack` stored (what the page's script reads), for tests and checks."""
    buffer = gzip.decompress(base64.b64decode(text))
    out = {}
    for name, a in manifest.items():
        count = int(np.prod(a["shape"]))
        if a["dtype"] == "json":
            out[name] = json.loads(buffer[a["offset"] : a["offset"] + count].decode("utf-8"))
        else:
            dtype = np.dtype(a["dtype"])
            out[name] = np.frombuffer(buffer, dtype, count, a["offset"]).reshape(a["shape"])
    return out


def _opening(lesson: Lesson, texts: list[dict]) -> dict:
    """The point the page opens at, as JSON (NaN as null): drawn before the grid is unpacked."""
    i = lesson.index(**lesson.start)
    frame = lesson.frame(i)
    marks = frame.pop("kept_tokens" if lesson.binned else "reason")
    return {
        "columns": {k: [None if math.isnan(x) else x for x in v.tolist()] for k, v in frame.items()},
        "marks": marks.tolist(),
        "text": texts[i],
    }


def _json_for_script(obj) -> str:
    """JSON that cannot end its <script> block or open a comment in it (<, >, & escaped)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def lesson_html(
    lesson: Lesson,
    *,
    title: str,
    source: str,
    quant_note: str,
    fixed: str,
    link_base: str,
    link_query: dict[str, str],
    link_defaults: dict[str, int],
    link_note: str = "",
    lecturer: str = "",
) -> str:
    """The lesson as one HTML page (see the module's docstring).

    `source` names the attention source, `quant_note` the quantization model, `fixed` the settings the
    sliders do not change; the page's link back to the app is `link_base` with `link_query` (the view's
    other settings) and the sliders' values where they differ from `link_defaults`.
    """
    texts = [point_texts(lesson, i) for i in range(lesson.points)]
    strings: dict[str, int] = {}
    text_of = np.array([[strings.setdefault(t[f], len(strings)) for f in FIELDS] for t in texts], dtype=np.uint32)
    manifest, data = pack(
        {
            "rows": lesson.rows,
            "row_of": lesson.row_of,
            "marks": lesson.marks,
            "mark_of": lesson.mark_of,
            "text_of": text_of,
            "strings": list(strings),
        }
    )
    meta = {
        "title": title,
        "lecturer": lecturer,
        "source": source,
        "version": __version__,
        "row": lesson.row,
        "ensemble": lesson.ensemble,
        "members": lesson.members,
        "bars_text": BANDS[lesson.bars],
        "notes": list(lesson.notes),
        "sliders": _sliders(lesson),
        "grid_note": (
            f"Every slider moves over the values listed under it: {lesson.points:,} precomputed settings. "
            "Values between them are not in this lesson; the live app has them all."
        ),
        "binned": lesson.binned,
        "columns": list(lesson.columns),
        "n": len(lesson.x),
        "n_tokens": lesson.n_tokens,
        "bin_width": int((lesson.x_end - lesson.x + 1).max()),
        "x": lesson.x.tolist(),
        "x_end": lesson.x_end.tolist(),
        "labels": list(lesson.labels),
        "text_tokens": lesson.text_tokens,
        "original": lesson.original.tolist(),
        "reasons": {str(k): v for k, v in lesson.reasons.items()},
        "fields": list(FIELDS),
        "blob": manifest,
        "first": _opening(lesson, texts),
        "fixed": fixed,
        "quant": quant_note,
        "link": {"base": link_base, "query": link_query, "defaults": link_defaults, "note": link_note},
    }
    return _page(title, meta, data)


def _sliders(lesson: Lesson) -> list[dict]:
    """Each slider's name, label, values (and how they read) and where it starts."""
    return [
        {
            "name": s,
            "label": SLIDER_LABELS[s],
            "values": list(lesson.grid[s]),
            "display": [slider_display(s, v) for v in lesson.grid[s]],
            "start": lesson.grid[s].index(lesson.start[s]),
        }
        for s in SLIDERS
    ]


def _page(title: str, meta: dict, data: str) -> str:
    """The page template with the title, the lesson's meta and data and the script (its hash in the page's
    Content-Security-Policy) put in."""
    script = (HERE / "lesson_page.js").read_text(encoding="utf-8")
    assert "</script" not in script.lower(), "the page's script must not close its own block"
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    parts = {
        "TITLE": html.escape(title),
        "VERSION": html.escape(__version__),
        "SCRIPT_HASH": f"sha256-{digest}",
        "META": _json_for_script(meta),
        "DATA": data,
        "SCRIPT": script,
    }
    page = (HERE / "lesson_page.html").read_text(encoding="utf-8")
    # one pass: a placeholder's text inside an inserted value is never replaced again
    return re.sub(r"@@([A-Z_]+)@@", lambda m: parts[m.group(1)], page)


# --- from a link's settings to the page ----------------------------------------------------------

# the page sets these
SLIDER_PARAMS = ("sink", "recent", "heavy", "bits", "split", "key_bits", "value_bits")
DEFAULT_APP_URL = "http://localhost:8501/"


def fixed_settings(spec, view) -> str:
    """The settings the sliders do not move, in one line."""
    from kvviz.spec import Spec

    quant = (
        f"keys per {spec.key_axis}, values per {spec.value_axis}, groups of {spec.group_size}, "
        f"last {spec.residual} tokens at 16 bits, "
        + (
            "symmetric"
            if spec.symmetric
            else "asymmetric with a " + ("float offset (KIVI)" if spec.zero_point == "float" else "integer zero point")
        )
        + f", partial groups {'at 16 bits' if spec.partial == 'full' else 'quantized'}"
    )
    skip = {
        "sink",
        "recent",
        "heavy",
        "key_bits",
        "value_bits",
        "scorer",
        "key_axis",
        "value_axis",
        "group_size",
        "residual",
        "symmetric",
        "zero_point",
        "partial",
        "seed",
        "positions",
    }
    default = Spec()
    others = [f"{k} {v}" for k, v in spec.__dict__.items() if k not in skip and v != getattr(default, k)]
    step = "the last query" if view.step is None else f"query step {view.step}"
    return (
        f"Fixed in this lesson: scorer {spec.scorer}; {quant}"
        + (f"; {', '.join(others)}" if others else "")
        + f". View: layer {view.layer}, query head {view.head}, {step}."
    )


def default_title(source_label: str) -> str:
    """'kvviz lesson: handbook example' (a model's name without its token counts)."""
    return f"kvviz lesson: {source_label.split(': ')[0]}"


def export_lesson(
    source,
    spec,
    view,
    values: dict,
    grid_given: dict | None = None,
    *,
    bars: str = "std",
    title: str = "",
    lecturer: str = "",
    app_url: str = DEFAULT_APP_URL,
    progress=None,
) -> tuple[str, Lesson]:
    """(page, lesson) for a kvviz.links.LinkedSource at the link `values` describe (spec, view from them):
    `build_lesson`, then `lesson_page`."""
    lesson = build_lesson(source, spec, view, grid_given, bars=bars, progress=progress)
    return lesson_page(lesson, source, view, values, title=title, lecturer=lecturer, app_url=app_url), lesson


def build_lesson(source, spec, view, grid_given: dict | None = None, *, bars: str = "std", progress=None) -> Lesson:
    """The lesson's numbers: kvviz.analysis.lesson.lesson_grid's default grid for the tokens the query sees
    (any slider's values in `grid_given` instead), compare at every point."""
    from kvviz.analysis.lesson import compute_lesson, lesson_grid
    from kvviz.engine import check_view

    trace = source.trace
    n_tokens = int(trace.query_positions[check_view(trace, view)]) + 1
    grid, start = lesson_grid(n_tokens, spec, grid_given, limit=trace.n_positions)
    return compute_lesson(
        trace, spec, view, grid, start, bars=bars, trace_for_seed=source.trace_for_seed, progress=progress
    )


def lesson_page(
    lesson: Lesson, source, view, values: dict, *, title: str = "", lecturer: str = "", app_url: str = DEFAULT_APP_URL
) -> str:
    """The page of a built lesson, with its words (title, the lecturer's text) and its link back to the app."""
    from urllib.parse import parse_qsl

    from kvviz.links import PARAMS, encode_query

    base = lesson.specs[lesson.index(**lesson.start)]
    query = dict(parse_qsl(encode_query({k: v for k, v in values.items() if k not in SLIDER_PARAMS})))
    note = (
        ""
        if source.name in ("handbook", "synthetic")
        else "(the app opens this view once the same trace is loaded under Source)"
    )
    return lesson_html(
        lesson,
        title=title or default_title(source.label),
        source=source.label,
        quant_note=f"Quantization model: {source.quant_note}.",
        fixed=fixed_settings(base, view),
        link_base=app_url,
        link_query=query,
        link_note=note,
        lecturer=lecturer,
        link_defaults={s: PARAMS[s].default for s in SLIDERS},
    )


def page_data(page: str) -> tuple[dict, dict]:
    """(settings, arrays) a lesson page holds, read back as its script reads them (for checks and tests)."""

    def block(name: str) -> str:
        found = re.search(rf'<script type="[^"]+" id="{name}">(.*?)</script>', page, re.S)
        if found is None:
            raise ValueError(f"not a kvviz lesson page: no {name} block")
        return found.group(1)

    meta = json.loads(block("lesson-meta"))
    return meta, unpack(meta["blob"], block("lesson-data").strip())
