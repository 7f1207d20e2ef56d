"""Statements a class would believe: the Concentration page's comparison with the handbook's band."""

import numpy as np

from kvviz.analysis.frames import concentration
from kvviz.analysis.readout import concentration_verdict
from kvviz.sources.handbook import handbook_trace


def curve(top10: float, top20: float) -> tuple[np.ndarray, np.ndarray]:
    fractions = np.array([0.0, 0.1, 0.2, 1.0])
    return fractions, np.array([[[0.0, top10, top20, 1.0]]])


def test_the_verdict_places_the_curve_against_the_band():
    assert concentration_verdict(*curve(0.50, 0.70)).startswith("Less concentrated")
    assert concentration_verdict(*curve(0.70, 0.85)).startswith("Within")
    assert concentration_verdict(*curve(0.85, 0.95)).startswith("Within")  # crosses the band's top
    assert concentration_verdict(*curve(0.93, 0.97)).startswith("More concentrated")
    assert "top 10% of tokens hold 50.0%" in concentration_verdict(*curve(0.50, 0.70))


def test_the_handbook_example_misses_its_own_band_and_the_verdict_says_so():
    fractions = np.linspace(0, 1, 101)
    conc = concentration(handbook_trace(), fractions=fractions)
    text = concentration_verdict(fractions, conc.curves)
    assert text.startswith("Less concentrated than the handbook's band")
    top10 = float(conc.curves[0, 0, 10])
    assert f"hold {100 * top10:.1f}%" in text and 0.40 < top10 < 0.50
