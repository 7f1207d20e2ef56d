"""Figure builders and the app's data tables: what a chart says is what was computed."""

import json

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from kvviz import Spec, View, compare
from kvviz.plots import export, figures, grids, style, tradeoffs
from kvviz.sources.handbook import HEAVY, RECENT, SINK, handbook_trace
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.analysis.sweep import pareto_front
from kvviz.analysis.frames import (
    BIN_THRESHOLD,
    binned_frame,
    bin_edges,
    concentration,
    error_band,
    ranges_text,
    token_frame,
)


@pytest.fixture(scope="module")
def handbook_comp():
    return compare(handbook_trace(), Spec(sink=SINK, recent=RECENT, heavy=HEAVY), View())


@pytest.fixture(scope="module")
def long_comp():
    t = make_synthetic(SyntheticSpec(context=1024, steps=4))
    return compare(t, Spec(sink=4, recent=100, heavy=100, key_bits=4, value_bits=4), View(ensemble="heads"))


def test_ranges_text():
    assert ranges_text([0, 1, 2, 3, 15, 28] + list(range(56, 64))) == "0-3, 15, 28, 56-63"
    assert ranges_text([]) == "none"
    assert ranges_text([5]) == "5"


def test_token_frame_matches_comparison(handbook_comp):
    f = token_frame(handbook_comp)
    p = handbook_comp.primary
    assert len(f) == 64
    np.testing.assert_array_equal(f["original"], p.original)
    np.testing.assert_array_equal(f["compressed"], p.compressed)
    assert set(np.flatnonzero(f["kept"])) == {0, 1, 2, 3, 15, 28, *range(56, 64)}
    assert f.loc[0, "reason"] == "sink" and f.loc[15, "reason"] == "heavy hitter"
    assert f.loc[60, "reason"] == "recent" and f.loc[20, "reason"] == "evicted"


def test_error_band_std_and_interval(long_comp):
    mean, lo, hi = error_band(long_comp, "std")
    np.testing.assert_allclose(hi - mean, long_comp.spread.std)
    mean, lo, hi = error_band(long_comp, "ci95")
    np.testing.assert_array_equal(lo, long_comp.spread.ci_lo)
    mean, lo, hi = error_band(long_comp, "range")
    np.testing.assert_array_equal(hi, long_comp.spread.member_max)
    with pytest.raises(ValueError):
        error_band(long_comp, "iqr")


def test_binned_frame_conserves_mass_and_caps_bins(long_comp):
    n = len(long_comp.tokens)
    assert n > BIN_THRESHOLD
    b = binned_frame(long_comp, max_bins=100)
    assert len(b) <= 100
    assert b["tokens"].sum() == n
    assert b["original"].sum() == pytest.approx(1.0)
    assert b["compressed"].sum() == pytest.approx(1.0)
    assert b["kept_tokens"].sum() == long_comp.primary.kept.sum()
    assert b["evicted_mass"].sum() == pytest.approx(1 - long_comp.metrics["mass_retained"])
    # each bin's mean error is the mean over members of their bin sums
    sums = np.array([np.add.reduceat(m.error, bin_edges(n, 100)) for m in long_comp.members])
    np.testing.assert_allclose(b["error_mean"], sums.mean(axis=0), atol=1e-12)


def test_attention_figure_marks_evicted_and_colours_by_reason(handbook_comp):
    f = token_frame(handbook_comp)
    fig = figures.attention_figure(f)
    assert isinstance(fig, go.Figure)
    names = [t.name for t in fig.data]
    assert "original" in names and "evicted: original (now 0)" in names
    assert {"compressed: sink", "compressed: recent", "compressed: heavy hitter"} <= set(names)
    heavy = next(t for t in fig.data if t.name == "compressed: heavy hitter")
    assert list(heavy.x) == [15, 28]
    assert heavy.marker.color == style.REASON_COLORS["heavy hitter"]
    evicted = next(t for t in fig.data if t.name.startswith("evicted: original"))
    assert len(evicted.x) == 64 - 14 and evicted.marker.pattern.shape == "/"  # hatched: not colour alone
    assert "attention weight" in fig.layout.yaxis.title.text and "token" in fig.layout.xaxis.title.text
    # token text is in the hover data
    assert any("t15" in str(row[0]) for row in heavy.customdata)


