"""The Decode timeline as one animated figure (kvviz.plots.timeline.timeline_animation)."""

from __future__ import annotations

import numpy as np

from kvviz.plots.timeline import timeline_animation
from kvviz.sources.synthetic import SyntheticSpec, make_synthetic
from kvviz.spec import Spec
from kvviz.analysis.timeline import timeline


def test_one_frame_per_step_with_the_step_line_and_the_regrets():
    trace = make_synthetic(SyntheticSpec(context=64, steps=10, topic_shift=6.0))
    tl = timeline(trace, Spec(sink=2, recent=6, heavy=4), policies=("h2o", "streaming"))
    fig = timeline_animation(tl, step=3, shift_step=5)
    assert [f.name for f in fig.frames] == [str(s) for s in range(10)]
    assert fig.layout.sliders[0].active == 3 and len(fig.layout.sliders[0].steps) == 10
    assert fig.layout.updatemenus[0].buttons[0].args[0] is None  # Play: every frame, in the browser
    for s in (0, 7):
        frame = fig.frames[s]
        lines = [sh for sh in frame.layout.shapes if sh.line.dash == "dot"]
        assert lines[0].x0 == s and all(sh.y0 == s for sh in lines[1:]) and len(lines) == 3  # regret + 2 maps
        assert f"h2o {tl.policies['h2o'].regret[s]:.3f}" in frame.layout.title.text
        assert f"position {int(tl.positions[s])}" in frame.layout.title.text
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert len(heat) == 2
    assert np.array_equal(np.asarray(heat[0].z), tl.policies["h2o"].states(tl.positions))
    regret = [t for t in fig.data if t.type == "scatter" and t.legendgroup == "regret"]
    assert np.allclose(regret[1].y, tl.policies["streaming"].regret)


def test_presenting_the_maps_alone_with_one_policy_and_compression_during_decoding():
    """Presentation mode: a map per policy and no regret chart, the step's lines on the maps only, the
    controls above the maps; with one policy whose cache is scored again every 4 steps too (its legend's
    line belongs to the first map, the only one)."""
    trace = make_synthetic(SyntheticSpec(context=64, steps=10, topic_shift=6.0))
    tl = timeline(trace, Spec(sink=2, recent=6, heavy=4), policies=("snapkv",), compress_every=4)
    fig = timeline_animation(tl, step=2, present=True)
    assert [t.type for t in fig.data if t.type == "heatmap"] == ["heatmap"] and not any(
        t.legendgroup == "regret" for t in fig.data
    )
    dots = [sh for sh in fig.frames[5].layout.shapes if sh.line.dash == "dot"]
    assert len(dots) == 1 and dots[0].y0 == 5 and dots[0].yref == "y"  # the one map's step line
    assert fig.layout.updatemenus[0].y > 1 and fig.layout.sliders[0].y > 1
    assert fig.frames[5].layout.title.text.startswith("Step 5<br>regret: snapkv")
    assert any(sh.line.color == "#AA3377" for sh in fig.layout.shapes)  # scored again: its lines are drawn
