"""Cached scores are keyed by what they depend on, derived, never listed by hand.

A scorer's cache key is the values of the Spec fields it was seen to read (kvviz.policies.reads); the
engine's kept-set key is every field but those that only quantize. Before, each scorer listed its
fields in a `score_key`, and ChunkKV's list left out `chunk_rule`: in one process a "chunks" run after
a "budget" run on the same trace reused stale scores.
"""

import dataclasses
import itertools

import numpy as np
import pytest

from kvviz import SCORERS, Spec, keep_masks
from kvviz.policies import POLICIES, base
from kvviz.policies.base import ScoreContext
from kvviz.policies.reads import ReadLog, SpecReads
from kvviz.sources.synthetic import make_synthetic
from synthetic_util import small_synthetic
from kvviz.policies.chunkkv import inner_scorers
from kvviz.policies.snapkv import observation_window
from kvviz.settings import SETTINGS

CHUNK_INNER = inner_scorers()
CHUNK_RULES = SETTINGS["chunk_rule"].values
QUANT_FIELDS = frozenset(name for name, s in SETTINGS.items() if s.quantizes)

TRACE = make_synthetic(small_synthetic(context=128, steps=6, layers=1))
POSITIONS = [int(p) for p in TRACE.query_positions[TRACE.evaluated_queries]]


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    """Each test starts as a fresh process would: an empty score cache and no fields noted yet."""
    monkeypatch.setattr(base, "READS", ReadLog())
    base._SCORE_CACHE.clear()


def fresh_masks(spec: Spec) -> np.ndarray:
    base._SCORE_CACHE.clear()
    return keep_masks(TRACE, spec, 0, POSITIONS)


def test_chunkkv_settings_one_after_another_equal_fresh_runs():
    """Every chunk_rule, chunk_scorer and chunk_size in turn on one trace, in one process (the rule
    changing fastest, the order that reused stale scores): each kept set equals a run from an empty
    cache. Fails on the hand-written key, which left chunk_rule out."""
    settings = list(itertools.product((4, 8, 20), CHUNK_INNER, CHUNK_RULES))
    base._SCORE_CACHE.clear()
    warm = [
        keep_masks(
            TRACE,
            Spec(sink=2, recent=8, heavy=24, scorer="chunkkv", chunk_size=size, chunk_scorer=inner, chunk_rule=rule),
            0,
            POSITIONS,
        )
        for size, inner, rule in settings
    ]
    stale = [
        s
        for s, got in zip(settings, warm)
        if not np.array_equal(
            got,
            fresh_masks(
                Spec(sink=2, recent=8, heavy=24, scorer="chunkkv", chunk_size=s[0], chunk_scorer=s[1], chunk_rule=s[2])
            ),
        )
    ]
    assert not stale, f"{len(stale)} of {len(settings)} settings reused another setting's scores: {stale[:5]}"


# another valid value of every Spec setting (a new setting needs one here: the property below covers it)
OTHER = {
    "sink": 3,
    "recent": 12,
    "heavy": 30,
    "scorer": "tova",
    "key_bits": 4,
    "value_bits": 4,
    "key_axis": "token",
    "value_axis": "channel",
    "group_size": 16,
    "residual": 8,
    "symmetric": True,
    "zero_point": "int",
    "partial": "quantize",
    "quant_model": "noise",
    "noise_sigma": 0.5,
    "seed": 7,
    "snapkv_window": 4,
    "snapkv_kernel": 3,
    "h2o_normalized": True,
    "positions": "cache",
    "key_format": "e4m3",
    "value_format": "e5m2",
    "fp8_scale": "token",
    "fp8_calibrate": True,
    "rotate": "keys",
    "residual_mode": "hf",
    "allocation": "pyramid",
    "adakv_alpha": 0.5,
    "adakv_floor": "outside-window",
    "pyramid_beta": 2.0,
    "pyramid_schedule": "heavy",
    "ea_horizon": 64,
    "ea_covariance": False,
    "chunk_size": 8,
    "chunk_scorer": "h2o",
    "chunk_rule": "budget",
    "page_size": 4,
    "quest_heads": "kv",
    "compress_every": 8,
    "threshold": 0.02,
    "threshold_scorer": "knorm",
    "duo_streaming": 0.25,
    "merge": True,
}
ONE_SHOT_SCORERS = [
    s for s in SCORERS if not (POLICIES[s].needs_query or POLICIES[s].reconstructs)
]  # per query; the model


def test_every_spec_field_has_another_value_to_try():
    assert set(OTHER) == set(SETTINGS)