def test_error_figure_bars(handbook_comp, long_comp):
    f = token_frame(long_comp)
    fig = figures.error_figure(f.iloc[:200], "std", len(long_comp.members), what="query heads 0-3")
    total = next(t for t in fig.data if t.name.startswith("total"))
    mean, lo, hi = error_band(long_comp, "std")  # the bars are the frame's own band
    np.testing.assert_allclose(total.y, mean[:200], atol=1e-15)
    np.testing.assert_allclose(total.error_y.array, np.clip(hi - mean, 0, None)[:200], atol=1e-15)
    np.testing.assert_allclose(total.error_y.arrayminus, np.clip(mean - lo, 0, None)[:200], atol=1e-15)
    assert total.error_y.visible and np.max(total.error_y.array) > 0
    assert "N = 4 rows (query heads 0-3)" in fig.layout.title.text and "sample std" in fig.layout.title.text
    b = figures.error_figure(binned_frame(long_comp), "ci95", 4)
    assert "bins of" in b.layout.xaxis.title.text and "95% t-interval for the mean" in b.layout.title.text
    one = figures.error_figure(token_frame(handbook_comp), "std", 1, what="layer 0, query head 0")
    assert "one row (layer 0, query head 0)" in one.layout.title.text and "no error bars" in one.layout.title.text
    assert len(b.data[0].x) <= 128


def test_binned_attention_figure_sends_few_bars(long_comp):
    b = binned_frame(long_comp)
    fig = figures.binned_attention_figure(b)
    assert all(len(t.x) <= 128 for t in fig.data)
    bars = {t.name: t for t in fig.data}  # each bar is its bin's mass
    drawn = lambda name, attr="y": np.asarray(getattr(bars[name], attr), dtype=float)  # noqa: E731
    np.testing.assert_allclose(drawn("original: kept tokens"), b["original"] - b["evicted_mass"], atol=1e-15)
    np.testing.assert_allclose(drawn("original: evicted tokens"), b["evicted_mass"], atol=1e-15)
    np.testing.assert_allclose(drawn("original: evicted tokens", "base"), b["original"] - b["evicted_mass"], atol=1e-15)
    np.testing.assert_allclose(drawn("compressed"), b["compressed"], atol=1e-15)
    np.testing.assert_allclose(drawn("compressed", "x"), b["start"] + (b["tokens"] - 1) / 2)


def test_tradeoff_figure_lines_front_and_star():
    rows = [
        {"method": "h2o", "budget": 10, "bits": 16, "memory_ratio": 0.1, "tv": 0.5},
        {"method": "h2o", "budget": 20, "bits": 16, "memory_ratio": 0.2, "tv": 0.3},
        {"method": "streaming", "budget": 10, "bits": 16, "memory_ratio": 0.1, "tv": 0.6},
        {"method": "full", "budget": 64, "bits": 4, "memory_ratio": 0.3, "tv": 0.01},
    ]
    front = pareto_front([(r["memory_ratio"], r["tv"]) for r in rows])
    fig = tradeoffs.tradeoff_figure(rows, "tv", front, {"memory_ratio": 0.2, "tv": 0.3, "label": "now"})
    names = [t.name for t in fig.data]
    assert "H2O" in names and "StreamingLLM" in names and "Pareto frontier (real policies)" in names
    assert {t.marker.symbol for t in fig.data if t.name == "H2O"} == {"circle"}  # H2O's shape, 16-bit: filled
    assert {t.marker.symbol for t in fig.data if t.name == "StreamingLLM"} == {"triangle-up"}
    assert next(t for t in fig.data if t.name == "no eviction").marker.symbol == "hexagon-open"  # 4-bit: open
    assert {t.line.dash for t in fig.data if t.name in ("H2O", "StreamingLLM")} == {"solid", "longdash"}
    frontier = next(t for t in fig.data if t.name == "Pareto frontier (real policies)")
    assert list(frontier.x) == [0.1, 0.2, 0.3]
    star = next(t for t in fig.data if t.name.startswith("current"))
    assert star.marker.symbol == "star" and list(star.y) == [0.3]
    assert "memory ratio" in fig.layout.xaxis.title.text


