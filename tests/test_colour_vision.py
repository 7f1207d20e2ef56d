"""Colour is never the only cue, and the colours themselves survive colour-vision deficiency.

Each method's colour on the Trade-offs, Decode timeline and Studies charts is simulated under
deuteranopia, protanopia and tritanopia with the matrices of Machado, Oliveira & Fernandes (2009) at
full severity (applied in linear RGB, as the paper does), and every pair must stay at least
MIN_DELTA_E apart in CIE76 ΔE (CIELAB, D65). Why 15: a ΔE76 of about 2.3 is the just-noticeable
difference of two patches side by side; lines and markers on a chart are thin, apart and read at a
glance, and colours less than ~10 apart are commonly named the same (the tova/no-eviction pair that
this test caught was 1.4 apart under deuteranopia), so 15 asks for colours a viewer tells apart
without comparing them side by side. The figures' own traces are read, not the style table alone, and
each method must also have its own marker shape and line dash; on the attention chart the token's fate
(sink, recent, heavy hitter, evicted) has a pattern each as well as a colour.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvviz.plots import style

MIN_DELTA_E = 15.0

# Machado, Oliveira & Fernandes (2009), severity 1.0, on linear RGB
MACHADO = {
    "deuteranopia": np.array(
        [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]]
    ),
    "protanopia": np.array(
        [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]]
    ),
    "tritanopia": np.array(
        [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]]
    ),
}
VISIONS = ("normal", *MACHADO)


def linear_rgb(colour: str) -> np.ndarray:
    c = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def lab(linear: np.ndarray) -> np.ndarray:
    """CIELAB (D65 white) of a linear sRGB colour."""
    xyz = np.array(
        [[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750], [0.0193339, 0.1191920, 0.9503041]]
    ) @ np.clip(linear, 0.0, 1.0)
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def seen(colour: str, vision: str) -> np.ndarray:
    rgb = linear_rgb(colour)
    return lab(rgb if vision == "normal" else MACHADO[vision] @ rgb)


def delta_e(a: str, b: str, vision: str) -> float:
    return float(np.linalg.norm(seen(a, vision) - seen(b, vision)))


def test_the_simulation_is_the_published_one():
    """Known points: white and black stay; pure red and green, far apart for normal vision, become
    close under deuteranopia and protanopia but stay apart under tritanopia."""
    for vision in MACHADO:
        assert delta_e("#FFFFFF", "#FFFFFF", vision) == 0
        assert np.allclose(MACHADO[vision].sum(axis=1), 1.0, atol=1e-3)  # grey stays grey
    assert delta_e("#FF0000", "#00FF00", "normal") > 150
    assert delta_e("#D55E00", "#009E73", "normal") > 60
    assert delta_e("#FF0000", "#00C000", "deuteranopia") < 0.4 * delta_e("#FF0000", "#00C000", "normal")
    assert delta_e("#FF0000", "#00C000", "tritanopia") > 0.7 * delta_e("#FF0000", "#00C000", "normal")


def figure_method_styles():
    """Each method's (colour, marker symbol, line dash) as the Trade-offs and Decode timeline figures draw it."""
    from kvviz.plots.tradeoffs import tradeoff_figure

    methods = list(style.METHOD_COLORS)
    rows = [dict(method=m, budget=b, bits=16, memory_ratio=b / 64, tv=1 - b / 64) for m in methods for b in (8, 16)]
    fig = tradeoff_figure(rows)
    drawn = {}
    for trace in fig.data:
        if trace.legendgroup in methods:
            drawn[trace.legendgroup] = (trace.line.color, trace.marker.symbol, trace.line.dash)
    assert set(drawn) == set(methods), "every method is drawn"
    return drawn


@pytest.mark.parametrize("vision", VISIONS)
def test_every_two_methods_stay_apart_in_colour(vision):
    drawn = figure_method_styles()
    close = [
        (a, b, round(delta_e(drawn[a][0], drawn[b][0], vision), 1))
        for a, b in itertools.combinations(drawn, 2)
        if delta_e(drawn[a][0], drawn[b][0], vision) < MIN_DELTA_E
    ]
    assert not close, f"under {vision} these method colours are closer than ΔE {MIN_DELTA_E}: {close}"


def test_every_method_has_its_own_marker_and_dash():
    drawn = figure_method_styles()
    symbols = [s for _, s, _ in drawn.values()]
    dashes = [d for _, _, d in drawn.values()]
    assert len(set(symbols)) == len(symbols), symbols
    assert len(set(dashes)) == len(dashes), dashes


def test_every_bit_width_and_serving_format_has_its_own_mark():
    """On the Trade-offs chart a point's mark (filled / open / dotted, and its size) says its bit width or
    its serving format: no two share one, and every format is drawn larger than any integer width (q4_0
    looked like KIVI's 4 bits when they were the same size)."""
    from kvviz.plots.style import BITS_MARKS, point_marker
    from kvviz.quant.formats import SERVING_FORMATS

    marks = [(b, "int") for b in BITS_MARKS] + [(16, f) for f in SERVING_FORMATS]
    drawn = {(b, f): (point_marker("h2o", b, f)["symbol"], point_marker("h2o", b, f)["size"]) for b, f in marks}
    assert len(set(drawn.values())) == len(drawn), drawn
    assert min(size for (_, f), (_, size) in drawn.items() if f != "int") > max(size for _, size in BITS_MARKS.values())


def test_the_decode_timeline_draws_each_policy_with_its_marker_and_dash():
    from types import SimpleNamespace

    from kvviz.plots.decode import regret_chart

    policies = {m: SimpleNamespace(regret=np.linspace(0, 0.1, 5)) for m in ("h2o", "tova", "streaming", "oracle")}
    fig = regret_chart(SimpleNamespace(policies=policies, n_steps=5, layer=0, model_layer=0, kv_head=0))
    styles = {t.name: (t.line.color, t.marker.symbol, t.line.dash) for t in fig.data}
    assert len({s[1] for s in styles.values()}) == 4 and len({s[2] for s in styles.values()}) == 4, styles


@pytest.mark.parametrize("vision", VISIONS)
def test_the_attention_chart_tells_tokens_apart_by_pattern_where_colour_fails(vision):
    """Sink, recent, heavy hitter and evicted have a pattern each; where two of the attention chart's
    colours (the original's grey among them) come closer than MIN_DELTA_E under a simulated deficiency,
    their patterns must differ."""
    import pandas as pd

    from kvviz.plots.figures import attention_figure

    reasons = ["sink", "sink", "evicted", "heavy hitter", "evicted", "recent", "recent"]
    frame = pd.DataFrame(
        {
            "position": range(7),
            "token": [f"t{i}" for i in range(7)],
            "reason": reasons,
            "original": np.full(7, 1 / 7),
            "compressed": [0.2, 0.2, 0, 0.2, 0, 0.2, 0.2],
            "kept": [r != "evicted" for r in reasons],
        }
    )
    fig = attention_figure(frame)
    looks = {}
    for t in fig.data:
        colour = (
            t.marker.color
            if isinstance(t.marker.color, str) and t.marker.color.startswith("#")
            else t.marker.pattern.fgcolor
        )
        looks[t.name] = (colour, t.marker.pattern.shape or "")
    assert {looks[n][1] for n in looks if n.startswith("compressed: ")} >= {".", "-", "x"}
    for a, b in itertools.combinations(looks, 2):
        if delta_e(looks[a][0], looks[b][0], vision) < MIN_DELTA_E:
            assert looks[a][1] != looks[b][1], f"under {vision}, {a} and {b} share colour and pattern"