@pytest.mark.parametrize("scorer", ONE_SHOT_SCORERS)
def test_changing_any_setting_changes_the_key_or_cannot_change_the_scores(scorer):
    """For every scorer and every Spec field: after a change of that one field, either the cache key
    changes (the scorer reads the field) or the scores, computed afresh, are the same numbers."""
    spec = Spec(sink=2, recent=8, heavy=20, scorer=scorer)
    policy = POLICIES[scorer]
    scores = fresh_scores(policy, spec)
    key = base.READS.key(scorer, spec)
    for name, value in OTHER.items():
        if name == "scorer":
            continue
        try:
            other = spec.with_(**{name: value})
        except ValueError:  # a combination the spec refuses (checked elsewhere)
            continue
        if base.READS.key(scorer, other) != key:
            continue
        assert np.array_equal(fresh_scores(policy, other), scores), (
            f"{scorer}: changing {name} changed the scores but not the cache key"
        )


def fresh_scores(policy, spec):
    base._SCORE_CACHE.clear()
    return policy.scores_at_compression(ScoreContext(TRACE, 0, spec))


@pytest.mark.parametrize("scorer", ONE_SHOT_SCORERS + [s for s in SCORERS if POLICIES[s].needs_query])
def test_the_quantization_fields_never_change_what_is_kept(scorer):
    """Spec.eviction_key leaves out exactly QUANT_FIELDS: changing one of them keeps the same tokens."""
    spec = Spec(sink=2, recent=8, heavy=20, scorer=scorer)
    kept = fresh_masks(spec)
    for name in sorted(QUANT_FIELDS):
        try:
            other = spec.with_(**{name: OTHER[name]})
        except ValueError:
            continue
        assert other.eviction_key == spec.eviction_key
        assert np.array_equal(fresh_masks(other), kept), f"{scorer}: {name} changed the kept set"


def test_a_view_of_the_spec_notes_fields_read_through_properties_and_methods():
    read, outer = set(), set()
    view = SpecReads(SpecReads(Spec(recent=10), outer), read)
    assert view.budget == 10  # a property: the fields it reads
    assert read == outer == {"sink", "recent", "heavy"}
    read.clear()
    assert observation_window(view) == 10  # a scorer's helper function: what it reads
    assert read == {"snapkv_window", "recent"}
    assert view.with_(sink=1).sink == 1  # a method may read anything
    assert read == set(SETTINGS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.sink = 3


class Counting(POLICIES["random"].__class__):
    """The random scorer (it reads the spec's seed) with a counter of its passes and an outside setting (as
    a plug-in might read a file): the setting reaches the key through score_key, which may read the spec."""

    name = "counting-random"

    def __init__(self, outside: float = 1.0):
        self.outside, self.passes = outside, 0

    def score(self, ctx):
        self.passes += 1
        return super().score(ctx) * self.outside

    def score_key(self, spec):
        return (self.outside, spec.scorer)


def test_the_cache_answers_a_repeated_call_and_keeps_its_answer_read_only():
    """The same scorer, trace, layer and settings: one pass over the context, the same array twice, which a
    caller cannot write into (it is shared); another layer or a changed setting is a pass of its own."""
    base._SCORE_CACHE.clear()
    policy, spec = Counting(), Spec(sink=2, recent=8, heavy=20, scorer="random")
    first = policy.scores_at_compression(ScoreContext(TRACE, 0, spec))
    again = policy.scores_at_compression(ScoreContext(TRACE, 0, spec.with_(heavy=5)))  # budgets: not read
    assert again is first and policy.passes == 1
    assert not first.flags.writeable
    other = make_synthetic(small_synthetic(context=128, steps=6, layers=2))
    policy.scores_at_compression(ScoreContext(other, 0, spec))
    policy.scores_at_compression(ScoreContext(other, 1, spec))
    policy.scores_at_compression(ScoreContext(other, 1, spec))
    assert policy.passes == 3


def test_a_plugins_own_key_keeps_its_scores_apart():
    """score_key: what a plug-in's scores depend on besides the trace and the Spec (here an outside factor):
    scorers of one name that differ there do not share cached scores; a Spec field the scorer reads (the
    seed) keeps them apart with nothing listed."""
    base._SCORE_CACHE.clear()
    spec = Spec(sink=2, recent=8, heavy=20, scorer="random")
    one = Counting(1.0).scores_at_compression(ScoreContext(TRACE, 0, spec))
    two = Counting(2.0).scores_at_compression(ScoreContext(TRACE, 0, spec))
    np.testing.assert_array_equal(two, 2 * one)
    policy = Counting(1.0)
    policy.scores_at_compression(ScoreContext(TRACE, 0, spec))
    reseeded = policy.scores_at_compression(ScoreContext(TRACE, 0, spec.with_(seed=3)))
    assert policy.passes == 1 and not np.array_equal(reseeded, one)


def test_the_read_log_keys_a_name_by_the_fields_noted_for_it():
    log = ReadLog()
    spec = Spec(recent=10, seed=3)
    assert log.key("x", spec) == ((), ()) and log.fields("x") == frozenset()
    log.note("x", {"seed"})
    log.note("y", {"recent"})
    log.note("x", {"recent"})  # the fields only grow
    assert log.key("x", spec) == (("recent", "seed"), (10, 3)) and log.fields("x") == {"recent", "seed"}
    assert log.key("y", spec) == (("recent",), (10,))