def test_concentration_stats_and_figure():
    t = make_synthetic(SyntheticSpec(context=256, steps=2, layers=2, q_heads=2, kv_heads=1))
    c = concentration(t, sink=1, window=16)
    assert c.curves.shape[:2] == (2, 2)
    assert np.all(np.diff(c.curves, axis=-1) >= -1e-12) and np.allclose(c.curves[..., -1], 1.0)
    assert np.all((c.sink_share >= 0) & (c.sink_share <= 1)) and np.all(c.entropy <= c.max_entropy + 1e-9)
    fig = tradeoffs.concentration_figure(c.fractions, c.curves)
    assert fig.layout.shapes[0].x0 == 10 and fig.layout.shapes[0].y1 == 90
    h = grids.heatmap_figure(c.entropy, "Entropy", "nats")
    assert h.data[0].z.shape == (2, 2) and "layer" in h.layout.yaxis.title.text


def test_handbook_attention_is_concentrated_single_row():
    c = concentration(handbook_trace(), sink=4, window=8)
    assert c.sink_share.shape == (1, 1) and 0.1 < c.sink_share[0, 0] < 0.5


def test_figures_html_is_standalone(handbook_comp):
    html = export.figures_html([figures.attention_figure(token_frame(handbook_comp))], "t")
    assert html.startswith("<!DOCTYPE html>")
    assert 'src="https://cdn.plot.ly' not in html and len(html) > 1_000_000  # plotly.js inlined: works offline


def test_token_grid_marks_every_token():
    from kvviz.plots.grids import token_grid_html

    html = token_grid_html(
        ["The", "▁cat", "<b>", "▁sat"], ["sink", "evicted", "heavy hitter", "recent"], [0.5, 0.1, 0.3, 0.1], newest=3
    )
    assert html.count("line-through") == 1  # only the evicted token is struck through
    assert "&lt;b&gt;" in html and "<b>" not in html  # token text is escaped
    assert "3: ▁sat — newest" in html and "1: ▁cat — evicted" in html


def test_error_parts_add_up_and_each_cause_vanishes_without_it(handbook_comp):
    """Eviction part + quantization part = the error, exactly; each is zero without its cause."""
    from kvviz import Spec, View, compare
    from kvviz.sources.handbook import handbook_trace

    t = handbook_trace()
    both = token_frame(compare(t, Spec(sink=4, recent=8, heavy=2, key_bits=3, value_bits=3), View()))
    np.testing.assert_allclose(both["error_eviction"] + both["error_quantization"], both["error"], atol=1e-15)
    assert np.abs(both["error_quantization"]).max() > 0 and np.abs(both["error_eviction"]).max() > 0
    evict_only = token_frame(handbook_comp)
    assert np.abs(evict_only["error_quantization"]).max() < 1e-15
    quant_only = token_frame(compare(t, Spec(key_bits=3, value_bits=3), View()))
    assert np.all(quant_only["error_eviction"] == 0)
    fig = figures.error_figure(both, "std", 1, y_range=0.1)
    assert {"eviction part", "quantization part"} <= {tr.name for tr in fig.data}
    assert tuple(fig.layout.yaxis.range) == (-0.1, 0.1)
    assert "quantization part" not in {tr.name for tr in figures.error_figure(evict_only).data}


