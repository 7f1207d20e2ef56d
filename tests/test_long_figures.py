"""Long contexts on screen: the Explorer's figure builders on a 32,768-token row send a
few hundred points to the browser, whatever range of the row they show, and a zoom reaches single tokens.

Points are counted as the browser gets them: per trace, its x / y values (a heatmap its z cells), summed
over the figure's traces."""

import numpy as np
import pytest

from kvviz.analysis.frames import BIN_THRESHOLD, MAX_BINS, token_frame, token_range, zoom_frame
from kvviz.engine import compare
from kvviz.plots import figures, grids
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.spec import Spec, View

N = 32_768
FEW_THOUSAND = 2_000  # points a chart may carry


def points(fig) -> int:
    total = 0
    for trace in fig.data:
        if getattr(trace, "z", None) is not None:
            total += np.asarray(trace.z).size
        else:
            total += max(len(v) for v in (trace.x, trace.y) if v is not None)
    return total


@pytest.fixture(scope="module")
def long_row():
    """A 32k-token row: eviction (sinks, a recent window, K-norm's scattered heavy hitters) and 4-bit
    quantization, error bars over 2 query heads."""
    t = make_synthetic(SyntheticSpec(context=N, steps=0, layers=1, q_heads=2, kv_heads=1, head_dim=64))
    spec = Spec(sink=4, recent=512, heavy=512, scorer="knorm", key_bits=4, value_bits=4)
    comp = compare(t, spec, View(layer=0, head=0, ensemble="heads", ensemble_size=2))
    assert len(comp.tokens) == N and 0 < comp.primary.kept.sum() < N
    return comp


def all_figures(frame, binned: bool, members: int, pinned=None):
    att = (
        figures.binned_attention_figure(frame)
        if binned
        else figures.attention_figure(frame, text_tokens=True, pinned=pinned)
    )
    return att, figures.error_figure(frame, "std", members, text_tokens=not binned, pinned=pinned)


@pytest.mark.parametrize("first, last", [(0, -1), (1000, 9999), (30_000, 30_000 + BIN_THRESHOLD - 1), (12_345, 12_345)])
def test_every_chart_of_a_32k_row_carries_a_few_hundred_points(long_row, first, last):
    frame, binned = zoom_frame(long_row, first, last)
    assert binned == ((last if last >= 0 else N - 1) - first + 1 > BIN_THRESHOLD)
    assert len(frame) <= max(MAX_BINS, BIN_THRESHOLD)
    for fig in all_figures(frame, binned, len(long_row.members), pinned=frame):
        assert points(fig) <= FEW_THOUSAND, (first, last, points(fig))
        assert len(fig.to_json()) < 400_000


def test_the_whole_row_is_binned_with_the_mass_and_the_largest_token_of_each_bin(long_row):
    p = long_row.primary
    frame, binned = zoom_frame(long_row)
    assert binned and len(frame) == MAX_BINS and (frame["tokens"] == N // MAX_BINS).all()
    assert frame["start"].iloc[0] == 0 and frame["end"].iloc[-1] == N - 1
    assert frame["kept_tokens"].sum() == p.kept.sum()  # integers: exact
    np.testing.assert_allclose(frame["original"].sum(), 1.0, rtol=1e-9)  # the row's mass, in bins
    w = N // MAX_BINS
    assert np.array_equal(frame["original_max"], p.original.reshape(MAX_BINS, w).max(axis=1))
    by_bin = p.error.reshape(MAX_BINS, w)
    assert np.array_equal(frame["error_extreme"], by_bin[np.arange(MAX_BINS), np.abs(by_bin).argmax(axis=1)])
    att, err = all_figures(frame, True, len(long_row.members))
    assert att.layout.yaxis.title.text == "attention mass per bin (sum)"
    assert "original: largest single token in the bin" in [t.name for t in att.data]
    assert "largest single-token error in the bin (one row)" in [t.name for t in err.data]
    assert att.layout.xaxis.title.text == f"token position 0-{N - 1} (bins of {w} tokens)"


def test_a_binned_range_covers_exactly_that_range(long_row):
    p = long_row.primary
    frame, binned = zoom_frame(long_row, 1000, 9999)
    assert binned and frame["start"].iloc[0] == 1000 and frame["end"].iloc[-1] == 9999
    assert frame["tokens"].sum() == 9000 and len(frame) <= MAX_BINS
    assert frame["kept_tokens"].sum() == p.kept[1000:10_000].sum()
    np.testing.assert_allclose(frame["original"].sum(), p.original[1000:10_000].sum(), rtol=1e-9)
    assert frame["original_max"].max() == p.original[1000:10_000].max()
    att = figures.binned_attention_figure(frame)
    assert min(min(t.x) for t in att.data) >= 1000 and max(max(t.x) for t in att.data) <= 9999


def test_a_zoom_reaches_single_tokens(long_row):
    p = long_row.primary
    frame, binned = zoom_frame(long_row, 30_000, 30_000 + BIN_THRESHOLD - 1)
    assert not binned and list(frame["position"]) == list(range(30_000, 30_000 + BIN_THRESHOLD))
    assert np.array_equal(frame["original"], p.original[30_000 : 30_000 + BIN_THRESHOLD])
    one, binned = zoom_frame(long_row, 12_345, 12_345)
    assert not binned and list(one["position"]) == [12_345]
    att = figures.attention_figure(one, text_tokens=True)
    xs = [x for t in att.data for x in t.x]
    assert set(xs) == {12_345} and len(xs) == (2 if p.kept[12_345] else 1)  # original (+ compressed if kept)
    assert one.equals(token_frame(long_row).iloc[[12_345]])


def test_a_range_is_clamped_into_the_row_and_turned_round():
    assert token_range(100) == (0, 99)
    assert token_range(100, 50, 10) == (10, 50)
    assert token_range(100, -5, 500) == (0, 99)
    assert token_range(100, 200, -1) == (99, 99)


def test_the_overview_of_an_8b_model_is_its_layers_times_heads():
    grid = np.random.default_rng(0).random((32, 32))
    fig = grids.heatmap_figure(grid, "tv", "TV", layers=range(32))
    assert points(fig) == 32 * 32