def test_a_locked_axis_widens_to_every_bar_and_says_so():
    """A y-axis lock never hides data: sink 1 alone (the one kept token takes all the attention, 1.0, and
    its error is ~0.9) under the locks a default view gives (0.2 and ±0.1) widens each chart to its tallest
    bar and names both numbers; a lock above the data stays as it is, without a word."""
    from kvviz import Spec, View, compare
    from kvviz.analysis.frames import binned_frame
    from kvviz.sources.handbook import handbook_trace
    from kvviz.sources.synthetic import SyntheticSpec, make_synthetic

    one = token_frame(compare(handbook_trace(), Spec(sink=1), View()))
    top_bar = max(one["original"].max(), one["compressed"].max())
    assert top_bar == pytest.approx(1.0)
    att = figures.attention_figure(one, y_top=0.2)
    assert att.layout.yaxis.range[1] >= top_bar and att.layout.yaxis.range[0] == 0
    assert "y-axis lock 0.2 widened to 1: a bar reaches past it" in att.layout.title.text
    worst = np.abs(one["error"]).max()
    err = figures.error_figure(one, "std", 1, y_range=0.1)
    assert err.layout.yaxis.range[1] >= worst and err.layout.yaxis.range[0] == -err.layout.yaxis.range[1]
    assert f"y-axis lock ±0.1 widened to ±{worst:.3g}" in err.layout.title.text
    long = make_synthetic(SyntheticSpec(context=600, steps=0, layers=1, q_heads=1, kv_heads=1))
    binned = binned_frame(compare(long, Spec(sink=1), View()))
    mass = figures.binned_attention_figure(binned, y_top=0.05)
    assert mass.layout.yaxis.range[1] >= binned["original"].max() > 0.05 and "widened" in mass.layout.title.text
    for fig, locked in (
        (figures.attention_figure(one, y_top=1.5), (0, 1.5)),
        (figures.error_figure(one, y_range=1.0), (-1.0, 1.0)),
    ):
        assert tuple(fig.layout.yaxis.range) == locked and "widened" not in fig.layout.title.text


def test_pinned_setting_and_real_text_on_the_charts(handbook_comp):
    f = token_frame(handbook_comp)
    fig = figures.attention_figure(f, pinned=f, pinned_label="A: h2o 4/8/2", text_tokens=True)
    assert any(t.name == "pinned A: h2o 4/8/2: compressed" for t in fig.data)
    assert list(fig.layout.xaxis.ticktext)[:3] == ["t0", "t2", "t4"]  # 64 tokens: every 2nd labelled
    err = figures.error_figure(f, pinned=f)
    assert any(t.name == "pinned A: total" for t in err.data)


def test_every_figure_starts_from_kvviz_template_plotly_white_cut_to_what_kvviz_draws(handbook_comp):
    white = pio.templates["plotly_white"]
    ours = figures.attention_figure(token_frame(handbook_comp)).layout.template
    assert ours == pio.templates["kvviz"]
    assert set(ours.to_plotly_json()["data"]) == {"bar", "scatter", "heatmap"}
    for kind in ("bar", "scatter", "heatmap"):
        assert ours.data[kind] == white.data[kind]
    for part in ("paper_bgcolor", "plot_bgcolor", "colorway", "xaxis", "yaxis", "hoverlabel"):
        assert ours.layout[part] == white.layout[part], part
    # the page's text colour and a title a size up: the page's look (no longer lent by Streamlit's chart theme)
    assert ours.layout.font.color == style.INK and ours.layout.title.font.size == 16


def test_projector_sets_every_text_of_every_axis_and_keeps_the_data(handbook_comp):
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2)
    fig.add_bar(x=[0, 1], y=[1, 2], name="a", row=1, col=1)
    fig.add_bar(x=[0, 1], y=[3, 4], name="b", row=1, col=2)
    style.layout(fig, "Title", "x", "y", subtitle="a subtitle")
    big = style.projector(fig, height=400, y_title="short")
    size = style.PROJECTOR_FONT
    for axis in (big.layout.xaxis, big.layout.xaxis2, big.layout.yaxis, big.layout.yaxis2):
        assert axis.tickfont.size == size and axis.title.font.size == size
    assert big.layout.yaxis.title.text == big.layout.yaxis2.title.text == "short"
    assert big.layout.xaxis.title.text == "x"
    assert big.layout.title.text == f"Title<br><span style='font-size:{size}px'>a subtitle</span>"
    assert big.layout.font.size == size and big.layout.legend.font.size == size
    assert big.layout.height == 400 and big.layout.margin.b == 70 + 28 * 1  # two legend entries: one row
    assert [t.to_plotly_json() for t in big.data] == [t.to_plotly_json() for t in fig.data]
    att = figures.attention_figure(token_frame(handbook_comp))
    assert style.projector(att).layout.height == att.layout.height  # no height given: kept
    for fig in (big, style.projector(att, 470, "attention")):  # valid, though built unvalidated
        assert json.loads(pio.to_json(go.Figure(fig.to_dict()))) == json.loads(pio.to_json(fig))


def test_the_explorer_figures_built_without_validation_pass_plotly_validation(handbook_comp, long_comp):
    """The builders skip plotly's validation for speed; every property they set must still be valid."""
    one, long = token_frame(handbook_comp), binned_frame(long_comp)
    built = [
        figures.attention_figure(one, text_tokens=True, pinned=one, y_top=0.5),
        figures.binned_attention_figure(long, y_top=0.5),
        figures.error_figure(one, "ci95", 4, y_range=0.1, text_tokens=True, pinned=one),
        figures.error_figure(long, "range", 4, pinned=long),
    ]
    for fig in built:
        validated = go.Figure(fig.to_dict())  # raises on any invalid property
        assert json.loads(pio.to_json(validated)) == json.loads(pio.to_json(fig))  # and changes none
    with pytest.raises(ValueError):
        go.Figure({**built[0].to_dict(), "layout": {"no_such_property": 1}})  # the check can fail


def test_the_live_charts_json_is_plotlys_own(handbook_comp, long_comp):
    """export.figure_json reads the figure's dicts without plotly's copies; what it writes must be what
    fig.to_json() writes, figure by figure, frames and odd values included."""
    one, long = token_frame(handbook_comp), binned_frame(long_comp)
    c = concentration(make_synthetic(SyntheticSpec(context=256, steps=2, layers=2, q_heads=2, kv_heads=1)))
    animated = go.Figure(
        go.Bar(x=np.arange(3), y=np.array([0.1, 0.2, 0.3])),
        frames=[go.Frame(data=[go.Bar(y=np.array([0.3, 0.2, v]))], name=str(i)) for i, v in enumerate((0.1, 0.5))],
    )
    odd = go.Figure(go.Scatter(x=["2026-12-07", "2026-12-08"], y=[1.0, float("nan")]), layout={"title": "odd"})
    built = [
        figures.attention_figure(one, text_tokens=True, pinned=one, y_top=0.5),
        figures.binned_attention_figure(long, y_top=0.5),
        figures.error_figure(one, "ci95", 4, y_range=0.1, text_tokens=True, pinned=one),
        style.projector(figures.error_figure(long, "range", 4, pinned=long), 470, "attention error"),
        grids.heatmap_figure(c.entropy, "Entropy", "nats"),
        tradeoffs.concentration_figure(c.fractions, c.curves),
        animated,
        odd,
    ]
    strict = dict(parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))  # NaN must go as null
    for fig in built:
        assert json.loads(export.figure_json(fig), **strict) == json.loads(fig.to_json(), **strict)
    assert '"bdata"' in export.figure_json(built[0])  # arrays as plotly's typed arrays, as to_json sends them
    assert json.loads(export.figure_json(animated))["frames"][1]["name"] == "1"
